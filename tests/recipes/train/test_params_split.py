"""offload.params=host:N (the last N block layers' weights in host memory, the first L - N in HBM, the state
split at the same layer) trains bit for bit as everything on device does over 20 float32 steps, and a
checkpoint resumes exactly under another split of the weights.

Why it holds: the gradients are those of the weights on device bit for bit, the update is elementwise, and the
clipping norm sums a stacked leaf layer by layer whichever part holds each layer
(recipes/optim/optimizer.leaf_squared_norm). On the 8-device FSDP mesh a micro-batch the mesh does not divide is
replicated, and the host part's weights then change how the partitioner shards the blocks' activations (other
all-reduces of the norms' sums over d_model): there the micro-batches are 8 rows, one per device, as the planner
requires.

CPU lowers memory-kind moves to no-ops, so these prove the maths and the placement (each part's memory kind,
the stack's scans cut at the split, the saved form, the restore); the HBM saving is for a GPU compile to show.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from spillway.layers.errors import ConfigError
from spillway.layers.host_weights import ResidentSplit
from spillway.layers.mesh import MeshConfig
from spillway.layers.sharding import make_mesh
from spillway.recipes.optim import param_placement as placement
from spillway.recipes.train import step as step_lib
from spillway.recipes.train.batch import Batch
from tests.recipes.train.host_training import LAYERS, batches, small_recipe, train_steps
from tests.recipes.train.test_state_split import assert_trees_equal, one_device


def split_settings(count: int, *extra) -> tuple[str, ...]:
    return (f"offload.params=host:{count}", f"offload.optimizer_state=host:{count}", *extra)


def weight_parts(params):
    """(device part memory kinds, host part memory kinds, host layers) over the split weights."""
    splits = [x for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, ResidentSplit))
              if isinstance(x, ResidentSplit)]
    return ({x.device.sharding.memory_kind for x in splits}, {x.host.sharding.memory_kind for x in splits},
            {x.host.shape[0] for x in splits})


def gradients_and_norm(recipe):
    """The gradients of one batch (joined where split) and their global norm as the optimizer's clipping reads it."""
    s = step_lib.setup(recipe, one_device())
    objective = step_lib.make_objective(s.graphdef, recipe.train.loss_chunk, s.mesh, recipe.aux_loss)
    batch = Batch(jax.device_put(batches(recipe)[1], s.batch_sharding))
    grads = jax.jit(lambda p, b: jax.grad(lambda p: objective(p, b)[0])(p))(s.params, batch)
    norm = jax.jit(s.optimizer.grad_norm)(grads)
    return jax.tree.map(np.asarray, placement.saved_params(grads)), float(norm), grads


def test_the_gradients_of_split_weights_and_their_norm_are_those_on_device_bit_for_bit():
    """The cheap case of the 20 steps below: one batch's gradients, each part where its weights live, and the
    clipping norm, which sums each layer where it lies and adds the layers in one order."""
    on_device, device_norm, _ = gradients_and_norm(small_recipe("train.grad_accum=1"))
    on_split, split_norm, grads = gradients_and_norm(small_recipe("train.grad_accum=1", *split_settings(1)))
    assert_trees_equal(on_split, on_device)
    assert weight_parts(grads) == ({"device"}, {"pinned_host"}, {1})   # the host rows' gradient left HBM
    assert split_norm == device_norm


def fsdp8():
    return make_mesh(MeshConfig(1, 8, 1))


# 20 steps: 25-55 s each on 2 cores, so `make test-slow` (CI runs it); the gradients above in `make test`.
@pytest.mark.slow
@pytest.mark.parametrize("count,extra,mesh", [
    (1, (), one_device),                              # grad_accum 2: the host rows' running sums in the backward
    (2, ("train.grad_accum=1",), one_device),
    (2, ("optimizer.update_on_host=true",), one_device),
    # Micro-batches of 8 rows, one per device (module docstring); the larger batch's norms are smaller.
    (1, ("train.global_batch=16", "optimizer.clip_norm=0.4"), fsdp8),
])
def test_twenty_steps_with_split_weights_equal_everything_on_device_bit_for_bit(count, extra, mesh):
    # The host CPU's update needs host state: its reference is the state all on host (equal to the state on
    # device: tests/recipes/train/test_host_params.py).
    reference = ("offload.optimizer_state=host",) if "optimizer.update_on_host=true" in extra else ()
    on_device, device_norms, _, _, _ = train_steps(small_recipe(*reference, *extra), mesh())
    on_split, split_norms, _, params, opt_state = train_steps(small_recipe(*split_settings(count, *extra)), mesh())
    assert min(device_norms) > small_recipe(*reference, *extra).optimizer.clip_norm, "clipping must be active for the test to cover it"
    assert weight_parts(params) == ({"device"}, {"pinned_host"}, {count})
    assert split_norms == device_norms
    assert_trees_equal(jax.tree.map(np.asarray, placement.saved_params(params)), on_device)


