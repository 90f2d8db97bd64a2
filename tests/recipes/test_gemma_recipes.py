"""The Gemma recipes: the GPU ones build the published architecture (the CPU ones, `gemma3_tiny` with 8 layers,
five local and one global, then two more local, and `gemma2_tiny`, train in test_cpu_recipes.py).

* The GPU recipes build abstractly with the published architecture at their
  pretraining sequence length (Gemma 2: 8192; Gemma 3: 32768), the blockwise
  JAX attention (cuDNN has no soft-cap and no per-layer window) and bf16.
"""

import dataclasses

import pytest
from flax import nnx

from spillway.layers.errors import ConfigError
from spillway.models.decoder import count_params
from spillway.models.registry import get_family
from spillway.recipes.registry import get_recipe

GPU_RECIPES = {"gemma2_2b": ("gemma2_2b", 8192), "gemma3_1b": ("gemma3_1b", 32768),
               "gemma3_12b": ("gemma3_12b", 32768)}


@pytest.mark.parametrize("name", sorted(GPU_RECIPES))
def test_gpu_recipes_build_the_published_architecture(name):
    recipe = get_recipe(name)
    preset, seq_len = GPU_RECIPES[name]
    family = get_family(recipe.family)
    assert recipe.data.seq_len == seq_len
    assert recipe.model == dataclasses.replace(family.presets[preset], max_seq_len=recipe.model.max_seq_len)
    assert recipe.model.max_seq_len >= seq_len
    assert (recipe.execution.attention_impl, recipe.execution.param_dtype) == ("flash", "bfloat16")
    assert count_params(lambda: recipe.build_model(nnx.Rngs(0))) == family.presets[preset].num_params()


def test_cudnn_attention_on_a_gemma_recipe_is_one_config_error_before_anything_runs():
    with pytest.raises(ConfigError, match="no logit soft-capping"):
        get_recipe("gemma2_2b", ["execution.attention_impl=cudnn"])
    with pytest.raises(ConfigError, match="attention_impl='cudnn' takes one static window"):
        get_recipe("gemma3_1b", ["execution.attention_impl=cudnn"])
