"""The Gemma recipes: the CPU ones train (loss falls), the GPU ones build the published architecture.

* `gemma3_tiny` (8 layers: five local and one global, then two more local)
  trains a few steps through the whole train loop on the embedded corpus and
  its loss falls; `gemma2_tiny` too, in the slow step.
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
from spillway.recipes.train.loop import train

GPU_RECIPES = {"gemma2_2b": ("gemma2_2b", 8192), "gemma3_1b": ("gemma3_1b", 32768),
               "gemma3_12b": ("gemma3_12b", 32768)}


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("spillway-cache")


@pytest.mark.parametrize("name", ["gemma3_tiny", pytest.param("gemma2_tiny", marks=pytest.mark.slow)])
def test_cpu_recipe_trains_and_its_loss_falls(name, data_cache, tmp_path):
    recipe = get_recipe(name, [
        "data.source=builtin:stdlib:400000", f"data.cache_dir={data_cache}", "data.seq_len=96", "data.num_proc=1",
        "data.val_fraction=0.1", "model.vocab_size=512", "train.global_batch=8", "train.steps=8",
        "train.log_every=1", "train.eval_every=8", "train.eval_batches=1", "train.sample_tokens=0",
        "optimizer.warmup_steps=2", "optimizer.learning_rate=1e-2", f"checkpoint.dir={tmp_path}",
        "checkpoint.every_steps=8"])
    assert recipe.model.sliding_window < recipe.data.seq_len      # the window shapes the local layers
    assert set(recipe.model.layer_kinds()) == {"L", "G"}
    result = train(recipe, progress=False)
    losses = {row["step"]: row["loss"] for row in result.history if "loss" in row}
    assert sorted(losses) == list(range(1, 9))
    assert losses[8] < losses[1] - 0.5, losses


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
