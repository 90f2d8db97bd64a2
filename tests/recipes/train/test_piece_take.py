"""Taking a save's pieces out of host memory (recipes/train/piece_take.py): the slab a device reads is the
smallest contiguous block holding the piece, pieces of one slab reuse it, the save it serves is exact and
readable by orbax, and a runtime whose device cannot read host memory that way falls back to the host CPU.

CPU's memory kinds are the same RAM and code paths; the accelerator-only branch is forced on."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from spillway.layers.memory import PINNED_HOST
from spillway.recipes.optim.host_streaming import LayerHalves
from spillway.recipes.train import checkpoint_io, piece_take
from spillway.recipes.train.checkpoint import RunCheckpointer
from tests.recipes.train.test_checkpoint_pieces import chunk_shapes, save, sds


def test_a_slab_is_the_smallest_contiguous_block_holding_the_piece():
    # a layer's half: the rows of one layer, whole in the last axis (the TPU's stored chunk of 2026-12-07)
    assert piece_take.slab_of((2, 8192, 2048), (slice(1, 2), slice(4096, 8192), slice(0, 2048))) == (1, 12288, 4096)
    # a chunk splitting the last axis: the slab is its rows, whole in the last axis
    assert piece_take.slab_of((4, 16, 32), (slice(2, 3), slice(0, 8), slice(16, 32))) == (1, 32, 8)
    # whole layers, and a plain 2-D leaf's row block
    assert piece_take.slab_of((4, 16, 32), (slice(2, 4), slice(0, 16), slice(0, 32))) == (0, 2, 2)
    assert piece_take.slab_of((300, 5), (slice(100, 200), slice(0, 5))) == (0, 100, 100)
    # single elements in every axis but the last
    assert piece_take.slab_of((4, 16, 32), (slice(3, 4), slice(5, 6), slice(8, 16))) == (2, 3 * 16 * 32 + 5 * 32 + 8, 8)
    # the way that merges no axis: the layer
    assert piece_take.slab_of((4, 16, 32), (slice(2, 3), slice(0, 8), slice(16, 32)), "layer") == (0, 2, 1)


@pytest.fixture
def as_on_an_accelerator(monkeypatch):
    """Host-memory shards taken as beside an accelerator (the device reads slabs); counts the slabs read."""
    monkeypatch.setattr(piece_take, "in_host_memory_of_an_accelerator",
                        lambda shard: shard.sharding.memory_kind == PINNED_HOST)
    monkeypatch.setattr(piece_take, "_DEVICE_CANNOT_READ_HOST", set())
    monkeypatch.setattr(checkpoint_io, "PIECE_BYTES", 64)   # chunks of 16 floats: two axes split
    slabs = []
    reader = piece_take._slab_reader

    def counted(shape, dtype, axis, rows, device):
        read = reader(shape, dtype, axis, rows, device)
        return lambda x, first: slabs.append((shape, int(first), rows)) or read(x, first)
    monkeypatch.setattr(piece_take, "_slab_reader", counted)
    return slabs


def host_state():
    stacked = jnp.arange(4 * 6 * 8, dtype=jnp.float32).reshape(4, 6, 8)
    host = stacked.sharding.with_memory_kind(PINNED_HOST)
    halves = LayerHalves(jax.device_put(stacked[:2], host), jax.device_put(stacked[2:], host))
    return stacked, {"mu": halves, "count": jnp.int32(3)}


def test_host_state_saved_through_slabs_is_exact_and_each_slab_is_read_once(tmp_path, as_on_an_accelerator):
    stacked, opt_state = host_state()
    params = {"w": jnp.ones(4)}
    with RunCheckpointer(tmp_path, keep=2, every_steps=1, save_in_pieces=True) as ckpt:
        save(ckpt, 1, params, opt_state)
    chunk = chunk_shapes(tmp_path / "1" / "opt_state")["mu"]
    assert chunk[0] == 1 and chunk[2] < 8   # the pieces split the last axis: not contiguous in memory
    np.testing.assert_array_equal(ocp.StandardCheckpointer().restore(tmp_path / "1" / "opt_state")["mu"], stacked)
    # every piece of one row block came from one read of its slab: each half's (layers x row blocks), once
    rows_seen_2d = [(layer * 6 + row, chunk[1]) for layer in range(2) for row in range(0, 6, chunk[1])]
    assert [(first, rows) for shape, first, rows in as_on_an_accelerator] == rows_seen_2d * 2
    assert not piece_take._SLABS   # no slab is left in device memory after the save


@pytest.mark.parametrize("refused_ways", [("rows",), ("rows", "layer")])
def test_a_slab_the_device_cannot_read_goes_to_the_next_way(tmp_path, as_on_an_accelerator, monkeypatch,
                                                            refused_ways):
    """As on a TPU, whose host-memory reads refuse a reshape that changes its tiled minor axes: the rows that
    merge axes are refused, the layer is read instead; where that is refused too the host CPU slices."""
    through = piece_take._through_a_slab

    def refused(shard, index, way):
        if way in refused_ways:
            raise jax.errors.JaxRuntimeError("UNIMPLEMENTED: Bitcast changes dimensionality in an unsupported way")
        return through(shard, index, way)
    monkeypatch.setattr(piece_take, "_through_a_slab", refused)
    stacked, opt_state = host_state()
    with RunCheckpointer(tmp_path, keep=2, every_steps=1, save_in_pieces=True) as ckpt:
        save(ckpt, 1, {"w": jnp.ones(4)}, opt_state)
        restored = ckpt.restore(1, abstract_params={"w": sds(jnp.ones(4))},
                                abstract_opt_state={"mu": sds(stacked), "count": sds(opt_state["count"])})
    np.testing.assert_array_equal(restored["opt_state"]["mu"], stacked)
    assert {key[0] for key in piece_take._DEVICE_CANNOT_READ_HOST} == {"cpu"}
    layers_read = [read for read in as_on_an_accelerator if read[2] == 1]   # slabs of one row of axis 0
    assert len(layers_read) == (0 if "layer" in refused_ways else 4)   # each half's 2 layers, once each
