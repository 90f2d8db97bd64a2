"""offload.update=next_forward: the host state's update deferred into the next forward pass trains exactly as
the update after the backward pass, and the train loop settles it before anything reads the weights.

CPU lowers memory-kind moves to no-ops, so these tests prove the maths and the loop; the compiled
schedule on a GPU target (state bytes moving in the forward pass, both link directions at once, the
gradients out of HBM) is checked in tests/recipes/plan/test_host_params_aot.py.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from spillway.layers.errors import ConfigError
from spillway.layers.mesh import MeshConfig
from spillway.layers.sharding import make_mesh
from spillway.recipes.train import step as step_lib
from spillway.recipes.train.batch import Batch
from spillway.recipes.train.loop import train
from tests.recipes.train.host_training import batches, small_recipe
from tests.recipes.train.test_train import data_cache, losses, micro  # noqa: F401 (data_cache: a fixture)

ON_HOST = ("offload.optimizer_state=host", "train.grad_accum=1")
IN_FORWARD = "offload.update=next_forward"
PENDING_IN_HBM = "offload.pending_gradients=device"
MESHES = {"one_device": lambda: make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1]),
          "fsdp8": lambda: make_mesh(MeshConfig(1, 8, 1))}
# float32 weights (no master copy: the update reads the old weight) and bfloat16 ones with a float32
# master (the new weight is the master's rounding; the old one is never read).
WEIGHTS = {"float32": (), "bfloat16_master": ("execution.param_dtype=bfloat16",)}


def largest_difference(a_tree, b_tree) -> float:
    """The largest absolute difference between two trees' leaves (0 if they are equal)."""
    return max(float(np.max(np.abs(a - b), initial=0))
               for a, b in zip(jax.tree.leaves(a_tree), jax.tree.leaves(b_tree), strict=True))


def flush_beside_next_step(s):
    """Two steps, then from the same state both ways of applying the pending update: the flush before a
    checkpoint (on a copy placed as the original: both programs donate their arguments) and the third step,
    whose forward pass applies it. Returns (flushed (params, state, pending), hooked (params, state, pending,
    metrics), the third batch)."""
    params, opt_state = s.params, s.optimizer.init(s.params)
    pending = s.nothing_pending(params)
    tokens = batches(s.recipe)[:3]
    for t in tokens[:2]:
        params, opt_state, pending, _ = s.train_step(params, opt_state, pending,
                                                     Batch(tokens=jax.device_put(t, s.batch_sharding)))
    copy = jax.tree.map(lambda a: jax.device_put(np.asarray(a), a.sharding), (params, opt_state, pending))
    flushed = s.flush(*copy)
    batch = Batch(tokens=jax.device_put(tokens[2], s.batch_sharding))
    return flushed, s.train_step(params, opt_state, pending, batch), batch


def assert_same_weights_and_state(s, flushed, hooked) -> None:
    """The flushed and the hooked weights and saved-form state equal bit for bit, leaf by leaf, after the
    third update (the count 2: the first step had nothing pending)."""
    flushed = jax.tree.map(np.asarray, (flushed[0], s.optimizer.saved_form(flushed[1])))
    hooked = jax.tree.map(np.asarray, (hooked[0], s.optimizer.saved_form(hooked[1])))
    assert int(hooked[1].count) == 2
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(hooked)[0], jax.tree.leaves(flushed), strict=True):
        np.testing.assert_array_equal(b, a, err_msg=jax.tree_util.keystr(path))


def twenty_steps(recipe, mesh, steps=None):
    """(params, saved-form optimizer state, grad norms, learning rates) after every batch (the first
    `steps` of them), as NumPy; a deferred update is flushed at the end."""
    s = step_lib.setup(recipe, mesh)
    params, opt_state = s.params, s.optimizer.init(s.params)
    pending = s.nothing_pending(params)
    norms, rates = [], []
    for tokens in batches(recipe)[:steps]:
        batch = Batch(tokens=jax.device_put(tokens, s.batch_sharding))
        params, opt_state, pending, metrics = s.train_step(params, opt_state, pending, batch)
        norms.append(float(metrics["grad_norm"]))
        rates.append(float(metrics["learning_rate"]))
    params, opt_state, pending = s.flush(params, opt_state, pending)
    assert (pending is None) == (not s.defers_update)
    if pending is not None:
        assert not bool(pending.apply)
    as_numpy = lambda tree: jax.tree.map(lambda a: np.asarray(a, np.float32), tree)  # noqa: E731
    return as_numpy(params), as_numpy(s.optimizer.saved_form(opt_state)), norms, rates


