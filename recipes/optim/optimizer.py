"""`Optimizer`: clip-by-global-norm + AdamW with per-leaf state placement, for the one jitted train step.

The state of each leaf (moments, fp32 master copy) lives in HBM or in pinned
host memory as its `LeafLayout` says; host leaves are streamed through HBM a
layer (or a piece of rows) at a time (recipes/optim/host_streaming.py) or
updated by the host CPU (`update_on_host`). What it does and why, with the
measurements, is told once in docs/DESIGN.md section 6; the maths of one piece
is recipes/optim/adamw.py. Checkpoints hold `saved_form(state)`: one whole
array per state leaf whatever the placement.
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

from spillway.layers.memory import PINNED_HOST, Memory
from spillway.recipes.optim import host_streaming as streaming
from spillway.recipes.optim.adamw import StepScalars, adamw_piece
from spillway.recipes.optim.config import OptimizerConfig
from spillway.recipes.optim.host_memory import host_memory_available, host_sharding
from spillway.recipes.optim.layouts import LeafLayout, normalized_paths
from spillway.recipes.optim.schedule import make_schedule
from spillway.recipes.optim.split_state import ResidentSplit, join_split, saved_struct, split_saved


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OptState:
    """AdamW state. mu / nu / master mirror the params tree; master holds None where no copy is kept."""
    count: jax.Array  # int32 scalar: steps taken
    mu: Any
    nu: Any
    master: Any



class Optimizer:
    """Clip-by-global-norm + AdamW with a cosine schedule; per-leaf state placement.

    Functional: `init` and `update` are pure and traceable, for use inside one
    jitted train step:

        opt = Optimizer(cfg, make_layouts(params, cfg, state_memory="host"), total_steps=10_000)
        state_sh = opt.state_shardings(param_shardings)
        check_host_memory(opt.host_bytes(opt.abstract_state(params, param_shardings)))
        opt_state = jax.jit(opt.init, out_shardings=state_sh)(params)
        step = jax.jit(train_step, donate_argnums=(0, 1))   # params, opt_state
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
        # step's forward pass (recipes/optim/update_in_forward.py), which reads their state as one
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
        self._layout_paths = normalized_paths(layout_tree, is_leaf=lambda x: isinstance(x, LeafLayout))
        if any(x.master for x in self._layouts) and not cfg.master_weights:
            raise ValueError("a LeafLayout asks for a master copy but cfg.master_weights is False")
        if any(x.state_memory == Memory.HOST for x in self._layouts) and not host_memory_available():
            raise ValueError(
                f"host-resident optimizer state was requested, but the {jax.default_backend()} platform "
                f"({jax.devices()[0].device_kind}) exposes no '{PINNED_HOST}' memory space; "
                f"keep the optimizer state on device (offload.optimizer_state=device)")

    def _streamed_by_layer(self, layout: LeafLayout) -> bool:
        """Whether this leaf's update streams its host state through HBM a layer at a time (stacked, host
        state, not updated by the host CPU): the leaves `begin` can leave to the caller."""
        return layout.stacked and layout.state_memory == Memory.HOST and not self.cfg.update_on_host

    def _halved(self, layout: LeafLayout) -> bool:
        """Whether this leaf's host state is kept as LayerHalves (streamed stacked leaves)."""
        return self._streamed_by_layer(layout) and not self.update_in_forward and self.halve_stacked_state

    def updated_in_forward(self) -> set[int]:
        """Indices (in the params' flattening) of the leaves whose update `begin` leaves to the caller: the
        streamed stacked leaves, and with update_in_forward the split ones too (their host layers' part;
        `begin` updates the resident layers' part itself)."""
        return {k for k, layout in enumerate(self._layouts) if self._streamed_by_layer(layout)
                and (self.update_in_forward or not layout.split)}

    # -- tree plumbing

    def _flatten_like_layouts(self, tree, what: str):
        # A split weight (offload.params=host:N) is one leaf: a ResidentSplit of its device and host rows.
        leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_split)
        if len(leaves) != len(self._layouts) or normalized_paths(tree, _is_split) != self._layout_paths:
            raise ValueError(
                f"{what} do not match the layout tree: {len(leaves)} leaves {normalized_paths(tree)[:4]}... "
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
        """Zero moments (fp32, or cfg.moment_dtype) and fp32 master copies; host leaves placed in pinned_host memory.

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
            self._check_leaf(path, layout, whole_shape(p), leaf_dtype(p))
            moments = self.cfg.moment_dtype
            if layout.split:
                device_rows, host_rows = layer_parts(p, layout.host_layers)
                on_device = streaming.fresh_state(device_rows, layout.master, moments)
                new_host = streaming.new_host_state_halves if self._halved(layout) else streaming.new_host_state
                state = tuple(ResidentSplit(d, h) for d, h in zip(
                    on_device, new_host(host_rows, layout.master, moments)))
            elif self._halved(layout):
                state = streaming.new_host_state_halves(p, layout.master, moments)
            elif layout.state_memory == Memory.HOST:
                state = streaming.new_host_state(p, layout.master, moments)
            else:
                state = streaming.fresh_state(p, layout.master, moments)
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
        leaves = [s.device if _is_split(s) else s for s in leaves]   # a split weight's state: its device part's
        if not all(isinstance(s, (NamedSharding, SingleDeviceSharding)) for s in leaves):
            raise TypeError("param_shardings must be a tree of NamedSharding (or SingleDeviceSharding)")
        def leaf_sharding(s, layout: LeafLayout):
            host = host_sharding(s)
            host_part = streaming.LayerHalves(host, host) if self._halved(layout) else host
            if layout.split:
                return ResidentSplit(s, host_part)
            return host_part if layout.state_memory == Memory.HOST else s
        state_leaves = [leaf_sharding(s, layout) for s, layout in zip(leaves, self._layouts)]
        master = [s if layout.master else None for s, layout in zip(state_leaves, self._layouts)]
        first = leaves[0]
        count = NamedSharding(first.mesh, PartitionSpec()) if isinstance(first, NamedSharding) \
            else first.with_memory_kind(Memory.DEVICE)
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

    def _map_halved(self, fn, opt_state: OptState, split_fn=None) -> OptState:
        """OptState with `fn` applied to the mu / nu / master entries of halved leaves, and `split_fn`
        (fn when None) to those of split leaves (`fn(entry, layout)` for both)."""
        split_fn = split_fn or fn

        def per_tree(tree):
            leaves, treedef = jax.tree.flatten(
                tree, is_leaf=lambda x: x is None or isinstance(x, (streaming.LayerHalves, ResidentSplit)))
            if len(leaves) != len(self._layouts):
                raise ValueError(f"optimizer state has {len(leaves)} entries per tree, the layouts "
                                 f"{len(self._layouts)}: not this optimizer's state")

            def one(x, layout):
                if x is None:
                    return x
                if layout.split:
                    return split_fn(x, layout)
                return fn(x, layout) if self._halved(layout) else x
            return treedef.unflatten([one(x, layout) for x, layout in zip(leaves, self._layouts)])
        return OptState(count=opt_state.count, mu=per_tree(opt_state.mu), nu=per_tree(opt_state.nu),
                        master=per_tree(opt_state.master))

    def saved_form(self, opt_state: OptState) -> OptState:
        """The state as checkpoints hold it: LayerHalves joined into one host array each.

        The same structure and shapes whatever the placement or streaming, so a
        checkpoint from a run with state on device restores into one with state
        on host and back. Joining costs a host copy of the halved state; a split leaf
        (offload.optimizer_state=host:N) is joined into one host array, its device part copied out.
        """
        return self._map_halved(lambda halves, _: streaming.join_halves(halves), opt_state,
                                lambda split, _: join_split(split))

    def from_saved_form(self, saved: OptState, *, consume: bool = False) -> OptState:
        """Inverse of `saved_form`: restored host arrays of stacked leaves split into LayerHalves.

        consume=True deletes each restored array once its halves exist, so a restore holds one leaf
        twice at most, never the whole state (`saved` is unusable afterwards)."""
        def cut(x, layout):
            if layout.split:
                return split_saved(x, layout.host_layers, self._halved(layout))
            return streaming.split_halves(x)
        if not consume:
            return self._map_halved(cut, saved)

        def cut_then_free(x, layout):
            parts = jax.block_until_ready(cut(x, layout))
            x.delete()
            return parts
        return self._map_halved(cut_then_free, saved)

    def saved_abstract_state(self, params, param_shardings=None) -> OptState:
        """`abstract_state` in saved form: what to hand orbax as the restore target."""
        abstract = self.abstract_state(params, param_shardings)
        return self._map_halved(
            lambda h, _: jax.ShapeDtypeStruct((h.num_layers, *h.first.shape[1:]), h.first.dtype,
                                              sharding=h.first.sharding), abstract,
            lambda split, _: saved_struct(split))

    def halved_part(self, opt_state) -> list:
        """The state's entries that `saved_form` joins into a copy, as a flat list: LayerHalves, and both
        parts of a split leaf (on ShapeDtypeStructs, the device part as the host bytes its copy takes)."""
        found = []

        def split_parts(split, _):
            device = split.device
            if isinstance(device, jax.ShapeDtypeStruct) and device.sharding is not None:
                device = jax.ShapeDtypeStruct(device.shape, device.dtype, sharding=host_sharding(device.sharding))
            found.extend([device, split.host])
            return split
        self._map_halved(lambda halves, _: found.append(halves) or halves, opt_state, split_parts)
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
            if layout.state_memory == Memory.DEVICE and not _is_split(p) and streaming.in_host_memory(p):
                raise ValueError(f"parameter {path} lives in host memory but its optimizer state on device: "
                                 f"host parameters need host state (offload.optimizer_state=host)")
        # Clipping needs the norm over all gradients before any piece is updated.
        if grad_norm is None:
            grad_norm = self.grad_norm(grads)
        count_inc = optax.safe_increment(opt_state.count)
        if apply is not None:
            count_inc = jnp.where(apply, count_inc, opt_state.count)
        scalars = StepScalars(grad_norm=grad_norm, count_inc=count_inc,
                               learning_rate=self.schedule(opt_state.count), apply=apply)

        def piece_fn(k):
            return functools.partial(adamw_piece, cfg, self._layouts[k], scalars)

        def state_of(k):
            return (mu[k], nu[k]) + ((master[k],) if self._layouts[k].master else ())

        new_params = list(param_leaves)
        new_states: list[tuple] = [None] * len(param_leaves)
        host_stacked = []
        split_leaves = [k for k, layout in enumerate(self._layouts) if layout.split]
        # With the update in the next forward pass, a split leaf is left to the caller whole: its resident
        # layers' state (`resident_state`, in HBM) and its host layers' (`host_state`) are both updated a layer
        # at a time in the forward pass (recipes/optim/update_in_forward.py).
        resident: list[int] = []
        if stacked_host_later and self.update_in_forward and not cfg.update_on_host and split_leaves:
            resident, split_leaves = split_leaves, []
        previous_one_piece = None  # non-stacked host leaves visit HBM in turn, never two at once
        for k, layout in enumerate(self._layouts):
            if layout.split:
                continue   # both parts below, in this step whatever stacked_host_later says
            if layout.state_memory == Memory.DEVICE:
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

        if split_leaves:
            split_results = self._update_split(split_leaves, piece_fn, state_of, grad_leaves, param_leaves)
            for k, (param, state) in split_results.items():
                new_params[k], new_states[k] = param, state
        layer_update = {k: piece_fn(k) for k in host_stacked + resident}
        host_state = {**{k: state_of(k) for k in host_stacked},
                      **{k: tuple(x.host for x in state_of(k)) for k in resident}}
        begun = BegunUpdate(self, treedef, new_params, new_states, scalars, layer_update, host_state,
                            {k: tuple(x.device for x in state_of(k)) for k in resident})
        if stacked_host_later:
            return begun
        return begun.finish(self._stream_stacked(host_stacked, piece_fn, grad_leaves, param_leaves,
                                                 [state_of(k) if k in host_stacked else None
                                                  for k in range(len(param_leaves))]))

    def grad_norm(self, grads) -> jax.Array:
        """The gradients' global norm, as clipping reads it: each leaf's sum of squares (host-resident
        gradients summed by the host CPU), added in the leaves' order as optax.tree.norm adds them; a
        stacked leaf's sum is its layers' sums added in one fixed order, so that every split of it (a
        split weight's gradient in two parts) gives the whole leaf's value bit for bit
        (`leaf_squared_norm`)."""
        grad_leaves, _ = self._flatten_like_layouts(grads, "grads")
        return jnp.sqrt(functools.reduce(operator.add, [
            leaf_squared_norm(g, layout.stacked) for g, layout in zip(grad_leaves, self._layouts)], 0))

    def _stream_stacked(self, indices, piece_fn, grads, params, states) -> dict[int, tuple]:
        """{k: (new param, new host state)} for the stacked leaves `indices` whose state is all in host memory,
        streamed a layer at a time (one loop per layer count)."""
        streamed = {}
        for group in streaming.group_by_layer_count(indices, [getattr(p, "shape", None) for p in params]).values():
            stream = streaming.stream_layer_halves if self._halved(self._layouts[group[0]]) else functools.partial(
                streaming.stream_update, axis=0, piece=1)
            group_params, group_states = stream(
                [piece_fn(k) for k in group], [grads[k] for k in group],
                [params[k] for k in group], [states[k] for k in group], prefetch=self.stream_prefetch)
            streamed.update({k: (p, st) for k, p, st in zip(group, group_params, group_states)})
        return streamed

    def _update_split(self, indices, piece_fn, state_of, grads, params) -> dict[int, tuple]:
        """{k: (new param, new state of ResidentSplits)} for split leaves: the first layers updated whole on the
        device, the last ones streamed from host memory (or updated by the host CPU), in this step."""
        grad_parts = {k: layer_parts(grads[k], self._layouts[k].host_layers) for k in indices}
        param_parts = {k: layer_parts(params[k], self._layouts[k].host_layers) for k in indices}
        on_device = {k: piece_fn(k)(grad_parts[k][0], param_parts[k][0], tuple(x.device for x in state_of(k)))
                     for k in indices}
        host_grads = {k: grad_parts[k][1] for k in indices}
        host_params = {k: param_parts[k][1] for k in indices}
        host_states = {k: tuple(x.host for x in state_of(k)) for k in indices}
        if self.cfg.update_on_host:
            from_host = {k: streaming.update_on_host(piece_fn(k), host_grads[k], host_params[k], host_states[k])
                         for k in indices}
        else:
            n = len(params)
            from_host = self._stream_stacked(indices, piece_fn, [host_grads.get(k) for k in range(n)],
                                             [host_params.get(k) for k in range(n)],
                                             [host_states.get(k) for k in range(n)])
        results = {}
        for k in indices:
            (device_param, device_state), (host_param, host_state) = on_device[k], from_host[k]
            dtype = leaf_dtype(params[k])
            if _is_split(params[k]):   # split weights stay split: each part where it lives
                param = ResidentSplit(device_param.astype(dtype), host_param.astype(dtype))
            else:
                param = jnp.concatenate([device_param.astype(dtype), host_param.astype(dtype)])
            results[k] = param, tuple(ResidentSplit(d, h) for d, h in zip(device_state, host_state))
        return results


def _is_split(x) -> bool:
    return isinstance(x, ResidentSplit)


def whole_shape(x) -> tuple[int, ...]:
    """The shape of a leaf, a split weight's as the whole leaf (its parts joined along the layer axis)."""
    if not _is_split(x):
        return tuple(x.shape)
    return (x.device.shape[0] + x.host.shape[0], *x.device.shape[1:])


def leaf_dtype(x):
    return x.device.dtype if _is_split(x) else x.dtype


def layer_parts(x, host_layers: int):
    """(first layers, last `host_layers`) of a stacked leaf: a split weight's two parts as they lie, or a
    whole array's two slices."""
    if _is_split(x):
        return x.device, x.host
    resident = x.shape[0] - host_layers
    return x[:resident], x[resident:]


def leaf_squared_norm(grad, stacked: bool) -> jax.Array:
    """The squared norm of one gradient leaf; of a stacked one (and of a split weight's, split along its layer
    axis) as the sum of its per-layer sums of squares, in layer order.

    Why per layer: a split weight's gradient lies in two parts (a ResidentSplit: the first layers in HBM,
    the last in host memory), and the sum of two partial sums is not the whole leaf's sum in float32
    (measured one ulp off in the first or second step, CPU, jax 0.10.2). Each layer's sum is the same
    reduction of the same layer whichever part holds it; the layers' sums, joined into one vector of the
    leaf's layer count and added up by one reduction of that vector, give every split (and none) the same
    value. The barrier keeps XLA from merging the two reductions of a whole leaf into one (reduce of a
    reduce) or splitting the reduction of the joined vector back into the parts' (reduce of a concatenate):
    it does both otherwise, and either brings back an order that depends on the placement. The cost,
    compiled for an H200 with Llama 3 8B's float32 gradients: still one reduction per leaf that reads its
    gradient once (w_up's partial sums are 32 x 4096 floats instead of 114,688), then small ones: 33
    reduction kernels in all against 31, 64 KiB more temporary HBM.
    """
    if not (stacked or _is_split(grad)):
        return streaming.squared_norm(grad)
    parts = (grad.device, grad.host) if _is_split(grad) else (grad,)
    per_layer = jnp.concatenate([streaming.squared_norm(part, per_layer=True) for part in parts])
    return jnp.sum(lax.optimization_barrier(per_layer))


@dataclasses.dataclass
class BegunUpdate:
    """An optimizer update whose stacked host leaves are still to be updated by the caller, a layer at a time.

    `params` holds every new parameter but those leaves' (still the old ones); `layer_update[k]` updates
    one layer of leaf k (a `host_streaming.PieceUpdate`: grad row, param row, state rows on device ->
    new param row, new state rows) and `host_state[k]` is its state, host arrays with a leading layer
    axis. `finish` takes {k: (new stacked param, new host state)} for those leaves.

    A split leaf (offload.optimizer_state=host:N) among them has its first L - N layers' state in
    `resident_state[k]` (HBM) and its last N layers' in `host_state[k]`; `finish` takes its new state as
    ResidentSplits.
    """
    optimizer: Optimizer
    treedef: Any
    new_params: list
    new_states: list
    scalars: StepScalars
    layer_update: dict[int, Callable]
    host_state: dict[int, tuple]
    resident_state: dict[int, tuple] = dataclasses.field(default_factory=dict)

    @property
    def resident_layers(self) -> int:
        """How many first block layers have their state in HBM (a split's resident layers; 0 without one).
        One split setting cuts every leaf alike."""
        counts = {self.resident_state[k][0].shape[0] for k in self.resident_state}
        if len(counts) > 1:
            raise ValueError(f"a split state with the update in the forward pass needs every stacked leaf cut at "
                             f"one layer; they are cut at {sorted(counts)}")
        return counts.pop() if counts else 0

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
