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

The device copy must never be a remat residual, or the backward pass would
keep every layer's weights in HBM after all. It is tagged `DEVICE_WEIGHTS`
and `never_save_device_weights` wraps any checkpoint policy so that this name
is always recomputed (the copy is repeated in the backward pass, which is the
point: the weights come in again). Blocks do not tag it; the stack does.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

# checkpoint_name of a layer's weights copied into HBM inside the scan: never saved.
DEVICE_WEIGHTS = "layer_weights_on_device"


def in_host_memory(x) -> bool:
    """Whether a (traced or concrete) array lives in host memory, as its aval says."""
    memory_space = getattr(jax.typeof(x), "memory_space", None)
    return getattr(memory_space, "name", None) == "Host"


def any_in_host_memory(tree) -> bool:
    return any(in_host_memory(x) for x in jax.tree.leaves(tree))


def layer_to_device(layer_state):
    """One layer's weight slices: host-resident ones copied into HBM (tagged), the rest untouched."""
    def one(x):
        if not in_host_memory(x):
            return x
        return checkpoint_name(jax.device_put(x, jax.memory.Space.Device), DEVICE_WEIGHTS)
    return jax.tree.map(one, layer_state)


def never_save_device_weights(policy):
    """`policy` (a jax.checkpoint policy), except that DEVICE_WEIGHTS values are always recomputed."""
    def wrapped(prim, *args, **params):
        if prim.name == "name" and params.get("name") == DEVICE_WEIGHTS:
            return False
        return policy(prim, *args, **params)
    return wrapped