# Slow (CI runs them in .venv-jax011's slow step): 30-60 s each on 2 cores, and `make test` must stay
# under 15 minutes; test_a_step_with_nothing_pending... below is the quick check of the step.
@pytest.mark.slow
@pytest.mark.parametrize("mesh_name,weights", [(mesh, weights) for mesh in MESHES for weights in WEIGHTS])
def test_twenty_steps_updated_in_the_next_forward_equal_the_update_after_backward(mesh_name, weights):
    mesh = MESHES[mesh_name]()
    after = twenty_steps(small_recipe(*ON_HOST, *WEIGHTS[weights]), mesh)
    deferred = twenty_steps(small_recipe(*ON_HOST, *WEIGHTS[weights], IN_FORWARD), mesh)
    assert min(after[2]) > 0.5, "clipping must be active for the test to cover it"
    np.testing.assert_allclose(deferred[3], after[3], rtol=1e-7)
    # The same sums in another grouping (the stacked gradients' squares add up layer by layer in the
    # backward pass), and another fusion of the loss: float32 rounding, no more. With bfloat16 weights
    # a rounding flip in a weight moves the next gradients by ~1e-3 (bfloat16's precision), and twenty
    # steps at learning rate 1e-2 carry it on (measured: norms equal to 1e-6 for three steps, then
    # apart by up to 3e-3): there the first steps must agree exactly, the rest as bfloat16 does.
    if weights == "float32":
        np.testing.assert_allclose(deferred[2], after[2], rtol=1e-5)
        params_tol, state_tol = dict(rtol=1e-4, atol=1e-5), dict(rtol=1e-4, atol=1e-6)
    else:
        np.testing.assert_allclose(deferred[2][:3], after[2][:3], rtol=1e-5)
        np.testing.assert_allclose(deferred[2], after[2], rtol=1e-2)
        params_tol, state_tol = dict(rtol=2e-2, atol=2e-3), dict(rtol=2e-2, atol=2e-3)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(after[0])[0], jax.tree.leaves(deferred[0])):
        np.testing.assert_allclose(b, a, err_msg=jax.tree_util.keystr(path), **params_tol)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(after[1])[0], jax.tree.leaves(deferred[1])):
        np.testing.assert_allclose(b, a, err_msg=jax.tree_util.keystr(path), **state_tol)


@pytest.mark.slow   # two setups and their compiles: 45 s on 2 loaded cores
def test_the_update_written_in_place_in_the_next_forward_trains_as_the_state_on_device():
    """Six float32 steps, host state updated in the next forward pass (each layer's new state written over
    its old row) against the state on device updated after the backward pass. Not bit for bit: the
    deferred step is another program (the layers run through a custom VJP, the gradients' squares are
    summed layer by layer in the backward pass), whose gradients round apart in the last bits (measured:
    the embedding 4.8e-7 apart after six steps, the norms within 1.4e-6); float32 rounding, no more."""
    mesh = MESHES["one_device"]()
    on_device = twenty_steps(small_recipe("offload.optimizer_state=device", "train.grad_accum=1"), mesh, steps=6)
    in_forward = twenty_steps(small_recipe(*ON_HOST, IN_FORWARD), mesh, steps=6)
    np.testing.assert_allclose(in_forward[2], on_device[2], rtol=1e-5)
    for tree, tolerance in ((0, dict(rtol=1e-4, atol=1e-5)), (1, dict(rtol=1e-4, atol=1e-6))):
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(on_device[tree])[0],
                                jax.tree.leaves(in_forward[tree])):
            np.testing.assert_allclose(b, a, err_msg=jax.tree_util.keystr(path), **tolerance)


def test_the_deferred_step_takes_the_state_over():
    """Donated: the step's new state and new pending gradients are the old ones' memory (on a GPU target the
    compiled step aliases all its host bytes: tests/recipes/train/test_host_memory_aot.py)."""
    s = step_lib.setup(small_recipe(*ON_HOST, IN_FORWARD), MESHES["one_device"]())
    params, opt_state = s.params, s.optimizer.init(s.params)
    pending = s.nothing_pending(params)
    batch = Batch(tokens=jax.device_put(batches(s.recipe)[0], s.batch_sharding))
    s.train_step(params, opt_state, pending, batch)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves((opt_state.mu, opt_state.nu)))
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(pending.grads))


