"""Piece-wise checkpoint reads: each saved array read straight into its target placement, a stored chunk at a time.

Orbax 0.12.8's ArrayHandler restores a shard by reading all of it into a
fresh NumPy array (`serialization._read_shard`: `np.zeros(shard shape)`) and
only then `device_put`ting it where the target says; its byte limiter
(`restore_concurrent_gb`) bounds how many such shards are read at once, not
the size of one (a stacked 8B state leaf is 7 GiB). So a restore of host
state held the state once in its target placement and, beside it, NumPy
copies of up to `restore_concurrent_gb` of it; and a LayerHalves leaf (the
saved form is one array per leaf) came back whole and was then split, a
second copy of that leaf. The smallest piece on top of orbax that bounds it,
on its own type-handler interface (checkpoint_io.PieceWiseArrayHandler calls
`read_leaves` from its `deserialize`):

* the restore target of a leaf may be a `RowPieces` of ShapeDtypeStructs
  (LayerHalves' two halves, a ResidentSplit's device rows then host rows):
  each part is restored into its own placement, the saved rows of the part
  read straight into it; no whole leaf is ever made;
* every shard of a target is allocated where it lives (zeros made by the host
  CPU for a host memory kind on a GPU, so they never pass through HBM), then
  filled a piece at a time: a piece is read by tensorstore (orbax's own read
  spec, `ts_utils.build_array_read_spec`, with its cast to the target dtype)
  into NumPy and written into the shard by a donated `dynamic_update_slice`
  that runs where the shard lies (the streamed update's own way of writing a
  row into a host buffer). At most `PIECES_IN_FLIGHT` reads are in flight.
* a piece is the stored zarr chunk (read chunk template) grown up to
  `PIECE_BYTES`, so a read decodes each stored chunk once. A step written by
  this code (in pieces or by orbax's whole save, both with chunks of at most
  `PIECE_BYTES`) restores 32 MiB at a time; an older step, whose chunks orbax
  chose up to 2 GiB (`ts_utils.calculate_chunk_byte_size`), a stored chunk at a
  time: tensorstore decodes a compressed chunk whole, so no read can be smaller.
  Into a TPU's host memory a piece is whole in every axis after the first one
  it splits (`_writes_slice_one_axis`): larger than `PIECE_BYTES` where a
  stored chunk is part of a layer.
* any target sharding and mesh: a target shard reads its own region of the
  saved array, whatever sharding the save had (tensorstore reads across the
  stored chunks it overlaps), so a step saved on one mesh restores on another.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts
from jax import lax
from orbax.checkpoint._src.serialization import jax_array_handlers, jax_array_restore_args, types
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

from spillway.recipes.train.host_memory import SAVE_PIECE_BYTES as PIECE_BYTES
from spillway.recipes.train.host_memory import SAVE_PIECES_IN_FLIGHT as PIECES_IN_FLIGHT
from spillway.recipes.train.row_pieces import RowPieces


@dataclasses.dataclass
class PiecesRestoreArgs(jax_array_restore_args.ArrayRestoreArgs):
    """orbax's ArrayRestoreArgs of one leaf read in pieces: `parts` are the targets (ShapeDtypeStructs with
    shardings) whose rows make up the saved array, in row order; one part for a plain leaf."""

    parts: tuple = ()


def restore_args_of(target) -> PiecesRestoreArgs:
    """The restore args of one target leaf: a ShapeDtypeStruct with a sharding, or a RowPieces of them.
    `restore_type` sends the leaf to the piece-wise handler (orbax looks handlers up by it)."""
    parts = tuple(target.parts) if isinstance(target, RowPieces) else (target,)
    return PiecesRestoreArgs(restore_type=RowPieces, sharding=parts[0].sharding, global_shape=target.shape,
                             dtype=target.dtype, parts=parts)


def saved_struct_of(target) -> jax.ShapeDtypeStruct:
    """The saved array a target leaf reads (for orbax's tree of the item): the parts' rows as one array."""
    if isinstance(target, RowPieces):
        return jax.ShapeDtypeStruct(target.shape, target.dtype, sharding=target.parts[0].sharding)
    return target


# -- writing one piece into a shard where it lies ----------------------------------------------------------


def in_accelerator_host_memory(sharding) -> bool:
    """Whether arrays of `sharding` lie in host memory beside an accelerator (the saves' piece taking reads them
    through the device too, piece_take.py). On CPU every memory kind is this RAM and a plain jit reaches all."""
    return (sharding.memory_kind not in (None, "device")
            and next(iter(sharding.device_set)).platform != "cpu")


def _writes_slice_one_axis(sharding) -> bool:
    """Whether a write into this shard may differ from it in one axis only: a TPU lowers a write into host
    memory as an async dynamic-update-slice that slices one dimension ("UNIMPLEMENTED: Async slice only
    supports slicing in 1 dimension", v5e, jax 0.10.2); a GPU writes any region."""
    return in_accelerator_host_memory(sharding) and next(iter(sharding.device_set)).platform == "tpu"


@functools.cache
def _zeros(shape: tuple[int, ...], dtype, sharding):
    """A compiled zeros of one shard, made where it lives (by the host CPU for host memory on a GPU)."""
    def make():
        return jnp.zeros(shape, dtype)
    if in_accelerator_host_memory(sharding):
        from spillway.layers import jax_compat
        make = jax_compat.on_host(make, out_memory_spaces=jax.memory.Space.Host)
    return jax.jit(make, out_shardings=sharding)


@functools.cache
def _writer(sizes: tuple[int, ...], sharding):
    """A compiled, donated write of a piece of `sizes` at dynamic starts into a shard (one compile a shape)."""
    to_host = in_accelerator_host_memory(sharding)

    def put(shard, piece, starts):
        if to_host:
            piece = jax.device_put(piece, jax.memory.Space.Host)
        return lax.dynamic_update_slice(shard, piece, tuple(starts[i] for i in range(len(sizes))))
    return jax.jit(put, donate_argnums=0, out_shardings=sharding)


# -- the pieces of one shard ---------------------------------------------------------------------------------


def piece_shape(shard_shape: Sequence[int], chunk: Sequence[int], itemsize: int,
                limit: int | None = None, one_axis: bool = False) -> tuple[int, ...]:
    """The shape of the pieces a shard is read in: the stored chunk (never less: a compressed chunk is
    decoded whole), grown along the last axes first while a piece holds at most `limit` bytes.

    `one_axis`: the pieces may be smaller than the shard in one axis only (`_writes_slice_one_axis`): every
    axis after the first one a piece splits is then whole, past `limit` where a chunk does not span it
    (a piece is still whole stored chunks)."""
    limit = PIECE_BYTES if limit is None else limit
    if 0 in shard_shape:   # an empty shard (a part with no rows): nothing to read
        return tuple(shard_shape)
    shape = [min(c, n) for c, n in zip(chunk, shard_shape)]
    for axis in reversed(range(len(shape))):
        others = math.prod(shape) // shape[axis] * itemsize
        fit = max(limit // others, 1)
        if fit >= shard_shape[axis]:
            shape[axis] = shard_shape[axis]
            continue
        shape[axis] = max(shape[axis], fit // shape[axis] * shape[axis])
        break
    if one_axis:
        split = next((axis for axis, (p, n) in enumerate(zip(shape, shard_shape)) if p < n), len(shape))
        shape[split + 1:] = shard_shape[split + 1:]
    return tuple(shape)


def _pieces(shard_shape: Sequence[int], shape: Sequence[int]):
    """The pieces of one shard, as tuples of slices relative to the shard (the last ones may be smaller)."""
    ranges = [range(0, n, p) for n, p in zip(shard_shape, shape)]
    for starts in (np.array(np.meshgrid(*ranges, indexing="ij")).reshape(len(ranges), -1).T if ranges else [()]):
        yield tuple(slice(int(s), min(int(s) + p, n)) for s, p, n in zip(starts, shape, shard_shape))


def _index_of(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((s.start or 0, s.stop if s.stop is not None else n) for s, n in zip(index, shape))


def _region(index, local, row_offset: int) -> tuple[slice, ...]:
    """A piece's region in the stored array: `local` within the shard at `index` of a part starting at
    `row_offset`."""
    where = [slice(a + s.start, a + s.stop) for (a, _), s in zip(index, local)]
    if where:
        where[0] = slice(where[0].start + row_offset, where[0].stop + row_offset)
    return tuple(where)


async def _read_shard(stored: ts.TensorStore, index, row_offset: int, dtype, targets) -> list[jax.Array]:
    """One shard (the part's region `index`) on each of `targets` (its devices), filled a piece at a time."""
    shard_shape = tuple(b - a for a, b in index)
    chunk = tuple(stored.chunk_layout.read_chunk_template.shape)
    one_axis = any(_writes_slice_one_axis(t) for t in targets)
    local_pieces = list(_pieces(shard_shape, piece_shape(shard_shape, chunk, np.dtype(dtype).itemsize,
                                                         one_axis=one_axis)))
    if len(local_pieces) == 1:   # the shard is one piece: placed as read, nothing to write into
        data = await stored[_region(index, local_pieces[0], row_offset)].read()
        return [jax.device_put(data, t) for t in targets]
    buffers = [_zeros(shard_shape, np.dtype(dtype), t)() for t in targets]

    def write(local, data: np.ndarray) -> None:
        starts = np.array([s.start for s in local], np.int32)
        for k, target in enumerate(targets):
            buffers[k] = _writer(data.shape, target)(buffers[k], data, starts)
        jax.block_until_ready(buffers)   # the piece is released before another is read

    in_flight: collections.deque = collections.deque()
    for local in local_pieces:
        in_flight.append((local, stored[_region(index, local, row_offset)].read()))
        if len(in_flight) >= PIECES_IN_FLIGHT:
            done, read = in_flight.popleft()
            write(done, await read)   # the next read runs in tensorstore's threads meanwhile
    while in_flight:
        done, read = in_flight.popleft()
        write(done, await read)
    return buffers


async def _read_part(stored: ts.TensorStore, part: jax.ShapeDtypeStruct, row_offset: int) -> jax.Array:
    """One target part (rows `row_offset`... of the stored array) in its sharding, each region read once and
    placed on every device that holds it."""
    sharding = part.sharding
    devices_by_index = collections.defaultdict(list)
    for device, index in sharding.addressable_devices_indices_map(part.shape).items():
        devices_by_index[_index_of(index, part.shape)].append(device)
    shards = []
    for index, devices in devices_by_index.items():
        targets = [jax.sharding.SingleDeviceSharding(d, memory_kind=sharding.memory_kind) for d in devices]
        shards.extend(await _read_shard(stored, index, row_offset, part.dtype, targets))
    return jax.make_array_from_single_device_arrays(part.shape, sharding, shards)


async def read_leaves(infos: Sequence[types.ParamInfo], args: Sequence[PiecesRestoreArgs],
                      metadata_key: str | None) -> list:
    """The leaves of `infos`, one after the other, each part read into its target: an array for a plain
    leaf, a RowPieces of the parts' arrays for a leaf restored into several."""
    use_ocdbt = jax_array_handlers._validate_ocdbt_settings(infos)   # orbax's check (private in 0.12.8)
    leaves = []
    for info, arg in zip(infos, args):
        spec = ts_utils.build_array_read_spec(info, use_ocdbt=use_ocdbt, metadata_key=metadata_key,
                                              raise_array_data_missing_error=info.raise_array_data_missing_error,
                                              target_dtype=arg.dtype)
        stored = await ts.open(ts.Spec(spec.json), open=True, context=info.ts_context)
        parts, row = [], 0
        for part in arg.parts:
            parts.append(await _read_part(stored, part, row))
            row += part.shape[0] if part.shape else 0
        leaves.append(RowPieces(tuple(parts)) if len(arg.parts) > 1 else parts[0])
    return leaves
