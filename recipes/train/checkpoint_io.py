"""Piece-wise checkpoint writes: each array leaf written from where it lives, one bounded piece at a time.

Orbax 0.12.8's ArrayHandler saves a tree by first copying every array of it
into host memory (`replica_slices.transfer_arrays_to_host`: device arrays
staged in pinned memory, then every array copied into NumPy), and only then
writing: the whole state twice in host memory during a save. Its
`device_host_max_bytes` batches whole arrays and transfers them after `save`
returns, when the train step has already donated (overwritten) them. Neither
bounds a save of state that lives in host memory, so this module adds the
smallest piece that does, on orbax's own type-handler interface:

* `RowPieces` (row_pieces.py): a saved leaf of shape (L, ...) held as one array or as
  consecutive row blocks (LayerHalves' two halves), never joined.
* `PieceWiseArrayHandler`: an orbax ArrayHandler whose `serialize` writes a
  RowPieces leaf with the tensorstore spec orbax itself builds
  (`ts_utils.build_array_write_spec`: the same zarr3 array in the same OCDBT
  database, the same sharding file and array metadata), one zarr chunk at a
  time, at most `PIECES_IN_FLIGHT` pieces in host memory at once. The chunk
  shape is chosen (orbax's `choose_chunk_shape`) at most `PIECE_BYTES`, with
  the layer axis split first for stacked leaves, so every piece is whole
  chunks and tensorstore never reads back what it wrote. Its typestr is
  orbax's "jax.Array": a step opens with orbax's own ArrayHandler, like a
  step written by orbax's default path (and like steps written before this
  module existed). Its `deserialize` reads leaves in pieces straight into
  their targets (checkpoint_read.py) when their args say so.
* `PieceWiseCheckpointHandler`: orbax's StandardCheckpointHandler with that
  handler used for RowPieces leaves (plain arrays keep orbax's default
  path, the async one with whole staging), and a `restore` that reads every
  leaf in pieces.

A piece is taken from the shard where it lies (piece_take.py: a device
shard sliced by the device, a pinned-host shard read by the device a row
block at a time; on CPU a plain compiled slice) and copied into NumPy: one
piece, never the shard. The writes run in the caller's thread,
before `save` returns (the step after a save donates the state, so nothing may
read it later), while tensorstore writes the previous pieces.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from orbax.checkpoint._src.metadata import array_metadata_store as array_metadata_store_lib
from orbax.checkpoint._src.multihost import multihost
from orbax.checkpoint._src.serialization import jax_array_handlers, ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
from orbax.checkpoint._src.serialization import type_handler_registry, types

# One zarr chunk, and so one piece in host memory, at most PIECE_BYTES; PIECES_IN_FLIGHT writes at once. What
# that holds is the planner's too (host_memory.PIECES_STAGING_BYTES), hence the constants live there.
from spillway.recipes.train import piece_take
from spillway.recipes.train.checkpoint_read import PiecesRestoreArgs, read_leaves, restore_args_of, saved_struct_of
from spillway.recipes.train.host_memory import SAVE_PIECE_BYTES as PIECE_BYTES  # noqa: E402
from spillway.recipes.train.host_memory import SAVE_PIECES_IN_FLIGHT as PIECES_IN_FLIGHT  # noqa: E402
from spillway.recipes.train.row_pieces import RowPieces, as_pieces, is_saved_leaf, joined  # noqa: F401


# Every tensorstore operation a save in pieces started that has not finished. A failed save raises while
# some are still running in tensorstore's threads (a piece's write, a sibling item's array being created:
# orbax abandons the other items' coroutines, not what they started), and such a write makes its folders
# again (the file store creates parents): a failed save waits for them (settle_writes) before its
# unfinished folder is removed.
_STARTED: set = set()


def _started(operation):
    """`operation` (a tensorstore Future or WriteFutures) counted in _STARTED until it finishes."""
    _STARTED.add(operation)
    operation.add_done_callback(_STARTED.discard)
    return operation


def settle_writes(timeout_s: float = 120.0) -> int:
    """Blocks until every operation in _STARTED has finished (each at most `timeout_s`); their own errors are
    the failed save's, already raised. Returns how many were still running when called."""
    running = [operation for operation in list(_STARTED) if not operation.done()]
    for operation in running:
        try:
            operation.result(timeout=timeout_s)
        except Exception:   # noqa: BLE001 (the save's error is raised by the caller)
            pass
    return len(running)


def chunked(tree):
    """orbax SaveArgs for a whole save of `tree` (joined): zarr chunks of at most PIECE_BYTES, as a save in
    pieces writes, so that either restores a piece at a time (orbax alone chooses chunks up to 2 GiB)."""
    return jax.tree.map(lambda _: types.SaveArgs(chunk_byte_size=PIECE_BYTES), joined_structure(tree))


def joined_structure(tree):
    """`tree` with each LayerHalves / ResidentSplit / RowPieces as one leaf (the saved tree's structure)."""
    return jax.tree.map(lambda x: 0, tree, is_leaf=is_saved_leaf)


