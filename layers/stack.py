"""BlockStack: N blocks initialised stacked, scanned, with remat and offload applied from outside.

The layers' parameters are created with `nnx.vmap`, so every parameter has a
leading layer axis (logical axis "layers"). The forward pass is a `lax.scan`
over that axis: one compiled block body however deep the model (fast compiles),
and the setting under which XLA's host offload really lowers device memory
(docs/DESIGN.md section 4: with a Python loop, offload can raise it).

Between blocks the residual stream is pinned to the batch sharding
(`layers.sharding.constrain`): blocks, subclasses too, hand each other batch-sharded
activations whatever their forward() does inside.

A `RematPlan` splits the stack into segments; each segment is its own scan whose
body is wrapped in `jax.checkpoint` with that segment's policy (or not wrapped,
for "no remat"). At build time the stack traces one block abstractly and
collects the names it tags; a plan that names anything else is an error, so a
policy can never silently do nothing.

A `layers.layer_hook.LayerHook` in force while the stack is traced runs
before each layer inside the scan (the train step's update deferred into the
forward pass uses it); the stack then needs one activation policy throughout.

Block weights in pinned host memory (a recipe's offload.params=host) are
created there a layer at a time and brought into HBM one layer per scan
iteration (layers/host_weights.py); the stack notices them by their memory
space, and keeps their device copies out of every segment's remat residuals.

Layers that differ (layers/layer_pattern.py). Per-layer values (Gemma's
sliding window, RoPE base and scale per layer) are `LayerValues` arrays [L]
scanned as data beside the weights and handed to each block in its
`BlockContext`: the weights stay one stack, the body one compiled block, and
remat segments, the host weight stream and the layer hook slice them with the
weights. Layers of another structure are a run of their own (`StackRun`):
their own weight stack and their own scans, one per remat segment the run
meets.

Auxiliary outputs (layers/aux_outputs.py): each layer's body collects what
its block emits (an MoE layer's router statistics) and returns it as a scan
output; the pieces' stacked values are joined along the layer axis and
emitted to the collector the caller opened (the training loss), under the
same keys. A block that emits nothing adds nothing to the program.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spillway.layers import aux_outputs, host_weights, layer_hook, lora, names
from spillway.layers.block import BlockConfig, BlockContext, TransformerBlock
from spillway.layers.errors import ConfigError
from spillway.layers.layer_pattern import LayerSettings, StackRun, check_runs, needs_values, run_bounds, values_of
from spillway.layers.offload import OffloadPolicy, RematPlan, presets_for
from spillway.layers.sharding import constrain


def tagged_names(closed_jaxpr) -> set[str]:
    """Every checkpoint_name tag in a (closed) jaxpr, sub-jaxprs included."""
    found: set[str] = set()

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "name":
                found.add(eqn.params["name"])
            for sub in jex_core.jaxprs_in_params(eqn.params):
                visit(sub)

    visit(closed_jaxpr.jaxpr)
    return found


def host_offloaded_names(closed_jaxpr) -> collections.Counter:
    """How many tagged values of each name a (closed) jaxpr copies to host memory, sub-jaxprs included.

    Under a remat policy that offloads a name, JAX's partial evaluation puts a
    `device_put` to `MemorySpace.Host` on that residual in the forward pass. On
    CPU memory kinds lower to no-ops, so this jaxpr-level view is where a CPU
    test can see placement; the compiled HLO of a deviceless GPU compile (S(5)
    buffers, recipes/plan/hlo.py) is the ground truth.
    """
    found: collections.Counter = collections.Counter()

    def visit(jaxpr):
        named = {}
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "name":
                named[eqn.outvars[0]] = eqn.params["name"]
            elif eqn.primitive.name == "device_put" and any(
                    getattr(d, "name", None) == "Host" for d in eqn.params.get("devices", ())):
                for var in eqn.invars:
                    found[named.get(var, "<untagged>")] += 1
            for sub in jex_core.jaxprs_in_params(eqn.params):
                visit(sub)

    visit(closed_jaxpr.jaxpr)
    return found


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _users(block_cls: type) -> bool:
    return block_cls.__module__.split(".")[0] != "spillway"


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}{' ...' if len(text) > 300 else ''}"


def _build_block(block_cls: type, cfg: BlockConfig, rngs: nnx.Rngs):
    """block_cls(cfg, rngs=rngs); a user's block whose constructor does not take that, or fails, is named as
    such (its own error was "internal error, please report it")."""
    try:
        block = block_cls(cfg, rngs=rngs)
    except TypeError as error:
        if not _users(block_cls):
            raise
        raise ConfigError(f"block {_class_path(block_cls)}: building it as {block_cls.__name__}(cfg, rngs=rngs) "
                          f"failed ({error}); a block's __init__ takes (cfg, *, rngs) and passes both to "
                          f"TransformerBlock.__init__") from None
    except Exception as error:   # noqa: BLE001 (whatever the user's __init__ raises is named with the block)
        if not _users(block_cls):
            raise
        raise ConfigError(f"block {_class_path(block_cls)}: its __init__ raised {_one_line(error)}") from None
    if _users(block_cls):
        _check_no_bare_arrays(block)
    lora.attach(block, rngs)   # the LoRA adapters a recipe asks for (layers/lora.py); none outside one
    return block


def _check_no_bare_arrays(block) -> None:
    """ConfigError for an array a block keeps as a plain attribute (`self.slopes = jnp.linspace(...)`): nnx takes
    it for static metadata, and the run failed later with flax's "arrays cannot be passed as metadata fields",
    naming neither the block nor the attribute."""
    bare = [".".join(str(part) for part in path) for path, value in nnx.iter_graph(block)
            if isinstance(value, (jax.Array, np.ndarray)) and not isinstance(value, nnx.Variable)]
    if bare:
        raise ConfigError(f"block {_class_path(type(block))} keeps arrays as plain attributes ({', '.join(bare[:4])}): "
                          f"make a trained one an nnx.Param, and compute a fixed one in forward (or keep it as "
                          f"Python numbers)")


def _check_only_params(blocks) -> None:
    """ConfigError for a block holding variables that are not nnx.Param (a frozen nnx.Variable, a BatchStat
    counter, a Dropout's RNG state): the train step trains every variable of the model and carries no block
    state from one step to the next, so a frozen buffer was trained by AdamW without a word, a counter's
    updates were dropped, and a Dropout's key was an internal error."""
    others = [(path, type(value).__name__) for path, value in nnx.iter_graph(blocks)
              if isinstance(value, nnx.Variable) and not isinstance(value, nnx.Param)]
    if others:
        named = ", ".join(f"{'.'.join(str(part) for part in path)} ({kind})" for path, kind in others[:4])
        more = f" and {len(others) - 4} more" if len(others) > 4 else ""
        raise ConfigError(f"block {_class_path(type(blocks))} holds variables that are not nnx.Param: {named}{more}; "
                          f"spillway trains every variable of a model and keeps no other state between steps: "
                          f"make a fixed value a constant (a Python number, or an array computed in forward), "
                          f"a trained one an nnx.Param; no dropout (no RNG state in a block)")


class BlockStack(nnx.Module):
    """The layers of a model: stacked weights per run of one structure, scanned per remat segment.

    `BlockStack(cfg, num_layers, ...)` is a uniform stack: every layer is
    `cfg`. `layer_settings` (one `LayerSettings` per layer) gives layers their
    own window / RoPE base / RoPE scale, scanned as `LayerValues` beside the
    weights; `runs` (`StackRun`s covering the layers in order) gives
    consecutive layers another structure, each run its own weight stack. One
    run keeps its weights under `blocks` (the path every checkpoint and
    Hugging Face table of a uniform stack uses); several keep them under
    `runs` (an nnx.List of the runs' stacked blocks, first layers first).
    """

    def __init__(self, cfg: BlockConfig, num_layers: int, *, block_cls: type = TransformerBlock,
                 remat: str | OffloadPolicy | RematPlan = "recompute_all", rngs: nnx.Rngs,
                 runs: Sequence[StackRun] | None = None, layer_settings: Sequence[LayerSettings] | None = None):
        if num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {num_layers}")
        runs = check_runs(runs or (StackRun(cfg, num_layers),), num_layers)
        classes = tuple(run.block_cls or block_cls for run in runs)
        for cls in classes:
            if not (isinstance(cls, type) and issubclass(cls, TransformerBlock)):
                raise TypeError(f"block_cls must subclass TransformerBlock, got {cls!r}")
        if layer_settings is not None and len(layer_settings) != num_layers:
            raise ConfigError(f"{len(layer_settings)} per-layer settings for a stack of {num_layers} layers")
        self.num_layers = num_layers
        self.block_classes = classes   # each run's block class: an export refuses those no HF class computes
        self.plan = RematPlan.parse(remat)
        self.segments = tuple(self.plan.resolve(num_layers))  # hashable: graphdefs are jit static args
        self.run_bounds = run_bounds(runs)
        # Static (hashable) per-layer settings, or None when every layer is its run's block config as is:
        # then the blocks read their static values and the program is the uniform stack's.
        self.layer_settings = tuple(layer_settings) if needs_values(layer_settings, runs) else None

        stacks = [self._make_blocks(run.block, run.num_layers, cls, rngs) for run, cls in zip(runs, classes)]
        for stack in stacks:
            _check_only_params(stack)
        for stack in stacks:
            for _, var in nnx.iter_graph(stack):
                if isinstance(var, nnx.Variable) and "logical_axes" in var.get_metadata():
                    var.set_metadata(logical_axes=(names.LAYERS,) + tuple(var.get_metadata()["logical_axes"]))
        if len(stacks) == 1:
            self.blocks = stacks[0]
        else:
            self.runs = nnx.List(stacks)
        tagged = [self._trace_tagged_names(stack, run.block) for stack, run in zip(stacks, runs)]
        self.block_names = frozenset().union(*tagged)
        unknown = self.plan.names() - self.block_names
        if unknown:
            moe = bool(self.block_names & set(names.MOE_ACTIVATION_NAMES))
            kind = ("an MoE block, whose expert activations only the moe_* presets name (README, Offload "
                    "policies)" if moe else "a dense block")
            raise ValueError(
                f"remat plan names {sorted(unknown)}, which {'/'.join(sorted({c.__name__ for c in classes}))} "
                f"never tags (it tags {sorted(self.block_names)}); the policy would silently do nothing. This is "
                f"{kind}; the presets that serve it: {', '.join(presets_for(self.block_names))}")

    def run_stacks(self) -> list:
        """The stacked blocks of each run, first layers first."""
        return [self.blocks] if hasattr(self, "blocks") else list(self.runs)

    def pieces(self, split_at: int | None = None) -> list[tuple[int, int, int, OffloadPolicy]]:
        """[(run, first layer, stop, policy)]: each run cut at the remat plan's segment boundaries, and at
        `split_at`, the layer where split weights go from HBM to host memory (layers/host_weights.py).

        Every boundary is honoured: the per-layer values are sliced with the
        weights, so a segment may start at any layer, inside a run or at its edge.
        """
        out = []
        for run, (run_start, run_stop) in enumerate(self.run_bounds):
            for seg_start, seg_stop, policy in self.segments:
                start, stop = max(run_start, seg_start), min(run_stop, seg_stop)
                cuts = [start] + ([split_at] if split_at is not None and start < split_at < stop else []) + [stop]
                out.extend((run, lo, hi, policy) for lo, hi in zip(cuts, cuts[1:]) if lo < hi)
        return out

    @staticmethod
    def _make_blocks(cfg: BlockConfig, num_layers: int, block_cls: type, rngs: nnx.Rngs):
        """The stacked blocks: made at once by a vmap, or, where their weights are to live in host memory
        (host_weights.initialised_in_host_memory), one layer per scan iteration, sent to host as made."""
        setting = host_weights.initial_setting()
        if setting is None:
            @nnx.split_rngs(splits=num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make_all(rngs):
                return _build_block(block_cls, cfg, rngs)
            return make_all(rngs)

        @nnx.split_rngs(splits=num_layers)
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def make_one(carry, rngs):
            block = _build_block(block_cls, cfg, rngs)
            host_weights.send_layer_to_host(block, setting)
            return carry, block
        return make_one(0, rngs)[1]

    @staticmethod
    def _trace_tagged_names(blocks, cfg: BlockConfig) -> set[str]:
        graphdef, state = nnx.split(blocks)
        layer_state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), state)
        x = jax.ShapeDtypeStruct((1, 8, cfg.d_model), cfg.execution.compute_dtype)

        def one_block(layer_state, x_btd):
            positions_bt = jnp.arange(x_btd.shape[1])[None]
            return nnx.merge(graphdef, layer_state)(x_btd, BlockContext(positions_bt))

        try:
            jaxpr, returned = jax.make_jaxpr(one_block, return_shape=True)(layer_state, x)
        except Exception as error:   # noqa: BLE001 (a user's forward: its error named with the block)
            if not _users(type(blocks)):
                raise
            hint = (" (a Python `if` on a traced value: use jnp.where or lax.cond)"
                    if "TracerBoolConversion" in type(error).__name__ else
                    # a TypeError or AttributeError is often the call itself (another signature, the arguments in
                    # another order, another return); the rest are the forward's own, which the contract would
                    # only send looking elsewhere
                    "; a block's forward(x_btd, ctx, cache) returns (x_btd, cache)"
                    if isinstance(error, (TypeError, AttributeError)) else "")
            raise ConfigError(f"block {_class_path(type(blocks))}: calling it as block(x_btd, ctx) raised "
                              f"{_one_line(error)}{hint}") from None
        if not isinstance(returned, (tuple, list)) or len(returned) != 2:
            if hasattr(returned, "shape"):
                what = f"an array of shape {returned.shape}"
            elif isinstance(returned, (tuple, list)):
                what = f"a {type(returned).__name__} of {len(returned)}"
            else:
                what = type(returned).__name__
            raise ConfigError(f"block {_class_path(type(blocks))}: forward() returns {what}; a block returns a "
                              f"pair (the residual stream, same shape and dtype as its input, cache): "
                              f"`return x_btd, cache`")
        out = returned[0]
        if (out.shape, out.dtype) != (x.shape, x.dtype):
            # else lax.scan fails with a message about carry types that names no block
            raise ConfigError(f"block {_class_path(type(blocks))}: forward() returns an array of shape "
                              f"{out.shape} ({out.dtype}) for an input of {x.shape} ({x.dtype}); a block returns "
                              f"(the residual stream, same shape and dtype as its input, cache)")
        return tagged_names(jaxpr)

    def _values(self, start: int, stop: int):
        """The LayerValues of layers [start, stop) (constants of the program), or None for static values."""
        if self.layer_settings is None:
            return None
        return jax.tree.map(jnp.asarray, values_of(self.layer_settings[start:stop]))

    def __call__(self, x_btd: jax.Array, ctx: BlockContext, cache: dict | None = None):
        """Runs all layers. `cache` (decoding) holds arrays with a leading layer axis."""
        split = [nnx.split(stack) for stack in self.run_stacks()]
        hook = layer_hook.current()
        if hook is not None:
            if cache is not None or len(self.segments) != 1 or len(split) != 1:
                raise ConfigError(
                    f"a layer hook (offload.update=next_forward) runs in training with one activation policy "
                    f"for every layer and one run of layers; this stack has {len(self.segments)} segments and "
                    f"{len(split)} runs" + (" and a decoding cache" if cache is not None else ""))
            graphdef, state = split[0]
            return self._scan_with_hook(graphdef, state, self._values(0, self.num_layers), x_btd, ctx,
                                        self.segments[0][2], hook), None
        new_caches, aux_per_piece = [], []
        # Split weights (offload.params=host:N): one stack, cut where its weights go to host memory.
        split_at = host_weights.split_boundary(split[0][1]) if len(split) == 1 else None
        # The weights across the turn (offload.params_keep=K): the last K layers' host weights come in once.
        keep_at = self.num_layers - host_weights.kept_layers() if cache is None else self.num_layers
        for run, start, stop, policy in self.pieces(split_at):
            graphdef, state = split[run]
            offset = self.run_bounds[run][0]
            seg_cache = None if cache is None else jax.tree.map(lambda a: a[start:stop], cache)
            x_btd, (seg_cache, seg_aux) = self._scan(graphdef, host_weights.layer_rows(state, start - offset,
                                                                                       stop - offset),
                                                     self._values(start, stop), x_btd, ctx, seg_cache, policy,
                                                     kept=max(0, stop - max(start, keep_at)))
            new_caches.append(seg_cache)
            aux_per_piece.append(seg_aux)
        # What the layers emitted (layers/aux_outputs.py), stacked over the layers, to the model's collector.
        aux_outputs.emit_all(aux_outputs.concat_layers(aux_per_piece))
        if cache is None:
            return x_btd, None
        return x_btd, jax.tree.map(lambda *parts: jnp.concatenate(parts, axis=0), *new_caches)

    @staticmethod
    def _scan_with_hook(graphdef, state, values, x_btd, ctx, policy: OffloadPolicy, hook):
        """All layers in one scan, `hook.before_layer` run before each outside the rematerialised body; a hook
        with `resident_layers` = R > 0 (layer_hook.py) has its first R layers in a scan of their own before,
        `hook.before_resident_layer` run before each, so that the two kinds of layer compile apart (the
        resident ones move nothing over the host link); `collect` gets both scans' outputs joined."""
        body = BlockStack._layer_body(graphdef, state, ctx, policy)

        def hooked(before, carry, layer_index, layer):
            x_btd, hook_carry = carry
            layer_state, layer_values = layer
            hook_carry, layer_state, outputs = before(hook_carry, layer_index, layer_state)
            x_btd, (_, aux) = body(x_btd, (layer_state, None, layer_values, None))
            return (x_btd, hook_carry), (outputs, aux)

        (x_btd, hook_carry), parts = layer_hook.scan_hooked_layers(
            hook, hooked, (x_btd, hook.start()), (state, values), jax.tree.leaves(state)[0].shape[0])
        hook.collect(layer_hook.join_layers([outputs for outputs, _ in parts]), hook_carry)
        aux_outputs.emit_all(aux_outputs.concat_layers([aux for _, aux in parts]))
        return x_btd

    @staticmethod
    def _scan(graphdef, seg_state, seg_values, x_btd, ctx, seg_cache, policy: OffloadPolicy, kept: int = 0):
        """One scan over a piece's layers; its last `kept` layers' host weights brought into HBM once, before
        it, for the forward and the backward pass (offload.params_keep; layers/host_weights.py)."""
        kept_rows = None
        if kept and host_weights.any_in_host_memory(seg_state):
            kept_rows = host_weights.kept_rows(seg_state, kept)
        body = BlockStack._layer_body(graphdef, seg_state, ctx, policy, kept_rows)
        # Each layer's index in the scan, scanned beside its weights: whether it is a kept one.
        layers = None if kept_rows is None else jnp.arange(jax.tree.leaves(seg_state)[0].shape[0])
        return jax.lax.scan(body, x_btd, (seg_state, seg_cache, seg_values, layers))

    @staticmethod
    def _layer_body(graphdef, seg_state, ctx, policy: OffloadPolicy, kept_rows=None):
        """One layer as a scan body (x, (layer state, layer cache, layer values)) -> (x, (layer cache, aux)),
        rematerialised as `policy` says; aux is the dict of what the layer emitted (layers/aux_outputs.py),
        empty for blocks that emit nothing (their program is unchanged). `kept_rows`
        (host_weights.KeptRows): the piece's last layers take their host weights from an HBM copy
        made before the scan instead of copying them in (host_weights.layer_to_device).

        It returns the residual stream and the cache only, never the module
        state: a body that hands back the layer's weights makes the scan stack
        them again, a second copy of every weight (tests/layers/test_stack_patterns.py).
        """
        weights_on_host = host_weights.any_in_host_memory(seg_state)

        def body(x_btd, layer):
            # The residual stream is pinned at the block boundary too, so a
            # subclass's own forward() keeps the batch layout between blocks.
            layer_state, layer_cache, layer_values, layer_index = layer
            # Host-resident weights (offload.params=host) come into HBM one layer per iteration.
            layer_state = host_weights.layer_to_device(layer_state, kept_rows, layer_index)
            layer_ctx = ctx if layer_values is None else ctx._replace(layer_values=layer_values)
            block = nnx.merge(graphdef, layer_state)
            given = layer_cache
            x_btd, layer_cache = block(constrain(x_btd, names.RESIDUAL_AXES), layer_ctx, layer_cache)
            if given is not None and jax.tree.structure(layer_cache) != jax.tree.structure(given):
                # else decoding failed later with "not enough values to unpack", naming no block
                raise ConfigError(f"block {_class_path(type(block))}: forward() given a decoding cache returned "
                                  f"{type(layer_cache).__name__} in its place; a block returns the cache its "
                                  f"attention updated: `x_btd, cache = super().forward(x_btd, ctx, cache)` ... "
                                  f"`return x_btd, cache`")
            return constrain(x_btd, names.RESIDUAL_AXES), layer_cache

        # Inside the checkpoint: the emitted values are ordinary outputs of the rematerialised body.
        body = aux_outputs.collected_in_body(body)
        kept = host_weights.kept_shapes(kept_rows)
        if policy.remat:
            jax_policy = policy.to_jax()
            if weights_on_host:
                jax_policy = host_weights.never_save_device_weights(jax_policy, kept)
            # prevent_cse=False: inside scan, CSE cannot merge the recompute away.
            body = jax.checkpoint(body, policy=jax_policy, prevent_cse=False)
        elif weights_on_host:
            # "No remat" still must not keep every layer's device weights for the
            # backward pass: save everything but them (layers/host_weights.py).
            body = jax.checkpoint(body, policy=host_weights.never_save_device_weights(
                jax.checkpoint_policies.everything_saveable, kept), prevent_cse=False)
        return body
