"""Where a save in pieces spends its time: taking a piece out of an array in pinned host memory, by each way
there is, against copying the whole array and against tensorstore's write of the pieces.

A save of host-resident state in pieces (recipes/train/checkpoint_io.py) took each zarr chunk out of its
shard with a compiled slice run where the shard lies (the host CPU for a pinned_host shard) and copied it into
NumPy. On a TPU v5e that save ran at 84 MB/s (BENCHMARKS.md, "On a TPU"); it now reads each chunk through the
device (recipes/train/piece_take.py). This script times, per piece size, on whatever jax finds (run it on the
TPU machine, or here on CPU for the same lines):

* `host slice`: the slice on the host CPU (piece_take's fallback, the save's way before), then NumPy;
* `host rows`: the piece as a range of rows of the array seen as 2-D (a slice of one axis), sliced by the host
  CPU, then NumPy;
* `device slab`: the save's way now (piece_take.take_piece: the device reads the piece's slab into HBM, a
  slice of one axis, and the piece is cut there; on CPU a plain slice), then NumPy;
* `tensorstore`: the pieces written as a zarr3 array on local disk, uncompressed, and compressed as orbax
  writes (zstd level 3) with the save's pieces in flight and with 8;
* `whole array`: np.asarray of the whole array at once (the rate of one big copy, for scale), last.

Each line ends with the process's resident size and the machine's available memory after it.

    python -m benchmarks.piece_take_rate [--gib 2] [--piece-mib 8,32,128]
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from benchmarks.tpu_host_buffers import memory_now
from spillway.recipes.train import checkpoint_io, piece_take

MiB = 2**20


def _rate(nbytes: int, seconds: float) -> str:
    # with the memory after it: a way that copies more than its piece shows as a growing resident size
    return f"{nbytes / MiB / seconds:8.0f} MiB/s ({seconds:.2f} s); {memory_now()}"


def _host_array(gib: float) -> jax.Array:
    rows = max(1, int(gib * 2**30 / (8192 * 8192 * 4)))
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    make = jax.jit(lambda: jnp.ones((rows, 8192, 8192), jnp.float32), out_shardings=host)
    return make().block_until_ready()


def _indices(shape, piece_rows: int):
    for layer in range(shape[0]):
        for start in range(0, shape[1], piece_rows):
            yield (slice(layer, layer + 1), slice(start, start + piece_rows), slice(0, shape[2]))


def _time_pieces(array, piece_rows: int, take) -> float:
    take(array, next(_indices(array.shape, piece_rows)))   # compile outside the timing
    start = time.perf_counter()
    for index in _indices(array.shape, piece_rows):
        take(array, index)
    return time.perf_counter() - start


def _host_slice(array, index):
    sizes = tuple(s.stop - s.start for s in index)
    slicer = piece_take._slicer(sizes, piece_take.in_host_memory_of_an_accelerator(array))
    return np.asarray(slicer(array, np.array([s.start for s in index], np.int32)))


def _host_rows(array, index):
    """A piece as a range of rows of the array seen as (rows, last axis), sliced by the host CPU."""
    rows_per_layer = array.shape[1]
    first = index[0].start * rows_per_layer + index[1].start
    count = index[1].stop - index[1].start
    return np.asarray(_host_rows_slicer(array.shape, count)(array, np.int32(first)))


@functools.cache
def _host_rows_slicer(shape, count: int):
    from spillway.layers import jax_compat

    def rows(x, first):
        return jax.lax.dynamic_slice_in_dim(x.reshape(-1, shape[-1]), first, count, axis=0)
    return jax_compat.on_host(rows, out_memory_spaces=jax.memory.Space.Host)


def _tensorstore_write(array_np_piece: np.ndarray, shape, piece_rows: int, zstd: bool = False,
                       in_flight: int | None = None) -> float:
    in_flight = in_flight or checkpoint_io.PIECES_IN_FLIGHT
    with tempfile.TemporaryDirectory() as folder:
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": folder},
                "metadata": {"shape": list(shape), "data_type": "float32",
                             "chunk_grid": {"name": "regular",
                                            "configuration": {"chunk_shape": [1, piece_rows, shape[2]]}},
                             # orbax's codecs for a compressed array: zstd at level 3
                             **({"codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                            {"name": "zstd", "configuration": {"level": 3}}]} if zstd else {})},
                "create": True, "delete_existing": True}
        store = ts.open(spec).result()
        start = time.perf_counter()
        pending = []
        for index in _indices(shape, piece_rows):
            pending.append(store[index].write(array_np_piece))
            if len(pending) >= in_flight:
                pending.pop(0).result()
        for write in pending:
            write.result()
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--piece-mib", default="8,32,128")
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.devices()[0].device_kind})", flush=True)
    array = _host_array(args.gib)
    nbytes = array.nbytes
    print(f"array {array.shape} float32 in {array.sharding.memory_kind}: {nbytes / 2**30:.2f} GiB", flush=True)
    print(f"array made: {memory_now()}", flush=True)
    for piece_mib in (int(p) for p in args.piece_mib.split(",")):
        piece_rows = max(1, piece_mib * MiB // (array.shape[2] * 4))
        label = f"{piece_mib:4d} MiB pieces"
        for name, take in (("host slice", _host_slice), ("host rows", _host_rows),
                           ("device slab", piece_take.take_piece)):
            try:
                seconds = _time_pieces(array, piece_rows, take)
                print(f"{label}  {name + ':':13s} {_rate(nbytes, seconds)}", flush=True)
            except Exception as error:   # noqa: BLE001 (a way the platform does not compile is a finding too)
                print(f"{label}  {name + ':':13s} failed: {str(error).splitlines()[0]}", flush=True)
        piece = np.ones((1, piece_rows, array.shape[2]), np.float32)
        seconds = _tensorstore_write(piece, array.shape, piece_rows)
        print(f"{label}  {'tensorstore:':13s} {_rate(nbytes, seconds)}", flush=True)
        piece = np.random.default_rng(0).standard_normal(piece.shape, np.float32)   # as incompressible as state
        for in_flight in (checkpoint_io.PIECES_IN_FLIGHT, 8):
            seconds = _tensorstore_write(piece, array.shape, piece_rows, zstd=True, in_flight=in_flight)
            print(f"{label}  {f'zstd, {in_flight} at once:':13s} {_rate(nbytes, seconds)}", flush=True)
    start = time.perf_counter()
    np.asarray(array)
    print(f"whole array  np.asarray: {_rate(nbytes, time.perf_counter() - start)}", flush=True)


if __name__ == "__main__":
    main()
