"""offload.update=next_forward with train.grad_accum > 1: the pending update applied in the first micro-batch's
forward pass, the float32 mean gradient of all micro-batches left pending, trains as the update after the
backward pass with the same micro-batches, and the train loop's flush and resume keep working.

CPU lowers memory-kind moves to no-ops, so these prove the maths and the loop; what the compiled GPU
schedule hides is the planner's (tests/recipes/plan/test_cost_model.py, BENCHMARKS.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spillway.layers.errors import ConfigError
from spillway.recipes.train import step as step_lib
from spillway.recipes.train.batch import Batch, micro_batches
from spillway.recipes.train.loop import train
from tests.recipes.optim.test_update_in_forward import MESHES, WEIGHTS, largest_difference, twenty_steps
from tests.recipes.train.host_training import batches, small_recipe
from tests.recipes.train.test_train import data_cache, losses, micro  # noqa: F401 (data_cache: a fixture)

ON_HOST = ("offload.optimizer_state=host",)
DEFERRED = ("offload.update=next_forward", "offload.pending_gradients=device")
# The most the six-step runs below may differ from the update after the backward pass (float32). Measured:
# weights 4.7e-7 and state 4.6e-9 apart with 4 micro-batches on one device, 7.5e-9 and 0 with 2 on fsdp8;
# a quarter of these margins, so that a real error (a micro-batch left out moves the weights by ~1e-3)
# cannot hide under them.
PARAMS_APART, STATE_APART = 2e-6, 2e-8


def _mean_gradient(s, params, tokens):
    """The float32 mean of the micro-batches' gradients of the step's objective: what the update after the
    backward pass hands the optimizer (recipes/train/step.py make_train_step), computed on its own."""
    objective = step_lib.make_objective(s.graphdef, mesh=s.mesh)
    grad_accum = s.recipe.train.grad_accum
    micro = micro_batches(Batch(tokens=tokens), grad_accum)
    grad_fn = jax.jit(jax.grad(lambda p, b: objective(p, b)[0]))
    grads = [grad_fn(params, jax.tree.map(lambda a: a[m], micro)) for m in range(grad_accum)]
    total = jax.tree.map(lambda *g: sum(x.astype(jnp.float32) for x in g), *grads)
    return jax.tree.map(lambda g: np.asarray(g / grad_accum), total)


def test_a_step_with_nothing_pending_leaves_the_mean_gradient_of_its_micro_batches_pending():
    """Nothing to apply: weights and state come back unchanged, and the new pending gradients are the float32
    mean over both micro-batches (not the first one's alone), in HBM, the old ones donated."""
    s = step_lib.setup(small_recipe(*ON_HOST, "train.grad_accum=2", *DEFERRED), MESHES["one_device"]())
    params, opt_state = s.params, s.optimizer.init(s.params)
    before = jax.tree.map(np.asarray, (params, s.optimizer.saved_form(opt_state)))
    expected = _mean_gradient(s, params, batches(s.recipe)[0])
    pending = s.nothing_pending(params)
    assert {leaf.dtype for leaf in jax.tree.leaves(pending.grads)} == {jnp.dtype(jnp.float32)}
    batch = Batch(tokens=jax.device_put(batches(s.recipe)[0], s.batch_sharding))
    new_params, new_state, new_pending, metrics = s.train_step(params, opt_state, pending, batch)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(pending.grads))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves((new_params, s.optimizer.saved_form(new_state)))):
        np.testing.assert_array_equal(np.asarray(b), a)
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(new_pending.grads)} == {"device"}
    # Another program computes the reference (no custom VJP, no scan): float32 rounding apart, no more.
    for (path, want), got in zip(jax.tree_util.tree_flatten_with_path(expected)[0],
                                 jax.tree.leaves(new_pending.grads), strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    norm = np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in jax.tree.leaves(expected)))
    np.testing.assert_allclose(float(metrics["grad_norm"]), norm, rtol=1e-6)
    assert bool(new_pending.apply) and float(new_pending.grad_norm) == float(metrics["grad_norm"])
    # Host memory holds the state alone, as after the backward pass with the same micro-batches.
    pinned = step_lib.pinned_bytes_of_setup(s)
    assert pinned.gradients == 0 < pinned.optimizer_state
    assert pinned.total == step_lib.pinned_host_bytes(small_recipe(*ON_HOST, "train.grad_accum=2"), s.mesh).total



