"""AdamW for the train loop, with optimizer state that can live in pinned host memory.

The maths is optax's

    optax.chain(optax.clip_by_global_norm(clip_norm),
                optax.adamw(schedule, b1, b2, eps, weight_decay, mask=decay_mask))

written out once per piece, op for op (tests/recipes/test_optimizer.py checks
it against that chain for 20 steps), so that one function serves every
placement and device and host leaves give the same numbers:

* state_memory="device": the leaf's mu / nu / master live in HBM and are
  updated whole, as optax would.
* state_memory="host": they live in `pinned_host` memory. Inside the jitted
  step, stacked leaves (leading layer axis: the scanned blocks) are streamed
  through HBM one layer at a time, double-buffered (recipes/train/host_optimizer.py),
  their state held as two buffers per array (`LayerHalves`: first and second
  half of the layers) so that the prefetch of one layer and the write-back of
  the previous one use the host link in both directions at once;
  large non-stacked leaves (embedding, head) are streamed the same way in
  pieces of rows, one leaf after the other; small ones (the final norm) visit
  HBM whole.
  On a deviceless H200 compile this cuts HBM to less than half of what the
  state on device needs (docs/DESIGN.md section 6; today's figures from
  benchmarks/optimizer_state_toy.py are in BENCHMARKS.md).
* update_on_host=True: host leaves are updated by the host CPU instead
  (compute type "device_host", layers/jax_compat.on_host); the state never enters HBM
  (params and grads only), but the update runs at host memory speed
  and XLA gives the host computation temporaries the size of the state.

Gradients are upcast to fp32 first: the global norm, the moments and the
update are computed in fp32 whatever the gradient dtype (identical to optax
given fp32 gradients). Low-precision (bf16) parameters get an fp32 master copy
in the state (cfg.master_weights); the new parameter is then
master.astype(bf16). Without a master copy (master_weights=False) a bf16
parameter is updated in fp32 and rounded back each step.

Where state lives, and whether weight decay applies, is decided per
parameter by a `LeafLayout` tree; `make_layouts` builds one from an
nnx.State, reading the parameters' metadata (layers/params.py):
`logical_axes` (a leading "layers" axis means stacked), an optional
`optimizer_memory` override, and `weight_decay` (False on norms, biases and
embeddings).

Host state is created by the host CPU too (`init`), so initialising never
needs the state in HBM either.

Checkpoints hold `Optimizer.saved_form(state)`: every state array whole, one per
parameter, whatever its placement (LayerHalves joined by the host CPU), so a
checkpoint restores under any placement; `from_saved_form` splits it again.
Saving therefore holds one extra host copy of the halved state while the
checkpoint is written.

The train step donates the optimizer state on every platform (the new state
is written over the old; `donate_opt_state_ok()`).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from spillway.layers.errors import ConfigError, SpillwayError, require_non_negative, require_positive
from spillway.recipes.train import host_optimizer as streaming

DEVICE = "device"
HOST = "host"
STATE_MEMORIES = (DEVICE, HOST)
PINNED_HOST = "pinned_host"  # the XLA memory kind that holds host-resident state


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW's hyperparameters: what a recipe sets in its `optimizer` section.

    Two things the optimizer needs are not here, because the run already has
    one field for each: how long the schedule runs (`total_steps`, from the
    recipe's train.steps) and where the state lives by default
    (`state_memory`, from offload.optimizer_state). They are arguments of
    `Optimizer` and `make_layouts`, so no setting can be written twice and
    silently overwritten.
    """

    learning_rate: float = 3e-4
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float | None = 1.0
    master_weights: bool = True    # fp32 master copy in the state for low-precision params
    # Host leaves updated by the host CPU (layers/jax_compat.on_host) instead of
    # streamed through HBM: no state in HBM at all, but host-speed maths and a
    # host temp the size of the state (benchmarks/optimizer_state_toy.py).
    update_on_host: bool = False

    def __post_init__(self):
        require_positive("optimizer", learning_rate=self.learning_rate, clip_norm=self.clip_norm)
        # eps > 0: a parameter whose gradient is always zero (an unused embedding row) has
        # mu = nu = 0, and 0 / (sqrt(0) + 0) is NaN.
        require_positive("optimizer", eps=self.eps)
        require_non_negative("optimizer", warmup_steps=self.warmup_steps, weight_decay=self.weight_decay)
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optimizer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"optimizer.{name} must be in [0, 1), got {getattr(self, name)}")


