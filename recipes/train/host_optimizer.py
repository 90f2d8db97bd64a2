"""Streaming an optimizer update through HBM for state that lives in pinned host memory.

The optimizer state of a host-resident parameter (AdamW moments, fp32 master
weights) stays in `pinned_host` memory. Copying all of it to HBM for the update
does not lower peak HBM; it raises it above keeping the state on device
(docs/DESIGN.md section 6; today's figures from benchmarks/optimizer_state_toy.py
are in BENCHMARKS.md). What lowers it is moving
the state through HBM one layer at a time, so HBM only ever holds a layer or two:

    prefetch(0)
    for layer i in 0 .. L-2:            lax.fori_loop, dynamic slices
        prefetch(i + 1)                 host -> HBM, in flight during the update of layer i
        update(layer i)                 on device, with the state prefetched last iteration
        write back(layer i)             HBM -> host, dynamic_update_slice into the host buffer
    update + write back(layer L-1)      nothing left to prefetch

A large leaf outside the stack (Llama 3 8B's embedding and head: 5.9 GiB of
state each) goes the same way in pieces of rows along an axis its sharding
does not split (`update_outside_stack`, pieces of at most PIECE_ELEMENTS), one
leaf after the other; small leaves (norm scales) visit HBM whole.

The prefetched slices travel in the loop carry (double buffering). `lax.scan`
over the layer axis measured worse (docs/DESIGN.md section 6: more HBM, plus a host
temp the size of the state), hence `fori_loop` + `dynamic_slice` +
`device_put` per slice.

What XLA (jaxlib 0.10.2, H200 target) makes of it, read from the compiled HLO:
the slice copies become async `dynamic-slice-start/done` (host -> HBM) and
`dynamic-update-slice-start/done` (HBM -> host) fusions; with the barrier in
`stream_update` the update of layer i runs inside the window of the
prefetch of layer i+1 (at most two copies in flight: with a master copy, two of
the three prefetches overlap). The write-back of layer i is ordered after that
prefetch, so the two link directions do not overlap each other. Double
buffering costs one layer's state of HBM (0.44 GiB for a 4096x14336 layer
without master copy); `prefetch=False` saves it and serialises copy and update.
For AdamW the update is short next to the copies (HBM is ~100x faster than the
host link), so what the prefetch hides is small; the link time is the cost.

Memory moves use `jax.device_put(x, jax.memory.Space.Device | Host)` inside the
jitted step: that changes only the memory kind and leaves the sharding to XLA's
propagation, so the same code runs on any mesh (Auto or Explicit axes) and in a
deviceless compile for a GPU target whose compile-only devices report no
memories.

This module knows nothing about AdamW: it streams any per-piece update
function. recipes/train/optimizer.py supplies the AdamW maths.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from spillway.layers import jax_compat

# Largest piece of a non-stacked leaf streamed through HBM, in elements: 64 Mi
# elements is 256 MiB per fp32 state array, about one layer of the largest
# stacked Llama 3 8B leaf (4096 x 14336), so non-stacked leaves never set a
# higher peak than the layer loop does.
PIECE_ELEMENTS = 1 << 26

# (grad piece, param piece, state pieces on device) -> (new param piece, new state pieces on device)
PieceUpdate = Callable[[jax.Array, jax.Array, tuple[jax.Array, ...]], tuple[jax.Array, tuple[jax.Array, ...]]]


def to_device(x: jax.Array) -> jax.Array:
    """Copy into device memory (HBM on a GPU), keeping the sharding."""
    return jax.device_put(x, jax.memory.Space.Device)


def to_host(x: jax.Array) -> jax.Array:
    """Copy into pinned host memory, keeping the sharding."""
    return jax.device_put(x, jax.memory.Space.Host)


def stream_update(
    update_fns: Sequence[PieceUpdate],
    grads: Sequence[jax.Array],
    params: Sequence[jax.Array],
    host_states: Sequence[tuple[jax.Array, ...]],
    *,
    axis: int = 0,
    piece: int = 1,
    prefetch: bool = True,
) -> tuple[list[jax.Array], list[tuple[jax.Array, ...]]]:
    """Update leaves piece by piece along `axis`, streaming their host state through device memory.

    Stacked leaves go a layer at a time (axis 0, piece 1, the defaults); a
    large non-stacked leaf (embedding, head) goes `piece` rows at a time
    along an axis its sharding does not split. All leaves share
    shape[axis], a multiple of `piece`. `grads[k]` and `params[k]` are in
    device memory, `host_states[k]` is a tuple of host arrays (e.g. mu, nu,
    master) of the param's shape. `update_fns[k]` updates one piece of leaf k
    (elementwise, so any piece will do). Returns (new params, new host
    states), same layout.
    """
    length = params[0].shape[axis]
    if any(p.shape[axis] != length for p in params) or any(
            s.shape[axis] != length for states in host_states for s in states):
        raise ValueError(f"stream_update needs every leaf to share the length of axis {axis} "
                         f"({length}); got {[p.shape for p in params]}")
    if piece <= 0 or length % piece:
        raise ValueError(f"stream_update: piece {piece} must divide the axis length {length}")
    num_pieces = length // piece

    def _piece(x: jax.Array, i) -> jax.Array:
        # keepdims-style slice: the piece keeps the leaf's rank, so the leaf's
        # PartitionSpec (this axis unsharded) applies to it unchanged.
        return lax.dynamic_slice_in_dim(x, i * piece, piece, axis=axis)

    def _put_piece(x: jax.Array, new_piece: jax.Array, i) -> jax.Array:
        return lax.dynamic_update_slice_in_dim(x, new_piece, i * piece, axis=axis)

    def fetch(states, i):
        return [tuple(to_device(_piece(s, i)) for s in leaf_states) for leaf_states in states]

    def compute_piece(i, params, on_device):
        """The update of piece i, on device; returns new param pieces and new state pieces."""
        return [fn(_piece(g, i), _piece(p, i), leaf_dev)
                for fn, g, p, leaf_dev in zip(update_fns, grads, params, on_device)]

    def write_piece(i, params, states, results):
        new_params, new_states = [], []
        for p, leaf_states, (new_p, new_dev) in zip(params, states, results):
            new_params.append(_put_piece(p, new_p.astype(p.dtype), i))
            new_states.append(tuple(_put_piece(s, to_host(d.astype(s.dtype)), i)
                                    for s, d in zip(leaf_states, new_dev)))
        return new_params, new_states

    def update_piece(i, params, states, on_device):
        return write_piece(i, params, states, compute_piece(i, params, on_device))

    def body(i, carry):
        params, states, current = carry
        # Issued before the update of layer i and independent of it: the copy
        # that can overlap the update. It reads row i+1 of the host buffers.
        upcoming = fetch(states, i + 1)
        results = compute_piece(i, params, current)
        # The write-back below updates row i of the same host buffers in
        # place. XLA cannot tell rows i and i+1 apart; without an order
        # between the prefetch's read and that write it copies every host
        # buffer whole, every iteration (a host temp the size of the state).
        # The barrier orders the write after both the read and the update,
        # and leaves the update free to run while the prefetch is in flight.
        new_states = [new_dev for _, new_dev in results]
        upcoming, new_states, states = lax.optimization_barrier((upcoming, new_states, states))
        results = [(new_p, new_dev) for (new_p, _), new_dev in zip(results, new_states)]
        params, states = write_piece(i, params, states, results)
        return params, states, upcoming

    if not prefetch:
        def body_without_prefetch(i, carry):
            params, states = carry
            return update_piece(i, params, states, fetch(states, i))
        return lax.fori_loop(0, num_pieces, body_without_prefetch, (list(params), list(host_states)))

    carry = (list(params), list(host_states), fetch(host_states, 0))
    params_out, states_out, last = lax.fori_loop(0, num_pieces - 1, body, carry)
    return update_piece(num_pieces - 1, params_out, states_out, last)


def update_outside_stack(update_fn: PieceUpdate, grad: jax.Array, param: jax.Array,
                         host_state: tuple[jax.Array, ...], *, axis: int | None,
                         max_elements: int = PIECE_ELEMENTS, after: Any = None, prefetch: bool = True
                         ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Update a non-stacked host leaf (embedding, final norm, head), its state visiting HBM in turn.

    A leaf larger than `max_elements` goes through `stream_update` in pieces
    of rows along `axis` (an axis its sharding does not split; None: whole).
    Whole, Llama 3 8B's embedding or head state is 5.9 GiB in HBM at once (mu,
    nu and master, fp32, 128256 x 4096); in 8 pieces of 16,032 rows it is
    0.73 GiB a piece (twice that while the next piece is prefetched). A small
    leaf (a norm scale) visits HBM whole.

    `after`: the new host state of the previous leaf updated this way (or
    None). This leaf's state starts moving only once that exists, so two
    leaves never hold HBM at the same time. Unordered, XLA brought Llama 3
    8B's whole embedding and head state in together: 44.5 GiB of HBM against
    38.6 GiB in order, for the train step compiled for an H200
    (benchmarks/llama_hbm.py, before the pieces).
    """
    if after is not None:
        host_state, _ = lax.optimization_barrier((tuple(host_state), after))
    rows = None if axis is None else piece_rows(param.shape, axis, max_elements)
    if rows is None or rows == param.shape[axis]:
        new_p, new_dev = update_fn(grad, param, tuple(to_device(s) for s in host_state))
        return new_p.astype(param.dtype), tuple(to_host(d.astype(s.dtype)) for s, d in zip(host_state, new_dev))
    (new_p,), (new_state,) = stream_update([update_fn], [grad], [param], [tuple(host_state)],
                                           axis=axis, piece=rows, prefetch=prefetch)
    return new_p, new_state


