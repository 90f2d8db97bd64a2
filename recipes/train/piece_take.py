"""Taking one piece (a stored chunk) of a saved leaf out of the shard where it lies, into NumPy, copying the
piece and never the shard (NumPy's view of a whole jax CPU array is a copy of it). Used by the piece-wise
save (checkpoint_io.py).

Where the shard lies decides how:

* in device memory, or anywhere on the CPU platform (every memory kind is this RAM): a compiled slice where
  the shard is, then NumPy.
* in host memory beside an accelerator: the device reads a *slab* of the shard into HBM, the smallest block
  of it that is contiguous in memory and holds the piece (the shard seen as 2-D, rows x the axes after the
  first one the piece splits; a slice of one axis, the only slice a TPU takes out of host memory), cuts the
  piece there and copies it into NumPy. Consecutive pieces of one slab (the chunks of one row block) reuse
  it; one slab per shard being written is in HBM, at most a layer of one leaf. Measured on a TPU v5e (BENCHMARKS.md, "On a
  TPU", `python -m benchmarks.piece_take_rate`): 32 MiB pieces at 1,646 MiB/s this way against 108 MiB/s
  for a slice by the host CPU (XLA's host computation), which is what the save did before.
* where that program does not compile or run (a runtime that cannot read such a slab of host memory from a
  device program): the host CPU slices pieces of that shape for the rest of the process, with a warning.
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import numpy as np

from spillway.recipes.train.checkpoint_read import in_accelerator_host_memory

# The last slab read of each shard being written, {id(shard): (shard, slab key, slab)}, kept while the next
# pieces come from it; `release(shard)` drops it when the shard is written (a save writes several leaves at
# once, its items concurrently: one slab per shard in progress).
_SLABS: dict[int, tuple] = {}
# The ways a device reads a slab out of host memory, tried in order (slab_of); then the host CPU slices.
SLAB_WAYS = ("rows", "layer")
# The slabs (`_slab_key`) a device could not read out of host memory: the next way takes their pieces.
_DEVICE_CANNOT_READ_HOST: set[tuple] = set()
log = logging.getLogger(__name__)


def platform_of(array: jax.Array) -> str:
    # from the sharding's device set: a shard's own .devices() came back empty for the host part of a
    # ResidentSplit (offload.optimizer_state=host:N) on jax 0.10.2
    return next(iter(array.sharding.device_set)).platform


def in_host_memory_of_an_accelerator(shard: jax.Array) -> bool:
    return in_accelerator_host_memory(shard.sharding)


def take_piece(shard: jax.Array, index: tuple[slice, ...]) -> np.ndarray:
    """Region `index` (one slice per axis) of the single-device array `shard`, as a NumPy array."""
    if shard.ndim == 0:
        return np.asarray(shard)
    if in_host_memory_of_an_accelerator(shard):
        for way in SLAB_WAYS:
            if _slab_key(shard, index, way) in _DEVICE_CANNOT_READ_HOST:
                continue
            try:
                return _through_a_slab(shard, index, way)
            except jax.errors.JaxRuntimeError as error:
                # the device cannot read this slab of host memory here (a compile or run refused it): the
                # next way for such pieces from now on, at last the host CPU, slower but always there
                _DEVICE_CANNOT_READ_HOST.add(_slab_key(shard, index, way))
                release(shard)
                _tell_slab_refused(shard, index, way, error)
    sizes = tuple(s.stop - s.start for s in index)
    starts = np.array([s.start for s in index], np.int32)
    return np.asarray(_slicer(sizes, in_host_memory_of_an_accelerator(shard))(shard, starts))


def _tell_slab_refused(shard: jax.Array, index: tuple[slice, ...], way: str, error: Exception) -> None:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    last = way == SLAB_WAYS[-1]
    (log.warning if last else log.info)(
        "checkpoint save: the device could not read the %s slab %s of a %s %s array in host memory (%s); %s",
        way, slab_of(shard.shape, index, way), shard.shape, shard.dtype, first_line,
        "the host CPU slices such pieces instead, more slowly" if last else "trying a whole layer")


def _slab_key(shard: jax.Array, index: tuple[slice, ...], way: str) -> tuple:
    """What decides whether the device program compiles: the platform, the array's shape and dtype, the
    slab's axis and rows (not where it starts)."""
    axis, _, rows = slab_of(shard.shape, index, way)
    return platform_of(shard), shard.shape, str(shard.dtype), axis, rows