def test_a_step_with_nothing_pending_changes_nothing_but_makes_the_gradients():
    s = step_lib.setup(small_recipe(*ON_HOST, IN_FORWARD), MESHES["one_device"]())
    params, opt_state = s.params, s.optimizer.init(s.params)
    before = jax.tree.map(np.asarray, (params, s.optimizer.saved_form(opt_state)))
    batch = Batch(tokens=jax.device_put(batches(s.recipe)[0], s.batch_sharding))
    new_params, new_state, pending, metrics = s.train_step(params, opt_state, s.nothing_pending(params), batch)
    after = jax.tree.map(np.asarray, (new_params, s.optimizer.saved_form(new_state)))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)
    assert bool(pending.apply) and float(metrics["grad_norm"]) > 0
    np.testing.assert_allclose(float(pending.grad_norm), float(metrics["grad_norm"]))
    # The stacked leaves' pending gradients wait in host memory; the rest on device.
    kinds = {jax.tree_util.keystr(path): leaf.sharding.memory_kind
             for path, leaf in jax.tree_util.tree_flatten_with_path(pending.grads)[0]}
    assert {kind for path, kind in kinds.items() if "blocks" in path} == {"pinned_host"}, kinds
    assert {kind for path, kind in kinds.items() if "blocks" not in path} == {"device"}, kinds


def test_the_flush_applies_the_pending_update_as_the_next_steps_hook_does_bit_for_bit():
    """A checkpoint flushes the pending update; the uninterrupted run applies it in the next step's forward
    pass. Both must give the same weights and state, bit for bit, or a resumed run drifts from the run it
    resumes (the slow resume tests below run the whole loop; this one the two programs, from the same
    state after two steps, so that the learning rate is not 0). On one device the flush used to be an ulp
    off in up to a fifth of a stacked leaf's elements (docs/DESIGN.md section 6)."""
    s = step_lib.setup(small_recipe(*ON_HOST, IN_FORWARD), MESHES["one_device"]())
    flushed, hooked, _ = flush_beside_next_step(s)
    assert_same_weights_and_state(s, flushed, hooked)


def test_pinned_host_bytes_count_the_state_and_the_pending_gradients_once():
    """The state and the pending gradients are donated and written in place
    (tests/recipes/train/test_host_memory_aot.py reads both from the compiled step)."""
    mesh = MESHES["one_device"]()
    after = step_lib.pinned_host_bytes(small_recipe(*ON_HOST), mesh)
    deferred = step_lib.pinned_host_bytes(small_recipe(*ON_HOST, IN_FORWARD), mesh)
    _, state = step_lib.abstract_model(small_recipe())
    stacked = sum(leaf.size * leaf.dtype.itemsize for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
                  if "blocks" in jax.tree_util.keystr(path))
    assert deferred.optimizer_state == after.optimizer_state > 0
    assert deferred.gradients == stacked and deferred.weights == after.weights == 0


@pytest.mark.parametrize("settings,message", [
    (("offload.optimizer_state=device",), r"offload.update=next_forward .* needs offload.optimizer_state=host"),
    (("offload.optimizer_state=host", "offload.params=host"), r"needs offload.optimizer_state=host \(or a split host:N with N >= 1\) and "
                                                              r"offload.params=device"),
    ((*ON_HOST, "offload.activations=save_dots:1,recompute_all"), r"one activation policy .* has 2 segments"),
    (("offload.optimizer_state=host", "train.grad_accum=2"), r"with train.grad_accum=2 .* set "
                                                             r"offload.pending_gradients=device, or train.grad_accum=1"),
    ((*ON_HOST, "optimizer.update_on_host=true"), r"optimizer.update_on_host=true runs it on the host CPU"),
    ((*ON_HOST, "offload.update=later"), r"offload.update must be one of \('after_backward', 'next_forward'\)"),
    ((*ON_HOST, "offload.pending_gradients=hbm"), r"offload.pending_gradients must be one of \('host', 'device'\), "
                                                  r"got 'hbm'"),
    ((*ON_HOST, "offload.update=after_backward", PENDING_IN_HBM),
     r"offload.pending_gradients=device .* but offload.update=after_backward leaves none pending: set "
     r"offload.update=next_forward, or offload.pending_gradients=host"),
])
def test_what_next_forward_cannot_do_is_one_config_error(settings, message):
    overrides = [*settings] + ([] if any(s.startswith("offload.update=") for s in settings) else [IN_FORWARD])
    with pytest.raises(ConfigError, match=message) as raised:
        small_recipe(*overrides)
    assert "\n" not in str(raised.value)