@pytest.mark.parametrize("settings,message", [
    ((f"offload.params=host:{LAYERS + 1}", "offload.optimizer_state=host"), f"offload.params=host:{LAYERS + 1}: the model has {LAYERS} block layers; a split "
                                 f"may put 0 to {LAYERS} of them on host"),
    (("offload.params=host:-1", "offload.optimizer_state=host"),
     "offload.params='host:-1': a split must be .*; a layer count cannot be negative"),
    (("offload.params=host:1.5", "offload.optimizer_state=host"),
     "offload.params='host:1.5': a split must be .*; 1.5 is neither a whole count of layers nor a fraction"),
    (("offload.params=host:most",), "offload.params='host:most': a split must be 'device', 'host', 'experts'"),
    (("offload.params=host:1", "offload.optimizer_state=host"),
     "offload.params=host:1 puts the last 1 of 3 block layers' weights on host; the optimizer state must be "
     "split at the same layer \\(offload.optimizer_state=host:1\\), got offload.optimizer_state=host"),
    (("offload.params=host:1", "offload.optimizer_state=host:1", "offload.update=next_forward",
      "train.grad_accum=1"), "offload.update=next_forward .* needs offload.optimizer_state=host "
                             "\\(or a split host:N with N >= 1\\) and offload.params=device \\(got optimizer_state=host:1, "
                             "params=host:1\\)"),
    # a new user's finding: this said "with the state on device it would need them all in HBM"
    (("offload.params=host", "offload.optimizer_state=host:1"),
     "offload.params=host puts every block layer's weights on host, but offload.optimizer_state=host:1 is a "
     "split; .* split them at the same layer \\(offload.params=host:1\\), or set offload.optimizer_state=host"),
])
def test_a_split_of_the_weights_the_run_cannot_take_is_one_config_error(settings, message):
    with pytest.raises(ConfigError, match=message):
        small_recipe(*settings)


def test_split_weights_join_for_a_checkpoint_and_cut_again_under_another_split_bit_for_bit():
    """The cheap case of the resume below (one setup, nothing trained): what a checkpoint holds of host:1
    weights, cut as a host:2 run keeps them, is the same weights, each part in its memory."""
    s = step_lib.setup(small_recipe(*split_settings(1)), one_device())
    saved = placement.saved_params(s.params)
    assert not placement.any_split(saved) and weight_parts(s.params) == ({"device"}, {"pinned_host"}, {1})
    other = small_recipe(*split_settings(2))
    _, abstract = step_lib.abstract_model(other)
    shardings = placement.placed_shardings(abstract, jax.tree.map(lambda p: p.sharding, saved), other.offload.params)
    cut = placement.params_from_saved(saved, placement.placed_structs(abstract, shardings, other.offload.params))
    assert weight_parts(cut) == ({"device"}, {"pinned_host"}, {2})
    assert_trees_equal(jax.tree.map(np.asarray, placement.saved_params(cut)), jax.tree.map(np.asarray, saved))


# Two setups and four steps: 60-120 s on the loaded 2-core machine, so `make test-slow`.
@pytest.mark.slow
@pytest.mark.parametrize("settings", [
    (split_settings(2),),
    ((("offload.params=device", "offload.optimizer_state=device"),
                  ("offload.params=host", "offload.optimizer_state=host"))),
])
def test_a_checkpoint_resumes_exactly_under_another_split_of_the_weights(tmp_path, settings):
    """Saved with the weights split host:1, restored under host:2 (or all on device, or all on host): the
    checkpoint holds whole leaves (`saved_params`), so the restored weights and state are the saved ones bit
    for bit, each cut where the new run keeps it; two more steps equal the run that never stopped bit for bit."""
    from spillway.recipes.train.checkpoint import RunCheckpointer
    from spillway.recipes.train.host_memory import restore_state

    base = ("train.grad_accum=1",)
    s = step_lib.setup(small_recipe(*split_settings(1, *base)), one_device())
    params, opt_state = s.params, s.optimizer.init(s.params)
    tokens = batches(small_recipe(*base))[:4]
    for t in tokens[:2]:
        params, opt_state, _, _ = s.train_step(params, opt_state, None, Batch(jax.device_put(t, s.batch_sharding)))
    with RunCheckpointer(tmp_path / "run", keep=2, every_steps=1, async_save=False) as ckpt:
        ckpt.save(2, params=placement.saved_params(params), opt_state=opt_state, loader_state={},
                  meta={"step": 2}, recipe_json="{}", force=True)
        resumed = {}
        for setting in settings:
            other = step_lib.setup(small_recipe(*setting, *base), one_device())
            resumed[setting] = (other, *restore_state(ckpt, other, other.params, 2))
    saved_params = jax.tree.map(np.asarray, placement.saved_params(params))
    saved_state = jax.tree.map(np.asarray, s.optimizer.saved_form(opt_state))
    for setting, (other, p, st) in resumed.items():   # the checkpoint itself: exact
        count = 2 if setting == split_settings(2) else None
        assert weight_parts(p) == (({"device"}, {"pinned_host"}, {2}) if count else (set(), set(), set()))
        assert_trees_equal(jax.tree.map(np.asarray, placement.saved_params(p)), saved_params)
        assert_trees_equal(jax.tree.map(np.asarray, other.optimizer.saved_form(st)), saved_state)
    for t in tokens[2:]:
        params, opt_state, _, _ = s.train_step(params, opt_state, None, Batch(jax.device_put(t, s.batch_sharding)))
        for setting, (other, p, st) in resumed.items():
            resumed[setting] = (other, *other.train_step(p, st, None, Batch(jax.device_put(t, other.batch_sharding)))[:2])
    for setting, (other, p, st) in resumed.items():
        assert_trees_equal(jax.tree.map(np.asarray, placement.saved_params(p)),
                           jax.tree.map(np.asarray, placement.saved_params(params)))
        assert_trees_equal(jax.tree.map(np.asarray, other.optimizer.saved_form(st)),
                           jax.tree.map(np.asarray, s.optimizer.saved_form(opt_state)))


