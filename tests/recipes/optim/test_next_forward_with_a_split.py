"""offload.update=next_forward with a real split (offload.optimizer_state=host:N, 0 < N < L): the first L - N
block layers' state in HBM, each layer updated there in the forward pass just before it runs, from pending
gradients in HBM; the last N layers' state in host memory, each updated in the forward pass just before its
layer runs, its copies beside compute.

Trains as the update after the backward pass with the same split, a run stopped and resumed equals the
uninterrupted one bit for bit, and a run may resume under another split. With the pending gradients in host
memory it is one line (the resident layers' update reads them in HBM in the forward pass).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from spillway.layers.errors import ConfigError
from spillway.recipes.train import step as step_lib
from spillway.recipes.train.loop import train
# The most the four-step runs below may differ from the update after the backward pass (float32): host:L's
# bounds; a real error (a leaf left out, a layer updated twice or not at all) moves the weights by ~1e-3.
from tests.recipes.optim.test_next_forward_with_every_layer_on_host import PARAMS_APART, STATE_APART
from tests.recipes.optim.test_update_in_forward import (IN_FORWARD, MESHES, PENDING_IN_HBM,
                                                      assert_same_weights_and_state, flush_beside_next_step,
                                                      largest_difference, twenty_steps)
from tests.recipes.train.host_training import LAYERS, small_recipe
from tests.recipes.train.test_train import data_cache, losses, micro  # noqa: F401 (data_cache: a fixture)

ONE_LAYER_ON_HOST = "offload.optimizer_state=host:1"


def test_a_split_with_pending_gradients_in_host_memory_is_one_config_error():
    with pytest.raises(ConfigError, match=rf"updates the {LAYERS - 1} resident block layers in HBM in the forward pass.* set "
                                          rf"offload.pending_gradients=device, or offload.optimizer_state=host:{LAYERS}"
                       ) as raised:
        small_recipe(ONE_LAYER_ON_HOST, "train.grad_accum=1", IN_FORWARD)
    assert "\n" not in str(raised.value)


def test_the_host_layers_state_is_on_host_and_the_resident_layers_and_pending_gradients_in_hbm():
    """Placement only (no step compiled)."""
    s = step_lib.setup(small_recipe(ONE_LAYER_ON_HOST, "train.grad_accum=1", IN_FORWARD, PENDING_IN_HBM),
                       MESHES["one_device"]())
    opt_state = s.optimizer.init(s.params)
    split_leaves = [leaf for leaf in jax.tree.leaves(opt_state.mu, is_leaf=lambda x: hasattr(x, "host"))
                    if hasattr(leaf, "host")]
    assert split_leaves
    assert {leaf.host.sharding.memory_kind for leaf in split_leaves} == {"pinned_host"}
    assert {leaf.device.sharding.memory_kind for leaf in split_leaves} == {"device"}
    assert {(leaf.device.shape[0], leaf.host.shape[0]) for leaf in split_leaves} == {(LAYERS - 1, 1)}
    pending = s.nothing_pending(s.params).grads
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(pending)} == {"device"}


@pytest.mark.parametrize("mesh_name,settings", [
    ("one_device", ("train.grad_accum=1",)),
    pytest.param("fsdp8", ("train.grad_accum=2",), marks=pytest.mark.slow),
])
def test_four_steps_equal_the_update_after_backward_with_the_same_split(mesh_name, settings):
    """Four float32 steps against offload.update=after_backward with host:1 of 3 layers (clipping active)."""
    mesh = MESHES[mesh_name]()
    placement = (ONE_LAYER_ON_HOST, *settings)
    after = twenty_steps(small_recipe(*placement), mesh, steps=4)
    deferred = twenty_steps(small_recipe(*placement, IN_FORWARD, PENDING_IN_HBM), mesh, steps=4)
    assert min(after[2]) > 0.5, "clipping must be active for the test to cover it"
    assert deferred[3] == after[3]
    np.testing.assert_allclose(deferred[2], after[2], rtol=1e-6)
    assert largest_difference(after[0], deferred[0]) < PARAMS_APART
    assert largest_difference(after[1], deferred[1]) < STATE_APART


@pytest.mark.slow  # four short runs: about two minutes on 2 cores
def test_a_run_stopped_and_resumed_equals_the_uninterrupted_run_and_resumes_under_another_split(data_cache, tmp_path):
    """The flush before a checkpoint settles the resident layers and the host ones: a run stopped after step 4
    and resumed logs the losses and ends with the weights of the uninterrupted one, bit for bit. The same
    checkpoint resumed with one layer's state more on host trains on (a checkpoint holds whole state leaves)."""
    settings = ("train.grad_accum=2", IN_FORWARD, PENDING_IN_HBM)
    straight = train(micro(data_cache, tmp_path / "straight", ONE_LAYER_ON_HOST, *settings), progress=False)
    first = train(micro(data_cache, tmp_path / "resumed", ONE_LAYER_ON_HOST, *settings), progress=False, stop_after=4)
    second = train(micro(data_cache, tmp_path / "resumed", ONE_LAYER_ON_HOST, *settings), progress=False)
    assert (first.final_step, second.final_step) == (4, 6)
    assert {**losses(first), **losses(second)} == losses(straight)
    assert largest_difference(straight.model, second.model) == 0

    train(micro(data_cache, tmp_path / "resplit", ONE_LAYER_ON_HOST, *settings), progress=False, stop_after=4)
    resplit = train(micro(data_cache, tmp_path / "resplit", "offload.optimizer_state=host:2", *settings),
                    progress=False)
    assert resplit.final_step == 6
    np.testing.assert_allclose(list(losses(resplit).values()), list(losses(straight).values())[-2:], rtol=1e-4)


@pytest.mark.parametrize("mesh_name,accumulate", [("one_device", ("train.grad_accum=1",)),
                                                  pytest.param("fsdp8", ("train.grad_accum=2",), marks=pytest.mark.slow),
                                                  ("fsdp8", ("train.grad_accum=2", "model.num_layers=2",
                                                             "offload.activations=save_all"))])
def test_the_flush_applies_the_pending_update_as_the_next_steps_forward_pass_does_bit_for_bit(mesh_name, accumulate):
    """As tests/recipes/optim/test_update_in_forward.py checks it for all layers on host: the flush before a
    checkpoint and the next step's forward pass give the same weights and state, resident layers' and host
    layers', bit for bit (else a resumed run drifts from the run it resumes)."""
    s = step_lib.setup(small_recipe(ONE_LAYER_ON_HOST, *accumulate, IN_FORWARD, PENDING_IN_HBM), MESHES[mesh_name]())
    flushed, hooked, batch = flush_beside_next_step(s)
    assert_same_weights_and_state(s, flushed, hooked)
    _, _, hooked_pending, hooked_metrics = hooked
    # The resumed run's next step (nothing pending) makes the gradients and norm of the run that went on.
    _, _, resumed_pending, resumed_metrics = s.train_step(*flushed, batch)
    assert float(resumed_metrics["grad_norm"]) == float(hooked_metrics["grad_norm"])
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(hooked_pending.grads)[0],
                            jax.tree.leaves(resumed_pending.grads), strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=jax.tree_util.keystr(path))