@pytest.mark.slow   # two setups and their compiles: about a minute each case on 2 loaded cores
@pytest.mark.parametrize("mesh_name,grad_accum", [("one_device", 4), ("fsdp8", 2)])
def test_six_steps_accumulated_and_updated_in_the_next_forward_equal_the_update_after_backward(mesh_name, grad_accum):
    """Six float32 steps against the update after the backward pass with the same micro-batches. The mean
    gradient is made and its norm read as after the backward pass, so the first steps' norms are equal bit for
    bit; the weights are not: the update run in the forward pass (a custom VJP around each layer, the new
    weight fused into the layer) rounds apart from the update after the backward pass in the last bits, as with
    one micro-batch (tests/recipes/optim/test_update_in_forward.py), and six steps carry it on."""
    mesh = MESHES[mesh_name]()
    settings = (*ON_HOST, f"train.grad_accum={grad_accum}")
    after = twenty_steps(small_recipe(*settings), mesh, steps=6)
    deferred = twenty_steps(small_recipe(*settings, *DEFERRED), mesh, steps=6)
    assert min(after[2]) > 0.5, "clipping must be active for the test to cover it"
    assert deferred[3] == after[3]
    assert deferred[2][:3] == after[2][:3]   # measured: the first 4 (one device), all 6 (fsdp8)
    np.testing.assert_allclose(deferred[2], after[2], rtol=1e-6)   # measured: 1.6e-7 apart at most
    assert largest_difference(after[0], deferred[0]) < PARAMS_APART
    assert largest_difference(after[1], deferred[1]) < STATE_APART


@pytest.mark.slow  # three short runs: about a minute and a half on 2 cores
def test_a_run_stopped_and_resumed_equals_the_uninterrupted_run(data_cache, tmp_path):
    """Checkpoints and validation flush the pending mean gradient first, and a resume starts with nothing
    pending: a run stopped after step 4 and resumed logs the losses and ends with the weights of the
    uninterrupted one bit for bit (the flush runs the step's own hook, docs/DESIGN.md section 6), and the
    uninterrupted one those of the run with the update after the backward pass."""
    settings = (*ON_HOST, "train.grad_accum=2", *DEFERRED)
    straight = train(micro(data_cache, tmp_path / "straight", *settings), progress=False)
    first = train(micro(data_cache, tmp_path / "resumed", *settings), progress=False, stop_after=4)
    second = train(micro(data_cache, tmp_path / "resumed", *settings), progress=False)
    assert (first.final_step, second.final_step) == (4, 6)
    resumed = {**losses(first), **losses(second)}
    assert sorted(resumed) == sorted(losses(straight))
    assert resumed == losses(straight)
    assert largest_difference(straight.model, second.model) == 0
    # The uninterrupted run logs the losses of the update after the backward pass bit for bit (measured).
    after = train(micro(data_cache, tmp_path / "after", *ON_HOST, "train.grad_accum=2"), progress=False)
    assert losses(straight) == losses(after)


def test_pending_gradients_in_host_memory_with_micro_batches_are_one_config_error():
    """The running sum lives in HBM: the host placement is refused before anything compiles, naming both
    settings and the way out."""
    with pytest.raises(ConfigError, match=r"offload.update=next_forward with train.grad_accum=2 .* "
                                          r"offload.pending_gradients=host .* set offload.pending_gradients=device, "
                                          r"or train.grad_accum=1") as raised:
        small_recipe(*ON_HOST, "train.grad_accum=2", "offload.update=next_forward")
    assert "\n" not in str(raised.value)


@pytest.mark.slow   # two setups and their compiles: about a minute on 2 loaded cores
def test_six_bfloat16_steps_with_float32_masters_equal_the_update_after_backward_bit_for_bit():
    """bfloat16 weights with float32 masters on the 8-device FSDP mesh, 2 micro-batches: norms, weights,
    moments and masters equal bit for bit to the update after the backward pass (measured; the float32 steps
    above, whose update reads the old weight instead of a master, differ in the last bits)."""
    mesh = MESHES["fsdp8"]()
    settings = (*ON_HOST, "train.grad_accum=2", *WEIGHTS["bfloat16_master"])
    after = twenty_steps(small_recipe(*settings), mesh, steps=6)
    deferred = twenty_steps(small_recipe(*settings, *DEFERRED), mesh, steps=6)
    assert deferred[2] == after[2] and deferred[3] == after[3]
    assert largest_difference(after[0], deferred[0]) == 0 and largest_difference(after[1], deferred[1]) == 0
