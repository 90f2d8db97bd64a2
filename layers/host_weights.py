"""Block weights that live in pinned host memory and visit HBM one layer at a time.

When the stacked block parameters are host-resident (a recipe's
`offload.params=host`), the scan over the layer axis (layers/stack.py) slices
one layer's weights out of the host arrays per iteration and `device_put`s
that slice into device memory inside the scanned body. XLA's host offloader
turns the per-iteration copy into an asynchronous host->device transfer; HBM
then holds a layer or two of weights instead of all of them.

The backward pass follows from JAX's transpose rule for `device_put`: the
cotangent of a host->device copy is copied device->host, so each layer's
weight gradient leaves HBM as the backward scan produces it, and the stacked
gradient is a host array (checked on jax 0.10.2: the gradient's aval is
`f32<host>[L, ...]`).

Gradient accumulation (grad_accum > 1) adds each micro-batch's gradients to
a float32 running sum in host memory, and that sum must not pass through HBM
whole either. So the sum is accumulated inside the backward scan, a layer at a
time: a host weight paired with its layer of the sum (`AccumulatingWeight`)
comes into HBM through `_into_hbm_accumulating`, a custom VJP whose backward
rule brings the layer's sum in, adds the incoming gradient and sends the new
sum out. The train step differentiates with respect to the sums (not the
weights), so the "gradient" JAX returns for them is the new running sum,
stacked in host memory by the scan's transpose (recipes/train/step.py).

Experts only (`offload.params=experts`): the same stream, for the routed
experts' stacked weights alone (the leaves whose first axis after "layers" is
"expert": an MoE layer's gate, up and down, [L, E, d, f]); attention, norms,
the router (its "expert" axis is its output, not its first) and shared
experts stay in HBM. The scan handles each leaf by its memory space, so a
layer's state may mix both.

Start-up: a model whose block weights are to live in host memory is built
with them there (`initialised_in_host_memory`): the stack then creates its
layers with a scan instead of a vmap and sends each layer's weights to host
memory as it is made, so HBM never holds the stacked weights, not even once.

A split (`offload.params=host:N`): a stacked weight's value is a `ResidentSplit`, its first layers in HBM
and its last N in host memory, two arrays. The stack cuts its scans at that layer (`split_boundary`,
`layer_rows`), so the resident layers run as device weights do and only the host layers are streamed.

The device copy must never be a remat residual, or the backward pass would
keep every layer's weights in HBM after all. It is tagged `DEVICE_WEIGHTS`
and `never_save_device_weights` wraps any checkpoint policy so that this name
is always recomputed (the copy is repeated in the backward pass, which is the
point: the weights come in again). Blocks do not tag it; the stack does.

The weights across the turn (`offload.params_keep=K`): the backward pass visits the last layers first, right
after the forward pass used them, so the last K streamed layers' weights are brought into HBM once per
pass pair instead of twice. Before the streamed scan, their rows come into HBM in one copy
(`kept_copies`, outside the gradient); in the scan, a layer among them takes its weights from there and
the others fetch theirs as before (`layer_to_device` with `kept`: a `lax.cond` on the layer index, inside
a custom VJP whose backward rule sends the gradient to host exactly as the plain copy's transpose does, or
updates the running sum). So the scan stays one scan over the host rows as they lie: cutting it in two
would slice the host arrays, and XLA's host offloader turns a slice of host memory that is not copied
straight to the device into host computation (a whole copy of the weights, and of their gradients, in
host memory; measured on the deviceless H200 compile, docs/DESIGN.md section 6). The train objective
puts the count in force while it is traced (`keeping_fetched_weights`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from spillway.layers import names
from spillway.layers.memory import EXPERTS, Memory

# checkpoint_name of a layer's weights copied into HBM inside the scan: never saved.
DEVICE_WEIGHTS = "layer_weights_on_device"

# While a train objective is traced: how many of the stack's last layers keep their fetched weights (params_keep).
_KEPT_LAYERS: contextvars.ContextVar[int] = contextvars.ContextVar("spillway_kept_layers", default=0)

# While a model is built: the offload.params setting its stacked weights are created under, or None.
_INITIAL_SETTING: contextvars.ContextVar[str | None] = contextvars.ContextVar("spillway_initial_params",
                                                                               default=None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ResidentSplit:
    """One stacked array as two along the layer axis: `device` (the first layers, in HBM) and `host` (the
    last ones, in pinned host memory: an array, or a pytree of them such as LayerHalves or an
    AccumulatingWeight). A pytree node, so it travels through jit, shardings and donation like any leaf.
    Used for split weights here and for split optimizer state (recipes/optim/split_state.py)."""
    device: object
    host: object


def is_resident_split(x) -> bool:
    return isinstance(x, ResidentSplit)


def split_boundary(state) -> int | None:
    """The layer at which `state`'s split leaves (stacked weights) go from HBM to host memory, or None."""
    bounds = {jax.tree.leaves(x.device)[0].shape[0]
              for x in jax.tree.leaves(state, is_leaf=is_resident_split) if is_resident_split(x)}
    if len(bounds) > 1:
        raise ValueError(f"the split weights of one stack are cut at different layers: {sorted(bounds)}")
    return bounds.pop() if bounds else None