def check_schedule_steps(cfg: OptimizerConfig, total_steps: int) -> None:
    """The schedule needs 0 <= warmup_steps < total_steps (cosine decay over the rest)."""
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps <= 0:
        raise ConfigError(f"the schedule's total_steps must be a positive integer, got {total_steps!r}")
    if cfg.warmup_steps >= total_steps:
        raise ConfigError(f"optimizer.warmup_steps ({cfg.warmup_steps}) must be fewer than the schedule's "
                          f"{total_steps} steps")


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """How the optimizer treats one parameter leaf."""
    stacked: bool        # leading axis is the layer axis (scanned blocks): stream it a layer at a time
    state_memory: str    # "device" | "host", already resolved (metadata override or config default)
    decay: bool          # weight decay applies
    master: bool = False  # keep an fp32 master copy (low-precision params with cfg.master_weights)
    # Non-stacked host leaves: the axis to stream the update along in pieces
    # of rows (one the parameter's sharding does not split); None: one piece.
    stream_axis: int | None = None

    def __post_init__(self):
        if self.state_memory not in STATE_MEMORIES:
            raise ValueError(f"LeafLayout.state_memory must be one of {STATE_MEMORIES}, got {self.state_memory!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OptState:
    """AdamW state. mu / nu / master mirror the params tree; master holds None where no copy is kept."""
    count: jax.Array  # int32 scalar: steps taken
    mu: Any
    nu: Any
    master: Any


def make_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to cfg.learning_rate, then cosine decay to min_lr_ratio * learning_rate
    at `total_steps` (warmup included)."""
    check_schedule_steps(cfg, total_steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=total_steps, end_value=cfg.learning_rate * cfg.min_lr_ratio)


# --- platform checks ---------------------------------------------------------

def host_memory_available(device: jax.Device | None = None) -> bool:
    """Whether `device` (default: the first runtime device) has a pinned_host memory space."""
    device = device or jax.local_devices()[0]
    try:
        return any(m.kind == PINNED_HOST for m in device.addressable_memories())
    except Exception:  # platforms without the memories API
        return False


def donate_opt_state_ok(platform: str | None = None) -> bool:
    """Whether the train step may donate the optimizer state: on every platform, CPU included.

    Donated, the step writes the new state over the old one (each host input
    aliases its host output), so a step never holds two copies of the state.
    It used to be False on CPU: a donated pinned_host buffer that XLA aliased
    to a device-memory output of the same shape aborted the process there.
    JAX 0.10.2 pairs a donated buffer only with an output of its own memory
    kind (it warns "Some donated buffers were not usable: float32<host>" and
    copies instead), and the train step with host state, donated, runs on CPU
    (tests/recipes/test_host_memory.py; docs/DESIGN.md section 4). `platform`
    is kept for callers that pass the target's.
    """
    del platform
    return True


def _meminfo_total_bytes() -> int:
    from spillway.recipes.train.gpu_allocators import host_ram_bytes
    ram = host_ram_bytes()
    if ram is None:
        raise RuntimeError("MemTotal not found in /proc/meminfo")
    return ram


class HostMemoryError(SpillwayError, MemoryError):
    """The run's pinned host memory (optimizer state, host weights, their gradients) would not fit in RAM."""


def check_host_memory(bytes_needed: int, host_ram_bytes: int | None = None, breakdown: str = "") -> None:
    """Raise HostMemoryError if `bytes_needed` of pinned host memory exceed the host's RAM.

    Pinned memory cannot be swapped, so overcommitting it kills the process (or
    the machine) mid-run instead of failing early. Call this before anything
    is allocated, with the per-process host bytes (recipes/train/step.py
    `pinned_host_bytes`); `breakdown` says what they are made of.
    """
    if bytes_needed < 0:
        raise ValueError(f"bytes_needed must be >= 0, got {bytes_needed}")
    if host_ram_bytes is None:
        host_ram_bytes = _meminfo_total_bytes()
    if bytes_needed > host_ram_bytes:
        raise HostMemoryError(
            f"this run needs {bytes_needed / 2**30:.2f} GiB of pinned host memory"
            f"{f' ({breakdown})' if breakdown else ''}, but this host has {host_ram_bytes / 2**30:.2f} GiB "
            f"of RAM: keep more on device (offload.params=device, offload.optimizer_state=device, or "
            f"optimizer_memory='device' metadata on some parameters) or shard it over more hosts")


# --- layouts -----------------------------------------------------------------

def _is_variable(x) -> bool:
    from flax import nnx
    return isinstance(x, nnx.Variable)


def rank_decay(logical_axes: tuple | None, shape: tuple[int, ...], stacked: bool) -> bool:
    """The fallback for parameters whose metadata does not say: decay matrices; not vectors (norms,
    biases) or vocab-first tables (embeddings)."""
    from spillway.layers import names
    per_layer_ndim = len(shape) - (1 if stacked else 0)
    if per_layer_ndim < 2:
        return False
    return not (logical_axes and logical_axes[0] == names.VOCAB)


def _stream_axis(logical_axes: tuple | None, shape: tuple[int, ...]) -> int | None:
    """Axis to stream a non-stacked leaf's update along: the largest one FSDP does not shard.

    A dynamic slice along a sharded axis would make XLA gather the leaf; the
    fsdp mesh axis shards weights on their embed axis, so the vocabulary axis
    of an embedding or head is the one to cut. Vectors: None (one piece).
    """
    from spillway.layers.sharding import DEFAULT_RULES
    if len(shape) < 2:
        return None
    axes = logical_axes or (None,) * len(shape)
    allowed = [i for i, name in enumerate(axes) if "fsdp" not in DEFAULT_RULES.get(name, ())]
    return max(allowed, key=lambda i: shape[i]) if allowed else None


def keeps_master_copy(cfg: OptimizerConfig, dtype) -> bool:
    """Whether a parameter of `dtype` gets an fp32 master copy in the optimizer state: low precision only."""
    return cfg.master_weights and jnp.dtype(dtype) != jnp.float32


def make_layouts(params, cfg: OptimizerConfig, *, state_memory: str = DEVICE,
                 decay_fn: Callable[[tuple | None, tuple[int, ...], bool], bool] | None = None,
                 memory_fn: Callable[[str, Any], str | None] | None = None):
    """A LeafLayout per parameter of `params` (an nnx.State, or a plain tree of arrays).

    stacked: the parameter's logical_axes start with "layers". state_memory: a
    `memory_fn(path, leaf)` result if given and not None, else the parameter's
    `optimizer_memory` metadata, else `state_memory` (a recipe passes its
    offload.optimizer_state). decay: `decay_fn(logical_axes, shape, stacked)`
    when given; by default the parameter's `weight_decay` metadata (layers set
    False on norms, biases and embedding tables, layers/params.py), else
    `rank_decay`. Metadata comes first because shape cannot tell a 2-D bias
    ([heads, head_dim] q/k/v biases) from a matrix. master: cfg.master_weights
    and the parameter is not float32.
    """
    from spillway.layers import names

    if state_memory not in STATE_MEMORIES:
        raise ConfigError(f"state_memory must be one of {STATE_MEMORIES}, got {state_memory!r}")

    def one(path, leaf):
        metadata = leaf.get_metadata() if _is_variable(leaf) else {}
        value = leaf.get_value() if _is_variable(leaf) else leaf
        axes = metadata.get("logical_axes")
        axes = tuple(axes) if axes is not None else None
        stacked = bool(axes) and axes[0] == names.LAYERS
        memory = (memory_fn(jax.tree_util.keystr(path), leaf) if memory_fn else None) \
            or metadata.get("optimizer_memory") or state_memory
        if decay_fn is not None:
            decay = decay_fn(axes, tuple(value.shape), stacked)
        elif metadata.get("weight_decay") is not None:
            decay = metadata["weight_decay"]
        else:
            decay = rank_decay(axes, tuple(value.shape), stacked)
        return LeafLayout(stacked=stacked, state_memory=memory, decay=bool(decay),
                          master=keeps_master_copy(cfg, value.dtype),
                          stream_axis=None if stacked else _stream_axis(axes, tuple(value.shape)))

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=_is_variable)


