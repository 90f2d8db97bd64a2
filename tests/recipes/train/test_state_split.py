"""offload.optimizer_state=host:N (the last N block layers' state in host memory, the rest in HBM) trains bit
for bit as the state all on device does, for every split (a count or a fraction, the host CPU's update, the
8-device FSDP mesh), and a checkpoint resumes exactly under another split.

Why it holds: the update is elementwise, the same operations on each element whichever part holds it, and the
clipping norm sums the same gradients (a split of the state leaves the gradients whole). The tests' XLA CPU
runs LLVM at optimisation level 0 (tests/conftest.py), which forms no fused multiply-adds; at the default level
XLA:CPU contracts multiply-adds where its fusions put them, another program fuses them elsewhere, and host:2 is
one ulp off from the first update (docs/DESIGN.md section 6).

CPU lowers memory-kind moves to no-ops, so these prove the maths and the placement (the state's memory
kinds per part, the saved form, the restore); the HBM saving is for a GPU compile to show.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from spillway.layers.errors import ConfigError
from spillway.layers.mesh import MeshConfig
from spillway.layers.sharding import make_mesh
from spillway.recipes.optim.split_state import ResidentSplit
from spillway.recipes.registry import get_recipe
from spillway.recipes.train import step as step_lib
from spillway.recipes.train.batch import Batch
from tests.recipes.train.host_training import LAYERS, batches, small_recipe, train_steps


def one_device():
    return make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1])


def split_parts(opt_state):
    """(device part memory kinds, host part memory kinds, host layers) over the split state leaves."""
    splits = jax.tree.leaves(opt_state.mu, is_leaf=lambda x: isinstance(x, ResidentSplit))
    splits = [x for x in splits if isinstance(x, ResidentSplit)]
    return ({x.device.sharding.memory_kind for x in splits}, {x.host.sharding.memory_kind for x in splits},
            {x.host.shape[0] for x in splits})


def assert_trees_equal(actual, expected):
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


# One split in `make test`; the others (a fraction, the host CPU's update, FSDP) in `make test-slow`.
@pytest.mark.parametrize("split,extra,mesh", [
    ("host:1", (), one_device),
    pytest.param("host:2", (), one_device, marks=pytest.mark.slow),
    pytest.param("host:0.5", (), one_device, marks=pytest.mark.slow),   # round(1.5) = 2 layers on host
    pytest.param("host:1", ("optimizer.update_on_host=true",), one_device, marks=pytest.mark.slow),
    pytest.param("host:2", (), lambda: make_mesh(MeshConfig(1, 8, 1)), marks=pytest.mark.slow),
])
def test_twenty_steps_with_a_split_state_equal_the_state_on_device_bit_for_bit(split, extra, mesh):
    # The reference keeps every layer's state on the device, where the GPU updates it: a host-CPU update
    # (optimizer.update_on_host) is refused there, and is the same maths.
    reference = [setting for setting in extra if not setting.startswith("optimizer.update_on_host")]
    on_device, device_norms, _, _, _ = train_steps(small_recipe(*reference), mesh())
    on_split, split_norms, _, _, opt_state = train_steps(small_recipe(f"offload.optimizer_state={split}", *extra),
                                                        mesh())
    assert min(device_norms) > 0.5, "clipping must be active for the test to cover it"
    assert split_norms == device_norms
    assert_trees_equal(on_split, on_device)
    host_layers = 1 if split == "host:1" else 2
    assert split_parts(opt_state) == ({"device"}, {"pinned_host"}, {host_layers})


@pytest.mark.parametrize("settings,in_pieces", [
    (("host:2",), True),
    pytest.param(("host:2",), False, marks=pytest.mark.slow),
    pytest.param(("device", "host"), True, marks=pytest.mark.slow),
])
def test_a_checkpoint_resumes_exactly_under_another_split(tmp_path, settings, in_pieces):
    """Saved under host:1, restored under host:2 (or device, or all on host): the restored state is the saved
    one bit for bit (the saved form is one whole array per state leaf whatever the split), and two more steps
    equal two more steps of the run that never stopped bit for bit, as the 20 steps above do. The state is
    handed to the save as it lies, as the train loop does: written in pieces (the split's device rows, then
    its host rows, no join) or joined for orbax's whole save."""
    from spillway.recipes.train.checkpoint import RunCheckpointer

    base = ("train.grad_accum=1",)
    s = step_lib.setup(small_recipe("offload.optimizer_state=host:1", *base), one_device())
    params, opt_state = s.params, s.optimizer.init(s.params)
    tokens = batches(small_recipe(*base))[:4]
    for t in tokens[:2]:
        params, opt_state, _, _ = s.train_step(params, opt_state, None, Batch(jax.device_put(t, s.batch_sharding)))
    with RunCheckpointer(tmp_path / "run", keep=2, every_steps=1, async_save=False) as ckpt:
        ckpt.save_in_pieces = in_pieces
        ckpt.save(2, params=params, opt_state=opt_state, loader_state={}, meta={"step": 2},
                  recipe_json="{}", force=True)
        resumed = {}
        for setting in settings:
            other = step_lib.setup(small_recipe(f"offload.optimizer_state={setting}", *base), one_device())
            restored = ckpt.restore(2, abstract_params=step_lib.abstract_with_shardings(params, other.param_shardings),
                                    abstract_opt_state=other.optimizer.saved_abstract_state(params,
                                                                                            other.param_shardings))
            resumed[setting] = (other, restored["params"], other.optimizer.from_saved_form(restored["opt_state"]))
    if "host:2" in resumed:
        assert split_parts(resumed["host:2"][2])[1:] == ({"pinned_host"}, {2})
    saved = jax.tree.map(np.asarray, s.optimizer.saved_form(opt_state))
    for setting, (other, p, st) in resumed.items():   # the checkpoint itself: exact
        assert_trees_equal(jax.tree.map(np.asarray, p), jax.tree.map(np.asarray, params))
        assert_trees_equal(jax.tree.map(np.asarray, other.optimizer.saved_form(st)), saved)
    for t in tokens[2:]:
        params, opt_state, _, _ = s.train_step(params, opt_state, None, Batch(jax.device_put(t, s.batch_sharding)))
        for setting, (other, p, st) in resumed.items():
            placed = Batch(jax.device_put(t, other.batch_sharding))
            resumed[setting] = (other, *other.train_step(p, st, None, placed)[:2])
    for setting, (other, p, st) in resumed.items():
        assert_trees_equal(jax.tree.map(np.asarray, p), jax.tree.map(np.asarray, params))
        assert_trees_equal(jax.tree.map(np.asarray, other.optimizer.saved_form(st)),
                           jax.tree.map(np.asarray, s.optimizer.saved_form(opt_state)))