@pytest.mark.slow   # two MoE compiles: `make test-slow`
def test_an_experts_split_streams_only_the_last_layers_experts_with_the_gradients_on_device():
    """offload.params=experts:1: the routed experts of the last layer on host (a ResidentSplit), every other
    block weight whole in HBM; one batch's gradients equal everything on device bit for bit."""
    from tests.recipes.train.test_host_experts import moe_recipe
    on_device, device_norm, _ = gradients_and_norm(moe_recipe("train.grad_accum=1"))
    on_split, split_norm, grads = gradients_and_norm(moe_recipe(
        "train.grad_accum=1", "offload.params=experts:1", "offload.optimizer_state=host:1"))
    assert_trees_equal(on_split, on_device)
    assert split_norm == device_norm
    assert weight_parts(grads) == ({"device"}, {"pinned_host"}, {1})
    split_paths = [jax.tree_util.keystr(path) for path, x in jax.tree_util.tree_flatten_with_path(
        grads, is_leaf=lambda x: isinstance(x, ResidentSplit))[0] if isinstance(x, ResidentSplit)]
    assert split_paths and all("expert" in path or "w_" in path for path in split_paths)


def test_the_byte_models_count_only_a_split_weights_host_rows():
    """The planner's cost model (its weights on the link) and the host-memory model (the loop's RAM check and
    the plan's host peak) count the host layers' share of a split weight: host:1 of 3 is a third of host."""
    from spillway.recipes.plan.cost_model import parameter_shards
    from spillway.recipes.train.host_memory import phases_of_recipe
    one_gpu = {"data": 1, "fsdp": 1, "tensor": 1}
    host_bytes = {}
    for setting, state in (("host", "host"), ("host:1", "host:1"), ("device", "host:1")):
        recipe = small_recipe(f"offload.params={setting}", f"offload.optimizer_state={state}")
        host_bytes[setting] = (sum(leaf.nbytes for leaf in parameter_shards(recipe, one_gpu, setting) if leaf.on_host),
                               phases_of_recipe(recipe).weights)
    assert host_bytes["host"][0] == host_bytes["host"][1] > 0 and host_bytes["device"] == (0, 0)
    assert 3 * host_bytes["host:1"][0] == host_bytes["host"][0] and 3 * host_bytes["host:1"][1] == host_bytes["host"][1]


@pytest.mark.slow   # three micro runs of the real loop: `make test-slow`
def test_the_train_loop_saves_split_weights_and_resumes_them_on_device(tmp_path):
    """The loop end to end (its save, validation and resume): 4 steps with the weights and state split
    host:1, resumed with everything on device for the last 2, against 6 steps on device throughout."""
    from spillway.recipes.train.loop import train
    from tests.recipes.train.test_train import losses, micro

    cache = tmp_path / "cache"
    straight = train(micro(cache, tmp_path / "straight"), progress=False)
    first = train(micro(cache, tmp_path / "moved", "offload.params=host:1", "offload.optimizer_state=host:1"),
                  progress=False, stop_after=4)
    second = train(micro(cache, tmp_path / "moved"), progress=False)
    assert second.final_step == 6
    expected, got = losses(straight), {**losses(first), **losses(second)}
    assert sorted(got) == sorted(expected)
    np.testing.assert_allclose([got[k] for k in sorted(got)], [expected[k] for k in sorted(expected)], rtol=1e-5)