def _normalized_paths(tree, is_leaf=None) -> list[str]:
    # nnx.Variable nodes add a `.value` step to leaf paths; layouts built over
    # Variables do not have it. Drop it so both spellings of one tree match.
    paths = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
        keys = [k for k in path if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value")]
        paths.append(jax.tree_util.keystr(tuple(keys)))
    return paths


# --- the per-leaf AdamW maths (optax's, op for op) ------------------------------

@dataclasses.dataclass(frozen=True)
class _StepScalars:
    """Everything the per-piece update needs besides the piece itself (traced scalars)."""
    grad_norm: jax.Array
    count_inc: jax.Array
    learning_rate: jax.Array
    # A boolean scalar, or None: where False the piece comes back unchanged (a deferred update with
    # nothing pending: recipes/train/update_in_forward.py).
    apply: jax.Array | None = None


def _adamw_piece(cfg: OptimizerConfig, layout: LeafLayout, scalars: _StepScalars,
                 grad, param, state):
    """One piece (a leaf, or one layer of a stacked leaf) of clip + AdamW + apply.

    state is (mu, nu) or (mu, nu, master), fp32. Returns (new param in param's
    dtype, new state). The operations and their order follow optax 0.2.8
    (clip_by_global_norm, scale_by_adam, add_decayed_weights,
    scale_by_learning_rate, apply_updates) so the numbers match.
    """
    g = grad.astype(jnp.float32)
    if cfg.clip_norm is not None:
        keep = jnp.squeeze(scalars.grad_norm < cfg.clip_norm)
        g = lax.select(keep, g, (g / scalars.grad_norm.astype(g.dtype)) * cfg.clip_norm)
    mu, nu = state[0], state[1]
    # optax's update_moment with order 1 and 2; `g ** 1` kept so the traced ops match.
    mu = (1 - cfg.b1) * (g ** 1) + cfg.b1 * mu
    nu = (1 - cfg.b2) * (g ** 2) + cfg.b2 * nu
    mu_hat = mu / (1 - cfg.b1 ** scalars.count_inc).astype(mu.dtype)
    nu_hat = nu / (1 - cfg.b2 ** scalars.count_inc).astype(nu.dtype)
    update = mu_hat / (jnp.sqrt(nu_hat + 0.0) + cfg.eps)  # + eps_root (0.0), as optax
    weights = state[2] if layout.master else param.astype(jnp.float32)
    if layout.decay and cfg.weight_decay != 0.0:
        update = update + cfg.weight_decay * weights
    # scale_by_learning_rate: step size -lr(count), cast to the update's dtype
    update = jnp.array(-1 * scalars.learning_rate, dtype=update.dtype) * update
    new_weights = (weights + update).astype(jnp.float32)  # optax.apply_updates
    new_state = (mu, nu, new_weights) if layout.master else (mu, nu)
    if scalars.apply is None:
        return new_weights.astype(param.dtype), new_state
    new_state = tuple(jnp.where(scalars.apply, new, old.astype(new.dtype)) for new, old in zip(new_state, state))
    if layout.master:
        # The parameter is its master's rounding whether or not the step applied: the old
        # parameter is not read (a deferred update then never holds the old weights).
        return new_state[2].astype(param.dtype), new_state
    return jnp.where(scalars.apply, new_weights.astype(param.dtype), param), new_state


def host_sharding(sharding):
    """The same mesh and spec in pinned_host memory.

    Compile-only devices (a deviceless GPU compile) report no memories, and a
    NamedSharding over them silently drops the memory kind; one over the
    mesh's abstract mesh keeps it (docs/DESIGN.md section 5), so fall back to that
    rather than lose the host placement.
    """
    host = sharding.with_memory_kind(PINNED_HOST)
    if host.memory_kind != PINNED_HOST and isinstance(sharding, NamedSharding):
        host = NamedSharding(sharding.mesh.abstract_mesh, sharding.spec, memory_kind=PINNED_HOST)
    return host


# --- the optimizer -----------------------------------------------------------

class Optimizer:
    """Clip-by-global-norm + AdamW with a cosine schedule; per-leaf state placement.

    Functional: `init` and `update` are pure and traceable, for use inside one
    jitted train step:

        opt = Optimizer(cfg, make_layouts(params, cfg, state_memory="host"), total_steps=10_000)
        state_sh = opt.state_shardings(param_shardings)
        check_host_memory(opt.host_bytes(opt.abstract_state(params, param_shardings)))
        opt_state = jax.jit(opt.init, out_shardings=state_sh)(params)
        step = jax.jit(train_step, donate_argnums=... if donate_opt_state_ok() else ...)
        # in train_step: params, opt_state, stats = opt.update(grads, opt_state, params)
    """

    def __init__(self, cfg: OptimizerConfig, layout_tree, *, total_steps: int, stream_prefetch: bool = True,
                 stream_piece_elements: int = streaming.PIECE_ELEMENTS, update_in_forward: bool = False,
                 halve_stacked_state: bool = True):
        # stream_prefetch=False streams without double buffering: one layer's
        # state less in HBM, no chance for its copy to overlap the update
        # (benchmarks/optimizer_state_toy.py measures both).
        # stream_piece_elements: the largest piece of a non-stacked host leaf
        # (LeafLayout.stream_axis) that visits HBM at once.
        # update_in_forward: the stacked host leaves are updated a layer at a time inside the next
        # step's forward pass (recipes/train/update_in_forward.py), which reads their state as one
        # array per leaf (no LayerHalves); `update` then streams them with one buffer.
        self.update_in_forward = update_in_forward
        # halve_stacked_state=False keeps a streamed stacked leaf's host state as one buffer: the halves
        # only let the two host-link directions overlap (a GPU's), and a checkpoint save joins them into
        # a second copy; the train step on CPU, where host and device memory are the same RAM, passes False.
        self.halve_stacked_state = halve_stacked_state
        self.cfg = cfg
        self.total_steps = total_steps   # the schedule's length: warmup, then cosine decay to the end
        self.stream_prefetch = stream_prefetch
        self.stream_piece_elements = stream_piece_elements
        self.schedule = make_schedule(cfg, total_steps)
        self.layout_tree = layout_tree
        self._layouts: list[LeafLayout] = jax.tree.leaves(layout_tree, is_leaf=lambda x: isinstance(x, LeafLayout))
        bad = [x for x in self._layouts if not isinstance(x, LeafLayout)]
        if bad:
            raise TypeError(f"layout_tree leaves must be LeafLayout, found {type(bad[0]).__name__}")
        self._layout_paths = _normalized_paths(layout_tree, is_leaf=lambda x: isinstance(x, LeafLayout))
        if any(x.master for x in self._layouts) and not cfg.master_weights:
            raise ValueError("a LeafLayout asks for a master copy but cfg.master_weights is False")
        if any(x.state_memory == HOST for x in self._layouts) and not host_memory_available():
            raise ValueError(
                f"host-resident optimizer state was requested, but the {jax.default_backend()} platform "
                f"({jax.devices()[0].device_kind}) exposes no '{PINNED_HOST}' memory space; "
                f"keep the optimizer state on device (offload.optimizer_state=device)")

    def _streamed_by_layer(self, layout: LeafLayout) -> bool:
        """Whether this leaf's update streams its host state through HBM a layer at a time (stacked, host
        state, not updated by the host CPU): the leaves `begin` can leave to the caller."""
        return layout.stacked and layout.state_memory == HOST and not self.cfg.update_on_host

    def _halved(self, layout: LeafLayout) -> bool:
        """Whether this leaf's host state is kept as LayerHalves (streamed stacked leaves)."""
        return self._streamed_by_layer(layout) and not self.update_in_forward and self.halve_stacked_state

    def updated_in_forward(self) -> set[int]:
        """Indices (in the params' flattening) of the leaves whose update `begin` leaves to the caller."""
        return {k for k, layout in enumerate(self._layouts) if self._streamed_by_layer(layout)}

    # -- tree plumbing

    def _flatten_like_layouts(self, tree, what: str):
        leaves, treedef = jax.tree.flatten(tree)
        if len(leaves) != len(self._layouts) or _normalized_paths(tree) != self._layout_paths:
            raise ValueError(
                f"{what} do not match the layout tree: {len(leaves)} leaves {_normalized_paths(tree)[:4]}... "
                f"against {len(self._layouts)} layouts {self._layout_paths[:4]}...")
        return leaves, treedef

    def _check_leaf(self, path: str, layout: LeafLayout, shape, dtype):
        low_precision = jnp.dtype(dtype) != jnp.float32
        if self.cfg.master_weights and low_precision and not layout.master:
            raise ValueError(f"parameter {path} is {jnp.dtype(dtype).name} and cfg.master_weights is True, "
                             f"but its LeafLayout has master=False: build layouts with make_layouts")
        if layout.master and not low_precision:
            raise ValueError(f"parameter {path} is float32: it needs no master copy (LeafLayout.master=True)")
        if layout.stacked and len(shape) < 1:
            raise ValueError(f"parameter {path} is marked stacked but is a scalar")

    # -- public API

    def init(self, params) -> OptState:
        """Zero moments (fp32) and fp32 master copies; host leaves placed in pinned_host memory.

        Called on concrete arrays, it compiles itself with out_shardings =
        state_shardings(the params' shardings), so every leaf lands in its
        parameter's sharding. Inside a jit, pass those out_shardings to the jit.
        """
        leaves = jax.tree.leaves(params)
        if leaves and all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) for x in leaves):
            shardings = jax.tree.map(lambda p: p.sharding, params)
            return jax.jit(self._init, out_shardings=self.state_shardings(shardings))(params)
        return self._init(params)

    def _init(self, params) -> OptState:
        leaves, treedef = self._flatten_like_layouts(params, "params")
        mu, nu, master = [], [], []
        for path, layout, p in zip(self._layout_paths, self._layouts, leaves):
            self._check_leaf(path, layout, p.shape, p.dtype)
            if self._halved(layout):
                state = streaming.new_host_state_halves(p, layout.master)
            elif layout.state_memory == HOST:
                state = streaming.new_host_state(p, layout.master)
            else:
                zeros = jnp.zeros(p.shape, jnp.float32)
                state = (zeros, zeros) + ((p.astype(jnp.float32),) if layout.master else ())
            mu.append(state[0])
            nu.append(state[1])
            master.append(state[2] if layout.master else None)
        return OptState(count=jnp.zeros([], jnp.int32), mu=treedef.unflatten(mu),
                        nu=treedef.unflatten(nu), master=treedef.unflatten(master))

    def state_shardings(self, param_shardings) -> OptState:
        """NamedShardings for the state: each leaf keeps its parameter's mesh and spec; host leaves
        get memory_kind pinned_host. Usable as jit in/out_shardings and orbax restore targets.

        Works with shardings over an abstract mesh (deviceless compiles), whose
        memory kinds survive where compile-only devices would drop them.
        """
        leaves, treedef = self._flatten_like_layouts(param_shardings, "param_shardings")
        if not all(isinstance(s, (NamedSharding, SingleDeviceSharding)) for s in leaves):
            raise TypeError("param_shardings must be a tree of NamedSharding (or SingleDeviceSharding)")
        state_leaves = [host_sharding(s) if layout.state_memory == HOST else s
                        for s, layout in zip(leaves, self._layouts)]
        state_leaves = [streaming.LayerHalves(s, s) if self._halved(layout) else s
                        for s, layout in zip(state_leaves, self._layouts)]
        master = [s if layout.master else None for s, layout in zip(state_leaves, self._layouts)]
        first = leaves[0]
        count = NamedSharding(first.mesh, PartitionSpec()) if isinstance(first, NamedSharding) \
            else first.with_memory_kind(DEVICE)
        return OptState(count=count, mu=treedef.unflatten(state_leaves), nu=treedef.unflatten(state_leaves),
                        master=treedef.unflatten(master))

    def abstract_state(self, params, param_shardings=None) -> OptState:
        """The state as ShapeDtypeStructs carrying `state_shardings`, without allocating it.

        For orbax restore targets, and for `check_host_memory(opt.host_bytes(...))`
        before `init` pins any memory. `param_shardings` defaults to the params' own.
        """
        if param_shardings is None:
            param_shardings = jax.tree.map(lambda p: p.sharding, params)
        shapes = jax.eval_shape(self._init, params)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            shapes, self.state_shardings(param_shardings))

    # -- checkpoints: one whole array per state leaf, whatever the placement

    def _map_halved(self, fn, opt_state: OptState) -> OptState:
        """OptState with `fn` applied to the mu / nu / master entries of halved leaves."""
        def per_tree(tree):
            leaves, treedef = jax.tree.flatten(
                tree, is_leaf=lambda x: x is None or isinstance(x, streaming.LayerHalves))
            if len(leaves) != len(self._layouts):
                raise ValueError(f"optimizer state has {len(leaves)} entries per tree, the layouts "
                                 f"{len(self._layouts)}: not this optimizer's state")
            return treedef.unflatten([fn(x) if self._halved(layout) and x is not None else x
                                      for x, layout in zip(leaves, self._layouts)])
        return OptState(count=opt_state.count, mu=per_tree(opt_state.mu), nu=per_tree(opt_state.nu),
                        master=per_tree(opt_state.master))

    def saved_form(self, opt_state: OptState) -> OptState:
        """The state as checkpoints hold it: LayerHalves joined into one host array each.

        The same structure and shapes whatever the placement or streaming, so a
        checkpoint from a run with state on device restores into one with state
        on host and back. Joining costs a host copy of the halved state.
        """
        return self._map_halved(streaming.join_halves, opt_state)

    def from_saved_form(self, saved: OptState, *, consume: bool = False) -> OptState:
        """Inverse of `saved_form`: restored host arrays of stacked leaves split into LayerHalves.

        consume=True deletes each restored array once its halves exist, so a restore holds one leaf
        twice at most, never the whole state (`saved` is unusable afterwards)."""
        if not consume:
            return self._map_halved(streaming.split_halves, saved)

        def split_then_free(x):
            halves = jax.block_until_ready(streaming.split_halves(x))
            x.delete()
            return halves
        return self._map_halved(split_then_free, saved)

    def saved_abstract_state(self, params, param_shardings=None) -> OptState:
        """`abstract_state` in saved form: what to hand orbax as the restore target."""
        abstract = self.abstract_state(params, param_shardings)
        return self._map_halved(
            lambda h: jax.ShapeDtypeStruct((h.num_layers, *h.first.shape[1:]), h.first.dtype,
                                           sharding=h.first.sharding), abstract)

    def halved_part(self, opt_state) -> list:
        """The state's LayerHalves entries (what `saved_form` joins into a copy), as a flat list."""
        found = []
        self._map_halved(lambda halves: found.append(halves) or halves, opt_state)
        return found

    def host_bytes(self, opt_state_or_abstract) -> int:
        """Pinned host bytes this process holds for the state (arrays, or ShapeDtypeStructs with shardings)."""
        return streaming.tree_nbytes_by_memory_kind(opt_state_or_abstract).get(PINNED_HOST, 0)

    def update(self, grads, opt_state: OptState, params, apply: jax.Array | None = None,
               grad_norm: jax.Array | None = None):
        """One AdamW step. Returns (new params, new opt_state, {"grad_norm", "learning_rate"}).

        `apply` (a boolean scalar, or None for always): where False, everything comes back unchanged
        (the step count too). `grad_norm`: the gradients' global norm when the caller has it already
        (None: computed here).
        """
        return self.begin(grads, opt_state, params, apply=apply, grad_norm=grad_norm, stacked_host_later=False)

    def begin(self, grads, opt_state: OptState, params, *, apply: jax.Array | None = None,
              grad_norm: jax.Array | None = None, stacked_host_later: bool = True):
        """The step's scalars and every leaf's update, except (stacked_host_later) the stacked leaves with host
        state: those are left to the caller, a layer at a time (a `BegunUpdate`, whose `finish` takes them
        back). With stacked_host_later=False, the whole update: `update`'s result."""
        cfg = self.cfg
        grad_leaves, _ = self._flatten_like_layouts(grads, "grads")
        param_leaves, treedef = self._flatten_like_layouts(params, "params")
        mu = treedef.flatten_up_to(opt_state.mu)
        nu = treedef.flatten_up_to(opt_state.nu)
        master = treedef.flatten_up_to(opt_state.master)

        for path, layout, p in zip(self._layout_paths, self._layouts, param_leaves):
            if layout.state_memory == DEVICE and streaming.in_host_memory(p):
                raise ValueError(f"parameter {path} lives in host memory but its optimizer state on device: "
                                 f"host parameters need host state (offload.optimizer_state=host)")
        # Clipping needs the norm over all gradients before any piece is
        # updated. Same sums, in the same order, as optax.tree.norm over the
        # same tree (host-resident gradients summed by the host CPU).
        if grad_norm is None:
            grad_norm = jnp.sqrt(functools.reduce(operator.add, [streaming.squared_norm(g) for g in grad_leaves], 0))
        count_inc = optax.safe_increment(opt_state.count)
        if apply is not None:
            count_inc = jnp.where(apply, count_inc, opt_state.count)
        scalars = _StepScalars(grad_norm=grad_norm, count_inc=count_inc,
                               learning_rate=self.schedule(opt_state.count), apply=apply)

        def piece_fn(k):
            return functools.partial(_adamw_piece, cfg, self._layouts[k], scalars)

        def state_of(k):
            return (mu[k], nu[k]) + ((master[k],) if self._layouts[k].master else ())

        new_params = list(param_leaves)
        new_states: list[tuple] = [None] * len(param_leaves)
        host_stacked = []
        previous_one_piece = None  # non-stacked host leaves visit HBM in turn, never two at once
        for k, layout in enumerate(self._layouts):
            if layout.state_memory == DEVICE:
                new_params[k], new_states[k] = piece_fn(k)(grad_leaves[k], param_leaves[k], state_of(k))
                new_params[k] = new_params[k].astype(param_leaves[k].dtype)
            elif self._streamed_by_layer(layout):
                host_stacked.append(k)
            elif cfg.update_on_host:
                new_params[k], new_states[k] = streaming.update_on_host(
                    piece_fn(k), grad_leaves[k], param_leaves[k], state_of(k))
            else:
                new_params[k], new_states[k] = streaming.update_outside_stack(
                    piece_fn(k), grad_leaves[k], param_leaves[k], state_of(k), axis=layout.stream_axis,
                    max_elements=self.stream_piece_elements, after=previous_one_piece,
                    prefetch=self.stream_prefetch)
                previous_one_piece = new_states[k]

        begun = BegunUpdate(self, treedef, new_params, new_states, scalars,
                            {k: piece_fn(k) for k in host_stacked}, {k: state_of(k) for k in host_stacked})
        if stacked_host_later:
            return begun
        shapes = [p.shape for p in param_leaves]
        streamed = {}
        for group in streaming.group_by_layer_count(host_stacked, shapes).values():
            stream = streaming.stream_layer_halves if self._halved(self._layouts[group[0]]) else functools.partial(
                streaming.stream_update, axis=0, piece=1)
            group_params, group_states = stream(
                [piece_fn(k) for k in group], [grad_leaves[k] for k in group],
                [param_leaves[k] for k in group], [state_of(k) for k in group], prefetch=self.stream_prefetch)
            streamed.update({k: (p, st) for k, p, st in zip(group, group_params, group_states)})
        return begun.finish(streamed)