@pytest.mark.parametrize("setting,message", [
    (f"host:{LAYERS + 1}", f"offload.optimizer_state=host:{LAYERS + 1}: the model has {LAYERS} block layers; "
                           f"a split may put 0 to {LAYERS} of them on host"),
    ("host:-2", "offload.optimizer_state='host:-2': a split must be .*; a layer count cannot be negative"),
    ("host:2.5", "offload.optimizer_state='host:2.5': a split must be .*; 2.5 is neither a whole count of layers "
                 "nor a fraction between 0 and 1"),
    ("host:lots", "offload.optimizer_state='host:lots': a split must be 'device', 'host', 'host:N'"),
    ("host:nan", "offload.optimizer_state='host:nan': a split must be .*; nan is neither a whole count"),
    ("host:inf", "offload.optimizer_state='host:inf': a split must be .*; inf is neither a whole count"),
    ("host:0.0", "offload.optimizer_state='host:0.0': a split must be .*; 0.0 is neither a whole count"),
])
def test_a_split_the_model_cannot_take_is_one_config_error(setting, message):
    with pytest.raises(ConfigError, match=message):
        small_recipe(f"offload.optimizer_state={setting}")


def test_a_split_on_a_model_whose_blocks_are_not_one_stack_is_one_config_error():
    """Qwen3-MoE with a dense first layer: a dense run and a sparse run of layers, two stacks."""
    with pytest.raises(ConfigError, match=r"a split needs the block layers in one stack; this model has 2 runs"):
        get_recipe("qwen3_moe_tiny", ["model.mlp_only_layers=0", "offload.optimizer_state=host:1"])


