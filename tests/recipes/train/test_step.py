"""The train step's shape (recipes/train/step.py, batch.py): one signature whether the update is deferred or not,
the batch as one object split into micro-batches one way. Traced, never compiled: the step's maths is checked
against references in test_aux_losses.py, test_update_in_forward.py, test_host_params.py and test_loss.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spillway.layers.mesh import MeshConfig
from spillway.layers.sharding import make_mesh
from spillway.recipes.optim.update_in_forward import PendingUpdate
from spillway.recipes.train import batch as batch_lib
from spillway.recipes.train import step as step_lib
from tests.recipes.train.host_training import small_recipe

AFTER_BACKWARD = ("train.grad_accum=1",)
IN_FORWARD = ("offload.optimizer_state=host", "train.grad_accum=1", "offload.update=next_forward")


def one_device():
    return make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1])


@pytest.mark.parametrize("settings", [AFTER_BACKWARD, IN_FORWARD], ids=["after backward", "next forward"])
def test_every_step_takes_and_gives_params_state_pending_and_a_batch(settings):
    s = step_lib.abstract_setup(small_recipe(*settings), one_device(), platform="cpu")
    params, opt_state, pending, batch = step_lib.abstract_step_arguments(s)
    assert isinstance(batch, batch_lib.Batch) and batch.tokens.shape == (8, 17) and batch.tokens.dtype == jnp.int32
    assert (pending is None) == (not s.defers_update)
    assert isinstance(pending, PendingUpdate) == s.defers_update
    new_params, new_state, new_pending, metrics = jax.eval_shape(s.train_step, params, opt_state, pending, batch)
    assert jax.tree.structure(new_params) == jax.tree.structure(params)
    assert jax.tree.structure(new_state) == jax.tree.structure(opt_state)
    assert jax.tree.structure(new_pending) == jax.tree.structure(pending)
    assert {"loss", "grad_norm", "learning_rate"} <= set(metrics)
    flushed = jax.eval_shape(s.flush, params, opt_state, pending)
    assert jax.tree.structure(flushed) == jax.tree.structure((params, opt_state, pending))


def test_without_a_deferred_update_flush_returns_its_arguments_and_nothing_is_pending():
    s = step_lib.abstract_setup(small_recipe(*AFTER_BACKWARD), one_device(), platform="cpu")
    params, opt_state = object(), object()
    assert s.flush(params, opt_state, None) == (params, opt_state, None)
    assert s.nothing_pending(s.params) is None and not s.defers_update


def test_micro_batch_m_takes_rows_m_plus_multiples_of_the_count():
    rows = np.arange(8 * 3, dtype=np.int32).reshape(8, 3)
    micro = batch_lib.micro_batches(batch_lib.from_rows(rows), 4)
    assert micro.tokens.shape == (4, 2, 3)
    for m in range(4):
        np.testing.assert_array_equal(micro.tokens[m], rows[m::4])


def test_the_batch_from_the_loaders_rows_is_int32_split_over_the_batch_axes():
    mesh = make_mesh(MeshConfig(1, len(jax.devices()), 1))
    sharding = step_lib.batch_sharding(mesh)
    rows = np.arange(8 * 5, dtype=np.int64).reshape(8, 5)
    placed = batch_lib.to_global(batch_lib.from_rows(rows), sharding)
    assert placed.tokens.dtype == jnp.int32 and placed.tokens.sharding == sharding
    np.testing.assert_array_equal(np.asarray(placed.tokens), rows)


def test_the_step_donates_the_params_and_the_state_on_every_platform_host_state_included():
    """CPU too (jax 0.10.2 pairs a donated host buffer only with a host output; test_host_memory.py runs the
    donated step with host state on CPU): a step never holds two copies of the state. The batch is not."""
    recipe = small_recipe("offload.optimizer_state=host", "train.grad_accum=1")
    for platform in ("cpu", "cuda"):
        s = step_lib.abstract_setup(recipe, one_device(), platform=platform)
        params_info, state_info, _, batch_info = s.train_step.trace(*step_lib.abstract_step_arguments(s)).args_info[0]
        assert all(info.donated for info in jax.tree.leaves(params_info)), platform
        assert all(info.donated for info in jax.tree.leaves(state_info)), platform
        assert not any(info.donated for info in jax.tree.leaves(batch_info)), platform
