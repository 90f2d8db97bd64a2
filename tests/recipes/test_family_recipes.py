"""Recipes of the Mistral, Qwen2.5 and Qwen3 families: the GPU ones build and plan (the CPU ones train in
test_cpu_recipes.py).

* The GPU recipes build abstractly with the published architecture at their
  pretraining sequence length (8192; Qwen 4096), flash attention and bf16.
* A deviceless H200 compile of a small scanned model of each family keeps
  offloaded activations in host memory (S(5) buffers, host temp bytes), the
  ground truth that the offload was not dropped (docs/DESIGN.md section 3).
  Skipped only where the CUDA toolkit's ptxas/libdevice is missing.
"""

import dataclasses

import pytest
from flax import nnx

from spillway.models.decoder import count_params
from spillway.models.registry import get_family
from spillway.recipes.plan import planner, plugin
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.registry import get_recipe

needs_toolchain = pytest.mark.skipif(plugin.cuda_toolkit_missing_reason() is not None,
                                     reason=f"no CUDA toolkit: {plugin.cuda_toolkit_missing_reason()}")

CPU_RECIPES = ("mistral_tiny", "qwen2_tiny", "qwen3_tiny")
GPU_RECIPES = {"mistral_7b": "mistral_7b_v0_3", "mistral_7b_v0_1": "mistral_7b_v0_1",
               "qwen2_5_1_5b": "qwen2_5_1_5b", "qwen3_0_6b": "qwen3_0_6b", "qwen3_8b": "qwen3_8b"}


# In `make test-slow`, 25-40 s each on 2 cores: these families compile through the code Llama's do, which
# `make test` runs (tests/recipes/plan/test_aot.py).
ALL_SLOW = [pytest.param(name, marks=pytest.mark.slow) for name in CPU_RECIPES]


@pytest.mark.parametrize("name", sorted(GPU_RECIPES))
def test_gpu_recipes_build_the_published_architecture(name):
    recipe = get_recipe(name)
    family = get_family(recipe.family)
    preset = family.presets[GPU_RECIPES[name]]
    # Qwen's main pretraining stage is 4096 tokens long, Mistral trains at 8192 (tests/recipes/test_gpu_recipes.py)
    assert recipe.data.seq_len == (4096 if recipe.family.startswith("qwen") else 8192)
    assert recipe.model == dataclasses.replace(preset, max_seq_len=recipe.data.seq_len)
    assert (recipe.execution.attention_impl, recipe.execution.param_dtype) == ("cudnn", "bfloat16")
    assert count_params(lambda: recipe.build_model(nnx.Rngs(0))) == preset.num_params()


# A small scanned model of each family (tens of MB of activations): compiles in seconds for an H200.
SMALL = ["model.num_layers=4", "model.d_model=256", "model.num_heads=4", "model.num_kv_heads=2",
         "model.mlp_hidden=1024", "model.vocab_size=1024", "model.max_seq_len=512", "data.seq_len=512",
         "execution.dtype=bfloat16", "execution.param_dtype=bfloat16", "execution.attention_impl=flash",
         "execution.flash_block_size=128", "train.global_batch=4"]
SMALL_EXTRA = {"mistral_tiny": ["model.sliding_window=192"], "qwen2_tiny": [], "qwen3_tiny": ["model.head_dim=96"]}


@needs_toolchain
@pytest.mark.parametrize("name", ALL_SLOW)
def test_deviceless_h200_compile_keeps_offloaded_activations_in_host_memory(name):
    reason = plugin.plugin_missing_reason()
    if reason is not None:
        pytest.fail(f"deviceless GPU compile tests need the compiler plugin: {reason}")
    recipe = get_recipe(name, SMALL + SMALL_EXTRA[name])
    result = planner.plan(recipe, "h200", 1, workers=1, plans=[
        Candidate.of("save_all", "device"), Candidate.of("offload_dots", "device")])
    save, offload = result.rows
    for row in result.rows:
        assert row.error is None, row.error
        assert row.report["device_kind"] == "NVIDIA H200 141GB HBM3e"
    assert save.report["host_bytes"] == 0 and save.report["host_buffer_count"] == 0
    r = offload.report
    assert r["host_buffer_count"] > 0 and r["host_temp_bytes"] > 0, "XLA dropped the offload"
    assert r["device_to_host_bytes"] > 0 and r["host_to_device_bytes"] > 0
    assert r["hbm_bytes"] < save.report["hbm_bytes"]