def release(shard: jax.Array) -> None:
    """Drops the slab of `shard` kept in HBM (once its pieces are taken, and after a failure)."""
    _SLABS.pop(id(shard), None)


def slab_of(shape: tuple[int, ...], index: tuple[slice, ...], way: str = "rows") -> tuple[int, int, int]:
    """(axis, first row, rows): the slab holding region `index` of an array of `shape`, as rows of the array
    seen as (prod(shape[:axis + 1]), *shape[axis + 1:]).

    "rows": `axis` is the first axis the region does not hold as one index (every axis before it is one
    index, the axes after it whole in the slab): the smallest contiguous block. Seeing the array so merges
    the axes up to `axis`, which a TPU does in place only where its tiled minor axes stay as they are.
    "layer": the rows of the first axis the region covers (a layer of a stacked leaf): no axis merged."""
    sizes = [s.stop - s.start for s in index]
    if way == "layer":
        return 0, index[0].start, sizes[0]
    axis = next((a for a, size in enumerate(sizes) if size != 1), len(shape) - 1)
    first = 0
    for a in range(axis + 1):
        first = first * shape[a] + index[a].start
    return axis, first, sizes[axis]


def _through_a_slab(shard: jax.Array, index: tuple[slice, ...], way: str) -> np.ndarray:
    axis, first, rows = slab_of(shard.shape, index, way)
    device = jax.sharding.SingleDeviceSharding(next(iter(shard.sharding.device_set)), memory_kind="device")
    key = (axis, first, rows)
    kept = _SLABS.get(id(shard))
    if kept is not None and kept[0] is shard and kept[1] == key:
        slab = kept[2]
    else:
        release(shard)   # the shard's slab before is freed before the next is read: one in HBM at a time
        slab = _slab_reader(shard.shape, shard.dtype, axis, rows, device)(shard, np.int32(first))
        _SLABS[id(shard)] = (shard, key, slab)
    sizes = tuple(s.stop - s.start for s in index)
    # where the piece lies in the slab: at its first row (the slab starts where the region does), and at the
    # region's own place in the later axes
    inner = (0, *(s.start for s in index[axis + 1:]))
    if sizes[axis:] == slab.shape:
        return np.asarray(slab).reshape(sizes)
    piece = _slicer(sizes[axis:], False)(slab, np.array(inner, np.int32))
    return np.asarray(piece).reshape(sizes)


@functools.cache
def _slab_reader(shape: tuple[int, ...], dtype, axis: int, rows: int, device):
    """A device program reading `rows` rows of a host-memory array seen as (prod(shape[:axis + 1]),
    *shape[axis + 1:]) into HBM. The reshape merges leading axes only; the slice is of one axis."""
    merged = math.prod(shape[:axis + 1])

    def read(x, first):
        return jax.lax.dynamic_slice_in_dim(x.reshape(merged, *shape[axis + 1:]), first, rows, axis=0)
    return jax.jit(read, out_shardings=device)


@functools.cache
def _slicer(sizes: tuple[int, ...], on_host: bool):
    """A compiled slice of `sizes` at dynamic starts, run where the shard lies (one compile per piece shape)."""
    def take(x, starts):
        return jax.lax.dynamic_slice(x, tuple(starts[i] for i in range(len(sizes))), sizes)
    if on_host:
        from spillway.layers import jax_compat
        return jax_compat.on_host(take, out_memory_spaces=jax.memory.Space.Host)
    return jax.jit(take)