def layer_rows(state, start: int, stop: int):
    """Layers [start, stop) of a stacked state; a split leaf's from the part that holds them all (the
    stack's pieces never straddle its boundary)."""
    def one(x):
        if not is_resident_split(x):
            return jax.tree.map(lambda a: a[start:stop], x)
        resident = jax.tree.leaves(x.device)[0].shape[0]
        if stop <= resident:
            return jax.tree.map(lambda a: a[start:stop], x.device)
        if start < resident:
            raise ValueError(f"layers [{start}, {stop}) straddle a split weight's boundary at layer {resident}")
        return jax.tree.map(lambda a: a[start - resident:stop - resident], x.host)
    return jax.tree.map(one, state, is_leaf=lambda x: is_resident_split(x) or _is_pair(x))


def in_host_memory(x) -> bool:
    """Whether a (traced or concrete) array lives in host memory, as its aval says."""
    memory_space = getattr(jax.typeof(x), "memory_space", None)
    return getattr(memory_space, "name", None) == "Host"


def any_in_host_memory(tree) -> bool:
    return any(in_host_memory(x) for x in jax.tree.leaves(tree))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AccumulatingWeight:
    """A host-resident weight (or its layer slice) and the float32 running sum of its gradients, same shape.

    Stands in for the weight's value in the parameter state the model is
    merged from; the scan slices both per layer and `layer_to_device` turns
    the pair into the weight's device copy.
    """

    weight: jax.Array
    grad_sum: jax.Array


@jax.custom_vjp
def _into_hbm_accumulating(weight, grad_sum):
    return jax.device_put(weight, jax.memory.Space.Device)


def _into_hbm_accumulating_fwd(weight, grad_sum):
    return jax.device_put(weight, jax.memory.Space.Device), grad_sum


def _into_hbm_accumulating_bwd(grad_sum, grad):
    # The weight is not differentiated (the train step differentiates the sums): no cotangent.
    new_sum = jax.device_put(grad_sum, jax.memory.Space.Device) + grad.astype(jnp.float32)
    return None, jax.device_put(new_sum, jax.memory.Space.Host)


_into_hbm_accumulating.defvjp(_into_hbm_accumulating_fwd, _into_hbm_accumulating_bwd)


def _is_pair(x) -> bool:
    return isinstance(x, AccumulatingWeight)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeptRows:
    """What a scan over streamed layers needs to keep its last layers' weights across the turn
    (offload.params_keep): per leaf of the scanned state (flattened, a weight/sum pair as one), the whole host
    rows (`whole`, read outside the gradient) and the HBM copy of the last ones (`kept`), None for device
    leaves; `first`: the index of the first kept layer in the scan."""
    whole: list
    kept: list
    first: int = dataclasses.field(metadata={"static": True})


def kept_rows(stacked_state, count: int) -> KeptRows:
    """The KeptRows of a scan over `stacked_state` whose last `count` layers keep their weights: those rows of
    the host weights copied into HBM in one copy, before the scan, outside the gradient."""
    def whole(x):
        weight = x.weight if _is_pair(x) else x
        return jax.lax.stop_gradient(weight) if in_host_memory(weight) else None
    rows = [whole(x) for x in jax.tree.leaves(stacked_state, is_leaf=_is_pair)]
    length = jax.tree.leaves(stacked_state)[0].shape[0]
    kept = [None if w is None else jax.device_put(w[length - count:], jax.memory.Space.Device) for w in rows]
    return KeptRows(rows, kept, length - count)


