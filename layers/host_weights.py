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
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from spillway.layers import names
from spillway.layers.memory import EXPERTS, Memory

# checkpoint_name of a layer's weights copied into HBM inside the scan: never saved.
DEVICE_WEIGHTS = "layer_weights_on_device"

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


def layer_to_device(layer_state):
    """One layer's weight slices: host-resident ones copied into HBM (tagged), the rest untouched."""
    def one(x):
        if _is_pair(x):
            return checkpoint_name(_into_hbm_accumulating(x.weight, x.grad_sum), DEVICE_WEIGHTS)
        if not in_host_memory(x):
            return x
        return checkpoint_name(jax.device_put(x, jax.memory.Space.Device), DEVICE_WEIGHTS)
    return jax.tree.map(one, layer_state, is_leaf=_is_pair)


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


def never_save_device_weights(policy):
    """`policy` (a jax.checkpoint policy), except that DEVICE_WEIGHTS values are always recomputed."""
    def wrapped(prim, *args, **params):
        if prim.name == "name" and params.get("name") == DEVICE_WEIGHTS:
            return False
        return policy(prim, *args, **params)
    return wrapped