def test_a_split_on_parameters_without_stacked_leaves_is_one_config_error():
    import jax.numpy as jnp
    from spillway.recipes.optim.config import OptimizerConfig
    from spillway.recipes.optim.layouts import make_layouts
    with pytest.raises(ConfigError, match="a split places block layers, and this model has no stacked block weights"):
        make_layouts({"w": jnp.zeros((4, 4))}, OptimizerConfig(), state_memory="host:1")


def test_the_pinned_bytes_and_the_byte_model_count_only_the_host_layers():
    """A split's pinned state is the host layers' share, in the abstract setup and in the shapes-only model
    the planner and the loop's RAM check read (recipes/train/host_memory.phases_of_recipe); bfloat16
    moments halve it."""
    from spillway.recipes.train.host_memory import phases_of_recipe
    counted = {}
    for setting in ("host:1", "host:2", f"host:{LAYERS}"):
        recipe = small_recipe(f"offload.optimizer_state={setting}")
        counted[setting] = step_lib.pinned_host_bytes(recipe, one_device()).optimizer_state
        assert phases_of_recipe(recipe).state == counted[setting]
    assert counted["host:1"] * LAYERS == counted[f"host:{LAYERS}"] and counted["host:2"] == 2 * counted["host:1"]
    half = small_recipe("offload.optimizer_state=host:1", "optimizer.moment_dtype=bfloat16")
    assert 2 * step_lib.pinned_host_bytes(half, one_device()).optimizer_state == counted["host:1"]


def test_the_runs_first_line_says_how_many_layers_a_split_comes_to():
    """A new user's finding: `host:0.01` put one layer of the tiny recipe's two (half the state) on host, and
    the run's first line said only "optimizer state: host:0.01". A split now names its layers; the weights'
    placement is said where it is not the device."""
    from spillway.recipes.train.run_data import prepare_run_data

    said = []

    class Stop(Exception):
        pass

    def say(line):
        said.append(line)
        raise Stop   # the first line is all this test reads; nothing is prepared
    for settings, expected in (
            (["offload.optimizer_state=host:0.01"], "optimizer state: host:0.01 (the last 1 of 2 block layers)"),
            (["offload.optimizer_state=host:2", "offload.params=host:2"],
             "optimizer state: host:2 (the last 2 of 2 block layers), weights: host:2 (the last 2 of 2 block layers)"),
            (["offload.optimizer_state=host"], "optimizer state: host")):
        recipe = get_recipe("tiny", ["model.num_layers=2", *settings])
        with pytest.raises(Stop):
            prepare_run_data(recipe, None, None, say)
        assert said.pop().endswith(expected)


def test_a_model_export_would_refuse_is_said_where_the_run_starts():
    """A Gemma 2 trained with a query_pre_attn_scalar of 12.5 was refused by `spillway export` only after the
    training (transformers' config holds an int); the run's first lines now say so, and a model export takes
    says nothing."""
    from spillway.recipes.train.run_data import prepare_run_data

    class Stop(Exception):
        pass

    def said_before_data(settings):
        said = []

        def say(line):
            if line.startswith("data:"):
                raise Stop   # the lines before the data are all this test reads
            said.append(line)
        with pytest.raises(Stop):
            prepare_run_data(get_recipe("gemma2_tiny", settings), None, None, say)
        return said
    (warning,) = [line for line in said_before_data(["model.query_pre_attn_scalar=12.5"]) if "warning" in line]
    assert warning.startswith("warning: spillway export will refuse this model")
    assert "model.query_pre_attn_scalar=12.5 is not a whole number" in warning
    assert not any("warning" in line for line in said_before_data(["model.query_pre_attn_scalar=12"]))