def test_next_forward_on_blocks_in_several_stacks_is_one_config_error_and_no_plan_candidate():
    """A new user's finding: Qwen3-MoE with a dense layer among its sparse ones (three runs of layers) with
    offload.update=next_forward prepared the data, made the run folder and failed at the first step naming its
    stacked leaves' layer counts; `spillway plan` compiled every next_forward candidate of it to that failure."""
    from spillway.recipes.plan.candidates import candidates
    from spillway.recipes.registry import get_recipe

    with pytest.raises(ConfigError, match=r"offload.update=next_forward needs the block layers in one stack .*; "
                                          r"this model has 3 runs of layers: use offload.update=after_backward"):
        get_recipe("qwen3_moe_tiny", ["offload.optimizer_state=host", IN_FORWARD])
    assert not [c for c in candidates(get_recipe("qwen3_moe_tiny")) if c.update == "next_forward"]
    assert [c for c in candidates(get_recipe("mixtral_tiny")) if c.update == "next_forward"]   # one stack


@pytest.mark.slow  # in `make test-slow` (CI runs it): a minute on 2 cores
def test_a_run_stopped_and_resumed_equals_the_uninterrupted_run(data_cache, tmp_path):
    """Checkpoints and validation settle the pending update first, so what is saved and evaluated is
    what a run without deferral saves; a resumed run starts with nothing pending."""
    settings = (*ON_HOST, IN_FORWARD)
    straight = train(micro(data_cache, tmp_path / "straight", *settings), progress=False)
    first = train(micro(data_cache, tmp_path / "resumed", *settings), progress=False, stop_after=4)
    second = train(micro(data_cache, tmp_path / "resumed", *settings), progress=False)
    assert (first.final_step, second.final_step) == (4, 6)
    assert {**losses(first), **losses(second)} == losses(straight)
    for a, b in zip(jax.tree.leaves(straight.model), jax.tree.leaves(second.model)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # ...and the same run as with the update after the backward pass, to float32 rounding.
    after = train(micro(data_cache, tmp_path / "after", *ON_HOST), progress=False)
    np.testing.assert_allclose([losses(straight)[k] for k in sorted(losses(after))],
                               [losses(after)[k] for k in sorted(losses(after))], rtol=1e-5)


def _memory_kinds(pending):
    """{path: memory kind} of a PendingUpdate's gradients."""
    return {jax.tree_util.keystr(path): leaf.sharding.memory_kind
            for path, leaf in jax.tree_util.tree_flatten_with_path(pending.grads)[0]}


def test_pending_gradients_in_hbm_are_placed_there_and_pin_no_host_memory():
    """offload.pending_gradients=device, nothing compiled but the empty PendingUpdate: every pending gradient,
    the stacked blocks' too, carries memory kind "device"; the host-memory models count the state and no
    pending gradients (Gp = 0), where the host placement counts one copy of the stacked weights' bytes."""
    from spillway.recipes.train.host_memory import phases_of_recipe

    recipe = small_recipe(*ON_HOST, IN_FORWARD, PENDING_IN_HBM)
    s = step_lib.setup(recipe, MESHES["one_device"]())
    kinds = _memory_kinds(s.nothing_pending(s.params))
    assert set(kinds.values()) == {"device"} and any("blocks" in path for path in kinds), kinds
    in_hbm = step_lib.pinned_bytes_of_setup(s)
    on_host = step_lib.pinned_host_bytes(small_recipe(*ON_HOST, IN_FORWARD), MESHES["one_device"]())
    assert in_hbm.gradients == 0 < on_host.gradients
    assert in_hbm.optimizer_state == on_host.optimizer_state > 0
    assert phases_of_recipe(recipe).pending == 0
    assert phases_of_recipe(small_recipe(*ON_HOST, IN_FORWARD)).pending == on_host.gradients


@pytest.mark.slow   # a compile of its own: 15 s on 2 loaded cores; the quick check is the test above
def test_pending_gradients_in_hbm_are_made_there_and_donated():
    """offload.pending_gradients=device: the step makes every pending gradient, the stacked blocks' too, with
    memory kind "device" and donates the old ones; a step with nothing pending changes nothing. (The
    numbers against the host placement: the test below.)"""
    s = step_lib.setup(small_recipe(*ON_HOST, IN_FORWARD, PENDING_IN_HBM), MESHES["one_device"]())
    params, opt_state = s.params, s.optimizer.init(s.params)
    before = jax.tree.map(np.asarray, (params, s.optimizer.saved_form(opt_state)))
    pending = s.nothing_pending(params)
    assert set(_memory_kinds(pending).values()) == {"device"}, _memory_kinds(pending)
    batch = Batch(tokens=jax.device_put(batches(s.recipe)[0], s.batch_sharding))
    new_params, new_state, new_pending, metrics = s.train_step(params, opt_state, pending, batch)
    kinds = _memory_kinds(new_pending)
    assert set(kinds.values()) == {"device"} and any("blocks" in path for path in kinds), kinds
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(pending.grads))
    after = jax.tree.map(np.asarray, (new_params, s.optimizer.saved_form(new_state)))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)
    assert bool(new_pending.apply) and float(metrics["grad_norm"]) > 0
    # The state stays in host memory; the gradients pin nothing there.
    assert step_lib.pinned_bytes_of_setup(s).gradients == 0 < step_lib.pinned_bytes_of_setup(s).optimizer_state