# -- taking one piece out of a shard -------------------------------------------------------------------


def _piece(shard: jax.Array, index: tuple[slice, ...]) -> np.ndarray:
    """Rows/columns `index` of a single-device array, in NumPy, copying the piece only (piece_take.py)."""
    return piece_take.take_piece(shard, index)


def _chunk_indices(shard_shape: tuple[int, ...], chunk_shape: tuple[int, ...]):
    """The chunks of one shard, as tuples of slices (the chunk shape divides the shard's)."""
    ranges = [range(0, n, c) for n, c in zip(shard_shape, chunk_shape)]
    for starts in (np.array(np.meshgrid(*ranges, indexing="ij")).reshape(len(ranges), -1).T if ranges else [()]):
        yield tuple(slice(int(s), int(s) + c) for s, c in zip(starts, chunk_shape))


def _shifted(index: tuple[slice, ...], rows: int) -> tuple[slice, ...]:
    if not index:
        return index
    return (slice(index[0].start + rows, index[0].stop + rows), *index[1:])


def _shard_slices(part: jax.Array, row_offset: int, replica_id: int | None):
    """(global index in the saved leaf, shard data) of the shards this process writes of one part."""
    for shard in part.addressable_shards:
        if replica_id is not None and shard.replica_id != replica_id:
            continue
        index = tuple(slice(s.start or 0, s.stop if s.stop is not None else n)
                      for s, n in zip(shard.index, part.shape))
        yield _shifted(index, row_offset), shard.data


def _stacked(value: RowPieces) -> bool:
    """Axis 0 counts layers (a LayerHalves leaf, or any leaf of rank >= 3): chunks of one layer at most."""
    return len(value.parts) > 1 or value.ndim >= 3


def saved_shard_shape(value: RowPieces) -> tuple[int, ...]:
    """The shard of the saved leaf this process writes (orbax's `local_shape`): a part's shard, with all the
    rows of the parts when there are several (their layer axis is not split)."""
    if not value.ndim:
        return ()
    part_shard = tuple(value.sharding.shard_shape(value.parts[0].shape))
    if len(value.parts) == 1:
        return part_shard
    if part_shard[0] != value.parts[0].shape[0]:
        raise ValueError(f"RowPieces with its row axis sharded ({value.sharding}): the parts cannot be written "
                         f"as one saved array")
    return (value.shape[0], *part_shard[1:])


# -- the orbax handlers -----------------------------------------------------------------------------------


class PieceWiseArrayHandler(jax_array_handlers.ArrayHandler):
    """Writes RowPieces leaves one chunk at a time into orbax's own array format (module docstring)."""

    async def serialize(self, values: Sequence[RowPieces], infos: Sequence[types.ParamInfo],
                        args: Sequence[types.SaveArgs] | None = None):
        args = args or [types.SaveArgs()] * len(values)
        array_metadatas = []
        for value, info, arg in zip(values, infos, args):
            await info.await_path_creation()
            array_metadatas.append(await self._write_leaf(value, info, arg))
        if self._array_metadata_store is not None:
            await self._array_metadata_store.write(checkpoint_dir=infos[0].parent_dir,
                                                   array_metadatas=array_metadatas,
                                                   process_index=multihost.process_index())
        await self._write_shardings(values, infos)
        return []   # everything is on disk: nothing left for orbax's background commit

    async def _write_leaf(self, value: RowPieces, info: types.ParamInfo, arg: types.SaveArgs):
        # orbax chooses the chunk shape from these (subchunking.choose_chunk_shape): at most PIECE_BYTES,
        # the layer axis split first for stacked leaves, dividing the shard
        write_arg = dataclasses.replace(arg, chunk_byte_size=PIECE_BYTES if value.ndim else None,
                                        shard_axes=(0,) if value.ndim and _stacked(value) else ())
        spec = ts_utils.build_array_write_spec(
            info=info, arg=write_arg, global_shape=value.shape, local_shape=saved_shard_shape(value),
            dtype=value.dtype, use_ocdbt=info.is_ocdbt_checkpoint,
            process_index=ocdbt_utils.get_process_index_for_subdir(info.is_ocdbt_checkpoint),
            metadata_key=self._metadata_key)
        chunk_shape = tuple(spec.metadata.chunk_shape) if value.ndim else ()
        if multihost.is_primary_host(self._primary_host):
            await _started(ts.open(ts.Spec(spec.json), create=True, open=True, context=info.ts_context))
        array = await _started(ts.open(ts.Spec(spec.json), open=True, assume_metadata=True,
                                       context=info.ts_context))
        await self._write_pieces(value, array, chunk_shape)
        return spec.metadata

    async def _write_pieces(self, value: RowPieces, array, chunk_shape: tuple[int, ...]) -> None:
        in_flight: collections.deque = collections.deque()
        row_offset = 0
        for part in value.parts:
            part_shard = tuple(part.sharding.shard_shape(part.shape)) if value.ndim else ()
            for target, data in _shard_slices(part, row_offset, self._replica_id):
                try:
                    for local in _chunk_indices(part_shard, chunk_shape):
                        piece = _piece(data, local)   # the only copy: one chunk
                        where = tuple(slice(t.start + c.start, t.start + c.stop) for t, c in zip(target, local))
                        # the piece is ours or a view of the state, which nothing writes before this save
                        # returns: no copy
                        in_flight.append(_started(array[where].write(piece,
                                                                       can_reference_source_data_indefinitely=True)))
                        while len(in_flight) >= PIECES_IN_FLIGHT:
                            await in_flight.popleft()
                finally:
                    piece_take.release(data)   # no slab of it stays in HBM, written or failed
            row_offset += part.shape[0] if value.ndim else 0
        while in_flight:
            await in_flight.popleft()

    async def _write_shardings(self, values: Sequence[RowPieces], infos: Sequence[types.ParamInfo]):
        """The `_sharding` file orbax writes beside the arrays (what a restore without a target reads)."""
        if self._enable_write_sharding_file:
            # orbax's own writer of that file (private in 0.12.8; the file's format is orbax's)
            await jax_array_handlers._async_serialize_shardings(
                shardings=[v.sharding for v in values], infos=infos, primary_host=self._primary_host)


    async def deserialize(self, infos: Sequence[types.ParamInfo], args: Sequence[types.RestoreArgs] | None = None):
        """Leaves restored into their targets a piece at a time (checkpoint_read.py); leaves whose args are
        orbax's own (not PiecesRestoreArgs) the way orbax reads them."""
        if not args or not all(isinstance(a, PiecesRestoreArgs) for a in args):
            return await super().deserialize(infos, args)
        types.check_input_arguments(infos, args)
        for info in infos:
            await info.await_path_creation()
        return await read_leaves(infos, args, self._metadata_key)


