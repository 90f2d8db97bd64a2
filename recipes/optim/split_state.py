"""The state of a stacked leaf split by layer: the first layers' in HBM, the last ones' in pinned host memory.

`offload.optimizer_state=host:N` (layers/residency.py) keeps the state of the last N block layers in host
memory and the rest in HBM. Each such state array is a `ResidentSplit`: two arrays along the layer axis,
`device` (layers [0, L - N)) and `host` (layers [L - N, L); on a GPU itself `LayerHalves`,
recipes/optim/host_streaming.py). The optimizer updates the device part whole on the device and streams
the host part, in the same step (recipes/optim/optimizer.py).

Checkpoints hold one whole array per state leaf whatever the placement (`Optimizer.saved_form`): a split
leaf is joined into one host array, so a checkpoint restores under any split, or none (`split_saved`
cuts it again). docs/DESIGN.md section 6 tells the whole of it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spillway.layers import host_weights, jax_compat
from spillway.recipes.optim import host_streaming as streaming


# One stacked leaf's state array as two: `device` (the first layers, in HBM) and `host` (the last ones, in
# pinned host memory: an array or LayerHalves). Defined beside the split weights it also serves.
ResidentSplit = host_weights.ResidentSplit


def host_layers_of(host_part) -> int:
    return host_part.num_layers if isinstance(host_part, streaming.LayerHalves) else host_part.shape[0]


def join_split(split: ResidentSplit) -> jax.Array:
    """The split state as one host array of shape (L, ...): the device part copied out, joined by the host CPU."""
    host = streaming.join_halves(split.host) if isinstance(split.host, streaming.LayerHalves) else split.host
    return jax_compat.on_host(lambda a, b: jnp.concatenate([a, b], axis=0),
                              out_memory_spaces=jax.memory.Space.Host)(streaming.to_host(split.device), host)


def split_saved(x: jax.Array, host_layers: int, halved: bool) -> ResidentSplit:
    """A saved (whole, host) state array cut into a ResidentSplit: the first layers into HBM, the last
    `host_layers` left in host memory (as LayerHalves when `halved`). Cut by the host CPU."""
    resident = x.shape[0] - host_layers
    first, last = jax_compat.on_host(lambda a: (a[:resident], a[resident:]),
                                     out_memory_spaces=jax.memory.Space.Host)(streaming.to_host(x))
    return ResidentSplit(streaming.to_device(first), streaming.split_halves(last) if halved else last)


def saved_struct(split: ResidentSplit) -> jax.ShapeDtypeStruct:
    """What a ResidentSplit of ShapeDtypeStructs is saved as: the whole leaf, in the host part's sharding."""
    host = split.host.first if isinstance(split.host, streaming.LayerHalves) else split.host
    layers = split.device.shape[0] + host_layers_of(split.host)
    return jax.ShapeDtypeStruct((layers, *host.shape[1:]), host.dtype, sharding=host.sharding)
