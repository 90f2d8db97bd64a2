"""Recipes of the mixture-of-experts families: the GPU ones build the published models with the dispatch they
chose, and the planner's candidates for an MoE model are plans its blocks can take.

The CPU recipes train in test_cpu_recipes.py, with the training loss as it is (the auxiliary load-balancing loss
is wired into the train step separately, recipes/train/test_aux_losses.py).
"""

import dataclasses

import pytest

from spillway.layers.errors import ConfigError
from spillway.layers.offload import MOE_PRESETS, RematPlan
from spillway.models.registry import get_family
from spillway.recipes.plan import candidates as plan_candidates
from spillway.recipes.registry import get_recipe

GPU_RECIPES = {"mixtral_8x7b": ("mixtral_8x7b", dict(moe_dispatch="capacity", moe_capacity_factor=1.25)),
               "qwen3_30b_a3b": ("qwen3_30b_a3b", dict(moe_grouped_matmul="blocked", moe_block_rows=128))}


def test_the_cpu_qwen3_moe_mixes_dense_and_sparse_runs():
    runs = get_recipe("qwen3_moe_tiny").decoder_spec().stack_runs()
    assert [(run.num_layers, run.block.moe is not None) for run in runs] == [(1, True), (1, False), (2, True)]


@pytest.mark.parametrize("name", sorted(GPU_RECIPES))
def test_gpu_recipes_build_the_published_architecture_with_their_dispatch(name):
    recipe = get_recipe(name)
    preset, dispatch = GPU_RECIPES[name]
    family = get_family(recipe.family)
    assert recipe.data.seq_len == 4096
    assert recipe.model == dataclasses.replace(family.presets[preset], max_seq_len=4096, **dispatch)
    assert recipe.num_params() == family.presets[preset].num_params()
    assert "ragged_dot" in recipe.description   # says why it is not used
    spec = recipe.decoder_spec()
    assert spec.block.moe.dispatch == dispatch.get("moe_dispatch", "dropless")


@pytest.mark.parametrize("name", ["mixtral_8x7b", "qwen3_30b_a3b", "qwen3_moe_tiny"])
def test_the_planner_offers_an_moe_model_the_plans_its_blocks_take(name):
    recipe = get_recipe(name)
    tags = plan_candidates.tagged_names(recipe)
    offered = plan_candidates.candidates(recipe)
    plans = {c.activations for c in offered}
    assert set(MOE_PRESETS) <= plans
    for plan in plans:
        assert RematPlan.parse(plan).names() <= tags, plan
    # An all-MoE model cannot take the dense MLP presets; Qwen3-MoE's dense layer can.
    assert ("save_dots" in plans) == (name == "qwen3_moe_tiny")
    host_compute = {c.activations for c in offered if c.update_on_host}
    assert host_compute == set(plan_candidates.MOE_HOST_COMPUTE_PLANS)


def test_a_dense_model_keeps_its_plans():
    assert plan_candidates.tagged_names(get_recipe("tiny")) is None
    assert plan_candidates.preset_plans(get_recipe("tiny")) == (plan_candidates.PRESET_PLANS,
                                                                plan_candidates.HOST_COMPUTE_PLANS)


def test_dense_layers_are_set_on_the_command_line_and_bad_ones_named():
    assert get_recipe("qwen3_moe_tiny", ["model.mlp_only_layers=0,2"]).model.mlp_only_layers == (0, 2)
    assert get_recipe("qwen3_moe_tiny", ["model.mlp_only_layers=[]"]).model.mlp_only_layers == ()
    recipe = get_recipe("qwen3_moe_tiny", ["model.mlp_only_layers=3"])
    assert type(recipe).from_dict(recipe.to_dict()) == recipe          # a JSON list in recipe.json
    for value, message in (("0,9", r"names layer\(s\) \[9\], outside the model's 4 layers"),
                           ("one", r"model.mlp_only_layers\[0\]: expected an integer")):
        with pytest.raises(ConfigError, match=message) as err:
            get_recipe("qwen3_moe_tiny", [f"model.mlp_only_layers={value}"])
        assert "\n" not in str(err.value)