def _fetched(whole, kept, layer, first):
    """Layer `layer`'s weights in HBM: the kept copy's row when the layer is kept, else its row of the host
    array copied in. The row is read inside the branch, so a kept layer's row never leaves host memory."""
    return jax.lax.cond(layer >= first,
                        lambda: jax.lax.dynamic_index_in_dim(kept, jnp.maximum(layer - first, 0), keepdims=False),
                        lambda: jax.device_put(jax.lax.dynamic_index_in_dim(whole, layer, keepdims=False),
                                               jax.memory.Space.Device))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _into_hbm_or_kept(weight, whole, kept, layer, first):
    del weight   # the scanned row: only its gradient is made here (below), its value read from `whole`
    return _fetched(whole, kept, layer, first)


def _into_hbm_or_kept_fwd(weight, whole, kept, layer, first):
    return _fetched(whole, kept, layer, first), None


def _into_hbm_or_kept_bwd(first, _, grad):
    # The plain copy's transpose: the layer's gradient goes to host memory, into the scan's stacked gradient.
    return jax.device_put(grad, jax.memory.Space.Host), None, None, None


_into_hbm_or_kept.defvjp(_into_hbm_or_kept_fwd, _into_hbm_or_kept_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _into_hbm_accumulating_or_kept(weight, grad_sum, whole, kept, layer, first):
    del weight, grad_sum
    return _fetched(whole, kept, layer, first)


def _into_hbm_accumulating_or_kept_fwd(weight, grad_sum, whole, kept, layer, first):
    return _fetched(whole, kept, layer, first), grad_sum


def _into_hbm_accumulating_or_kept_bwd(first, grad_sum, grad):
    return (*_into_hbm_accumulating_bwd(grad_sum, grad), None, None, None)


_into_hbm_accumulating_or_kept.defvjp(_into_hbm_accumulating_or_kept_fwd, _into_hbm_accumulating_or_kept_bwd)


def layer_to_device(layer_state, kept: KeptRows | None = None, layer=None):
    """One layer's weight slices: host-resident ones copied into HBM (tagged), the rest untouched. With
    `kept` (`kept_rows` of the scanned state) and `layer` (this layer's index in the scan), a kept layer takes
    its weights from the HBM copy instead of copying them in (offload.params_keep)."""
    leaves, tree = jax.tree.flatten(layer_state, is_leaf=_is_pair)

    def one(x, index):
        whole = None if kept is None else kept.whole[index]
        if whole is not None and _is_pair(x):
            fetched = _into_hbm_accumulating_or_kept(x.weight, x.grad_sum, whole, kept.kept[index], layer,
                                                     kept.first)
        elif whole is not None:
            fetched = _into_hbm_or_kept(x, whole, kept.kept[index], layer, kept.first)
        elif _is_pair(x):
            fetched = _into_hbm_accumulating(x.weight, x.grad_sum)
        elif in_host_memory(x):
            fetched = jax.device_put(x, jax.memory.Space.Device)
        else:
            return x
        return checkpoint_name(fetched, DEVICE_WEIGHTS)
    return jax.tree.unflatten(tree, [one(x, index) for index, x in enumerate(leaves)])


def host_zeros_f32_like(stacked: jax.Array) -> jax.Array:
    """float32 zeros shaped like a stacked host weight, in host memory, made a layer at a time.

    A scan whose every iteration sends one layer of zeros to host memory: XLA
    stacks its outputs in a host buffer, so HBM holds one layer of zeros at most.
    """
    def one_layer(carry, _):
        return carry, jax.device_put(jnp.zeros(stacked.shape[1:], jnp.float32), jax.memory.Space.Host)
    return jax.lax.scan(one_layer, None, None, length=stacked.shape[0])[1]


def is_expert_weight(logical_axes) -> bool:
    """Whether a weight with these logical axes (with or without the stack's leading "layers") holds routed
    experts: its first axis (after "layers") is "expert"."""
    axes = tuple(logical_axes or ())
    if axes[:1] == (names.LAYERS,):
        axes = axes[1:]
    return axes[:1] == (names.EXPERT,)


def stacked_weight_memory(metadata: dict, setting: str) -> str:
    """Where a stacked (per-layer) weight lives: its `param_memory` metadata, else the offload.params setting
    ("device", "host", or "experts": host for routed experts' weights, device for the rest)."""
    explicit = metadata.get("param_memory")
    if explicit:
        return explicit
    if setting == EXPERTS:
        return Memory.HOST if is_expert_weight(metadata.get("logical_axes")) else Memory.DEVICE
    return setting


@contextlib.contextmanager
def initialised_in_host_memory(setting: str) -> Iterator[None]:
    """Models built inside create their host-resident stacked weights straight in host memory, a layer at a
    time (layers/stack.py), as `setting` (offload.params) and each weight's `param_memory` place them."""
    token = _INITIAL_SETTING.set(setting)
    try:
        yield
    finally:
        _INITIAL_SETTING.reset(token)


def initial_setting() -> str | None:
    """The setting `initialised_in_host_memory` put in force, or None outside it."""
    return _INITIAL_SETTING.get()


def send_layer_to_host(layer_module, setting: str) -> None:
    """Move one freshly made layer's host-resident weights into host memory, in place."""
    from flax import nnx   # here, not at the top: the rest of this module needs only jax

    for _, var in nnx.iter_graph(layer_module):
        if isinstance(var, nnx.Variable) and not isinstance(var, nnx.RngState) \
                and stacked_weight_memory(var.get_metadata(), setting) == Memory.HOST:
            var.set_value(jax.device_put(var.get_value(), jax.memory.Space.Host))


def _reads_host_memory(avals) -> bool:
    """Whether an equation reads an array in host memory (its inputs' avals): the layer's weights as they lie
    there, before (or as) they are copied into HBM."""
    return any(getattr(getattr(a, "memory_space", None), "name", None) == "Host" for a in avals)


def kept_shapes(kept: KeptRows | None) -> frozenset:
    """The shapes a kept layer's row is read through: the HBM copy's [K, ...] and its one-row slice [1, ...]
    (`never_save_device_weights` recomputes what reads them)."""
    if kept is None:
        return frozenset()
    rows = [k for k in kept.kept if k is not None]
    return frozenset(tuple(k.shape) for k in rows) | frozenset((1, *k.shape[1:]) for k in rows)


def never_save_device_weights(policy, kept: frozenset = frozenset()):
    """`policy` (a jax.checkpoint policy), except that DEVICE_WEIGHTS values are always recomputed, and so is
    anything read straight from host memory. A policy that saves every primitive's output (save_all) would
    otherwise save the fetch's own output (a device_put, or the kept layers' conditional), the same array
    under no name, and keep every streamed layer's weights in HBM until the backward pass (measured: the 8B
    pick at save_all fetched no weights in its backward pass before this); or save a slice of the host rows
    inside the conditional's branch, a host-memory residual that XLA's layout assignment then rejects
    ("Expected instruction to have shape equal to ...", jaxlib 0.10.2, H200 target). And, where layers keep
    their weights across the turn, anything read from the kept HBM copy (`kept`: its shapes, `kept_shapes`):
    the conditional's partial evaluation would otherwise save the kept branch's row as a residual of every
    layer (zeros where the other branch ran), a weight-sized buffer per layer (10.2 GiB for the 8B pick)."""
    def wrapped(prim, *args, **params):
        if prim.name == "name" and params.get("name") == DEVICE_WEIGHTS:
            return False
        if _reads_host_memory(args) or any(tuple(getattr(a, "shape", ())) in kept for a in args):
            return False
        return policy(prim, *args, **params)
    return wrapped


@contextlib.contextmanager
def keeping_fetched_weights(layers: int) -> Iterator[None]:
    """Block stacks traced inside keep the fetched device weights of their last `layers` layers for the
    backward pass (offload.params_keep); 0 keeps none."""
    token = _KEPT_LAYERS.set(layers)
    try:
        yield
    finally:
        _KEPT_LAYERS.reset(token)


def kept_layers() -> int:
    """The count `keeping_fetched_weights` put in force (0 outside it)."""
    return _KEPT_LAYERS.get()
