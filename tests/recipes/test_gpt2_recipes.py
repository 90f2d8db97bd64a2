"""The GPT-2 recipes: gpt2_tiny trains on the embedded corpus, gpt2_124m builds at its published size, and a
small scanned GPT-2's train step compiled for an H200 without a GPU keeps offloaded activations in host memory.

The deviceless compile is skipped only where the CUDA toolkit's ptxas/libdevice
is missing; a missing plugin fails with the install command (`make test`
installs it), as in test_planner.py.
"""

import json

import pytest
from flax import nnx

from spillway.models.decoder import count_params
from spillway.recipes.plan import planner, plugin
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.registry import get_recipe
from spillway.recipes.train.loop import train

needs_toolchain = pytest.mark.skipif(plugin.cuda_toolkit_missing_reason() is not None,
                                     reason=f"no CUDA toolkit: {plugin.cuda_toolkit_missing_reason()}")


def test_gpt2_124m_is_the_published_model_at_its_whole_context():
    recipe = get_recipe("gpt2_124m")
    assert recipe.family == "gpt2" and recipe.num_params() == 124_439_808
    assert count_params(lambda: recipe.build_model(nnx.Rngs(0))) == 124_439_808
    assert recipe.data.seq_len == recipe.model.max_seq_len == 1024
    assert recipe.execution.attention_impl == "cudnn" and recipe.execution.param_dtype == "bfloat16"
    with pytest.raises(ValueError, match=r"data.seq_len \(2048\) exceeds model.max_seq_len \(1024\)"):
        get_recipe("gpt2_124m", ["data.seq_len=2048"])
    with pytest.raises(ValueError, match="GPT2Config has no field 'num_kv_heads'"):
        get_recipe("gpt2_124m", ["model.num_kv_heads=4"])


@pytest.mark.slow  # an end-to-end run of 38 s on 2 cores: `make test-slow` (CI: .venv-jax011's slow step), keeping `make test` near 12 minutes
def test_gpt2_tiny_trains_and_the_loss_falls(tmp_path):
    recipe = get_recipe("gpt2_tiny", [
        "data.source=builtin:stdlib:400000", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=32",
        "data.num_proc=1", "model.vocab_size=512", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
        "model.max_seq_len=64", "train.global_batch=8", "train.steps=12", "train.log_every=1",
        "train.eval_every=12", "train.eval_batches=1", "train.sample_tokens=8", "optimizer.warmup_steps=2",
        "optimizer.learning_rate=1e-2", f"checkpoint.dir={tmp_path / 'run'}", "checkpoint.every_steps=12"])
    result = train(recipe, progress=False)
    losses = {row["step"]: row["loss"] for row in result.history if "loss" in row}
    assert sorted(losses) == list(range(1, 13))
    # Measured: 6.25 (about ln 512, a uniform guess) falls to 5.16 by step 12.
    assert losses[12] < losses[1] - 0.7, losses
    (evaluation,) = [row for row in result.history if "val_loss" in row]
    assert evaluation["val_loss"] < losses[1] - 0.7
    saved = json.loads((result.run_dir / "checkpoints" / "12" / "recipe" / "recipe.json").read_text())
    assert saved["family"] == "gpt2" and saved["model"]["num_heads"] == 4


@pytest.mark.slow  # an end-to-end run of 39 s on 2 cores: `make test-slow` (CI: .venv-jax011's slow step), keeping `make test` near 12 minutes
@needs_toolchain
def test_small_gpt2_offload_compiles_to_host_buffers_for_an_h200():
    """The ground truth for offload (S(5) host buffers, host temp bytes, both transfer directions)."""
    reason = plugin.plugin_missing_reason()
    if reason is not None:
        pytest.fail(f"deviceless GPU compile tests need the compiler plugin: {reason}")
    layers, d_model, batch, seq = 4, 256, 4, 512
    recipe = get_recipe("gpt2_124m", [
        f"model.num_layers={layers}", f"model.d_model={d_model}", "model.num_heads=4", "model.vocab_size=1024",
        "model.max_seq_len=512", "execution.flash_block_size=128", f"data.seq_len={seq}",
        f"train.global_batch={batch}", "train.grad_accum=1", "train.loss_chunk=0"])
    plans = [Candidate.of("offload_dots", "device"), Candidate.of("save_all", "device")]
    result = planner.plan(recipe, "h200", 1, plans=plans, workers=1)
    rows = {row.candidate.activations: row for row in result.rows}
    for row in result.rows:
        assert row.error is None, row.error
        assert row.report["device_kind"] == "NVIDIA H200 141GB HBM3e"
    offload, save = rows["offload_dots"].report, rows["save_all"].report
    assert offload["host_buffer_count"] > 0, "XLA dropped the offload"
    # At least each layer's MLP hidden activation [tokens, 4 * d_model] in bf16 lives in host memory.
    assert offload["host_temp_bytes"] >= layers * batch * seq * 4 * d_model * 2
    assert offload["device_to_host_bytes"] > 0 and offload["host_to_device_bytes"] > 0
    assert not rows["offload_dots"].dropped_offload
    assert save["host_buffer_count"] == 0 and save["host_bytes"] == 0
    assert offload["hbm_bytes"] < save["hbm_bytes"]