class _RegistryWithRowPieces(types.TypeHandlerRegistry):
    """orbax's global type-handler registry, with RowPieces leaves sent to PieceWiseArrayHandler. Lookups by
    typestr (a restore: "jax.Array") still find orbax's own handlers."""

    def __init__(self, base: types.TypeHandlerRegistry):
        self._base = base
        self._pieces = PieceWiseArrayHandler(array_metadata_store=array_metadata_store_lib.Store())

    def add(self, ty, handler, func=None, override: bool = False, ignore_warnings: bool = False):
        self._base.add(ty, handler, func, override, ignore_warnings)

    def get(self, ty):
        if isinstance(ty, type) and issubclass(ty, RowPieces):
            return self._pieces
        return self._base.get(ty)

    def has(self, ty) -> bool:
        return (isinstance(ty, type) and issubclass(ty, RowPieces)) or self._base.has(ty)


class PieceWiseCheckpointHandler(ocp.StandardCheckpointHandler):
    """orbax's StandardCheckpointHandler (StandardSave / StandardRestore) that also takes RowPieces leaves,
    written by PieceWiseArrayHandler; everything else is orbax's."""

    def __init__(self, *, save_concurrent_gb: int = 96, restore_concurrent_gb: int = 96):
        super().__init__(save_concurrent_gb=save_concurrent_gb, restore_concurrent_gb=restore_concurrent_gb)
        self._supported_types = (*self._supported_types, RowPieces)
        self._impl = ocp.PyTreeCheckpointHandler(
            save_concurrent_gb=save_concurrent_gb, restore_concurrent_gb=restore_concurrent_gb,
            type_handler_registry=_RegistryWithRowPieces(type_handler_registry.GLOBAL_TYPE_HANDLER_REGISTRY))


    def restore(self, directory, item=None, args=None):
        """orbax's restore of the tree, every leaf read in pieces into its target (checkpoint_read.py). A
        target leaf is a ShapeDtypeStruct with a sharding, or a RowPieces of them (the leaf's rows restored
        into those parts, e.g. LayerHalves' halves: the RowPieces comes back with the parts' arrays)."""
        from orbax.checkpoint._src.handlers import pytree_checkpoint_handler
        target = (args.item if args is not None else item)
        is_target = lambda x: isinstance(x, (RowPieces, jax.ShapeDtypeStruct))   # noqa: E731
        saved = jax.tree.map(lambda t: saved_struct_of(t), target, is_leaf=is_target)
        restore_args = jax.tree.map(lambda t: restore_args_of(t), target,
                                    is_leaf=is_target)
        return self._impl.restore(directory, args=pytree_checkpoint_handler.PyTreeRestoreArgs(
            item=saved, restore_args=restore_args))


# orbax finds an item's handler from its args' registered handler type: these are StandardSave and
# StandardRestore for PieceWiseCheckpointHandler (orbax's own stay registered for its own handler).


@ocp.args.register_with_handler(PieceWiseCheckpointHandler, for_save=True)
@dataclasses.dataclass
class PieceWiseSave(ocp.args.StandardSave):
    """StandardSave whose tree may hold RowPieces leaves."""


@ocp.args.register_with_handler(PieceWiseCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class PieceWiseRestore(ocp.args.StandardRestore):
    """StandardRestore, through PieceWiseCheckpointHandler (orbax's own restore)."""