def piece_rows(shape: Sequence[int], axis: int, max_elements: int) -> int:
    """Rows per piece along `axis`: the largest divisor of shape[axis] whose piece has <= max_elements.

    At least one row, whatever its size.
    """
    length = shape[axis]
    row_elements = math.prod(shape) // length if length else 0
    best = 1
    for rows in range(1, length + 1):
        if length % rows == 0 and rows * row_elements <= max_elements:
            best = rows
    return best


def update_on_host(update_fn: PieceUpdate, grad: jax.Array, param: jax.Array,
                   host_state: tuple[jax.Array, ...]) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Run the whole update of one host leaf on the host CPU (jax.experimental.compute_on, via layers.jax_compat).

    The gradient (and the parameter, when there is no master copy) are copied
    to host memory, the update runs as a host computation on host buffers, and
    only the new parameter comes back to device memory. The state never enters
    HBM; the cost is host compute and memory bandwidth instead of the GPU's.
    """
    def update(grad_h, param_h, state_h):
        new_p, new_state = update_fn(grad_h, param_h, state_h)
        return new_p.astype(param_h.dtype), tuple(d.astype(s.dtype) for s, d in zip(state_h, new_state))

    # Every output stays in host memory: the new state is the host state, and
    # the new parameter crosses the link once, below.
    new_p_host, new_state = jax_compat.on_host(update, out_memory_spaces=jax.memory.Space.Host)(
        to_host(grad), to_host(param), tuple(host_state))
    return to_device(new_p_host), new_state


def _fresh_state(param, with_master: bool):
    zeros = jnp.zeros(param.shape, jnp.float32)
    return (zeros, zeros) + ((param.astype(jnp.float32),) if with_master else ())


def new_host_state(param: jax.Array, with_master: bool) -> tuple[jax.Array, ...]:
    """Zero moments (and an fp32 copy of `param`) created by the host CPU, straight in host memory.

    Zeros made on the device and then moved would need the whole leaf in HBM
    once (with a master copy, twice): the init would then peak above the
    streamed update it prepares (measured 8.75 GiB against 5.5 GiB for the
    16-layer toy). Built by a host computation they never touch HBM; only the
    parameter crosses the link, once, for the master copy.
    """
    # Without a master copy the parameter is not read and XLA drops its transfer.
    fresh = functools.partial(_fresh_state, with_master=with_master)
    state = jax_compat.on_host(fresh, out_memory_spaces=jax.memory.Space.Host)(to_host(param))
    return tuple(state)


def group_by_layer_count(indices: Sequence[int], shapes: Sequence[tuple[int, ...]]) -> dict[int, list[int]]:
    """Stacked leaves grouped by their layer-axis length: each group is one streaming loop."""
    groups: dict[int, list[int]] = {}
    for k in indices:
        groups.setdefault(shapes[k][0], []).append(k)
    return groups


def tree_nbytes_by_memory_kind(tree: Any, per_process: bool = True) -> dict[str, int]:
    """Bytes of a tree of arrays (or ShapeDtypeStructs with shardings) per memory kind.

    With per_process=True, counts what this process holds: every addressable
    shard, so a leaf replicated over 8 local devices counts 8 times (each copy
    takes host RAM). Shardings that name no devices (an abstract mesh) and
    leaves without a sharding count the global size once; no sharding means
    "device".
    """
    totals: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        itemsize = jnp.dtype(leaf.dtype).itemsize
        nbytes = math.prod(leaf.shape) * itemsize
        kind = (sharding.memory_kind if sharding is not None else None) or "device"
        if per_process and sharding is not None:
            try:
                devices = sharding.addressable_devices
                nbytes = math.prod(sharding.shard_shape(leaf.shape)) * itemsize * len(devices)
            except (AttributeError, ValueError, TypeError):
                pass  # abstract mesh: no devices to count shards on
        totals[kind] = totals.get(kind, 0) + nbytes
    return totals