@pytest.mark.slow   # three setups and their compiles: about a minute on 2 loaded cores
@pytest.mark.parametrize("mesh_name,weights", [("one_device", "float32"), ("fsdp8", "bfloat16_master")])
def test_pending_gradients_in_hbm_train_bit_for_bit_as_in_host_memory(mesh_name, weights):
    """Six steps with the pending gradients in HBM against in host memory: the same program but for the
    memory kinds, which CPU lowers to no-ops, so equal bit for bit; and against the update after the backward
    pass, to the float32 rounding the deferred step differs by (the twenty-step test above says why)."""
    mesh, settings = MESHES[mesh_name](), (*ON_HOST, *WEIGHTS[weights])
    in_host_memory = twenty_steps(small_recipe(*settings, IN_FORWARD), mesh, steps=6)
    in_hbm = twenty_steps(small_recipe(*settings, IN_FORWARD, PENDING_IN_HBM), mesh, steps=6)
    after = twenty_steps(small_recipe(*settings), mesh, steps=6)
    assert in_hbm[2] == in_host_memory[2] and in_hbm[3] == in_host_memory[3]
    for tree in (0, 1):
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(in_host_memory[tree])[0],
                                jax.tree.leaves(in_hbm[tree]), strict=True):
            np.testing.assert_array_equal(b, a, err_msg=jax.tree_util.keystr(path))
    np.testing.assert_allclose(in_hbm[2][:3], after[2][:3], rtol=1e-5)
    tolerance = dict(rtol=1e-4, atol=1e-5) if weights == "float32" else dict(rtol=2e-2, atol=2e-3)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(after[0])[0], jax.tree.leaves(in_hbm[0])):
        np.testing.assert_allclose(b, a, err_msg=jax.tree_util.keystr(path), **tolerance)


@pytest.mark.slow  # three short runs: about a minute on 2 cores
def test_a_run_with_pending_gradients_in_hbm_stopped_and_resumed_equals_the_run_with_them_on_host(data_cache,
                                                                                                tmp_path):
    """Checkpoints flush the pending update wherever its gradients wait, and a resume starts with nothing
    pending in HBM: a run stopped after step 4 and resumed has the losses and the weights of the
    uninterrupted run with the pending gradients in host memory, bit for bit (the flush runs the step's
    own hook; six steps in HBM and in host memory are equal bit for bit:
    test_pending_gradients_in_hbm_train_bit_for_bit...)."""
    on_host = train(micro(data_cache, tmp_path / "on_host", *ON_HOST, IN_FORWARD), progress=False)
    settings = (*ON_HOST, IN_FORWARD, PENDING_IN_HBM)
    first = train(micro(data_cache, tmp_path / "in_hbm", *settings), progress=False, stop_after=4)
    second = train(micro(data_cache, tmp_path / "in_hbm", *settings), progress=False)
    assert (first.final_step, second.final_step) == (4, 6)
    assert {**losses(first), **losses(second)} == losses(on_host)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(on_host.model)[0], jax.tree.leaves(second.model),
                            strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=jax.tree_util.keystr(path))