@dataclasses.dataclass
class BegunUpdate:
    """An optimizer update whose stacked host leaves are still to be updated by the caller, a layer at a time.

    `params` holds every new parameter but those leaves' (still the old ones); `layer_update[k]` updates
    one layer of leaf k (a `host_optimizer.PieceUpdate`: grad row, param row, state rows on device ->
    new param row, new state rows) and `host_state[k]` is its state, host arrays with a leading layer
    axis. `finish` takes {k: (new stacked param, new host state)} for those leaves.
    """
    optimizer: Optimizer
    treedef: Any
    new_params: list
    new_states: list
    scalars: _StepScalars
    layer_update: dict[int, Callable]
    host_state: dict[int, tuple]

    @property
    def params(self):
        return self.treedef.unflatten(self.new_params)

    def finish(self, stacked: dict[int, tuple]):
        """(new params, new OptState, {"grad_norm", "learning_rate"})."""
        missing = set(self.layer_update) - set(stacked)
        if missing:
            raise ValueError(f"the update of stacked host leaves {sorted(missing)} was never handed back")
        new_params, new_states = list(self.new_params), list(self.new_states)
        for k, (param, state) in stacked.items():
            new_params[k], new_states[k] = param, state
        layouts = self.optimizer._layouts
        new_state = OptState(
            count=self.scalars.count_inc, mu=self.treedef.unflatten([st[0] for st in new_states]),
            nu=self.treedef.unflatten([st[1] for st in new_states]),
            master=self.treedef.unflatten([st[2] if layout.master else None
                                           for st, layout in zip(new_states, layouts)]))
        return self.treedef.unflatten(new_params), new_state, {
            "grad_norm": self.scalars.grad_norm, "learning_rate": self.scalars.learning_rate}
