"""A small Gemma 3 compiled for an H200 without a GPU: per-layer values cost no memory, offload reaches host.

The real train step (recipes/train/step.py, through the planner's compile
process) of a 12-layer Gemma 3 (two periods of five local layers and one
global; window, RoPE base and scale scanned per layer) against its uniform
twin: the same weights' shapes with every layer global and no scaling, so the
stack has no per-layer values and compiles as the six dense families do. Same
parameter bytes, same activation bytes, so:

* HBM must be equal within a few percent for each plan. A scan body that
  handed back the module state would keep a second stacked copy of the
  weights (here about 10% of the step's HBM) and fail this.
* The offloading plan must show host buffers and host temp bytes, as many as
  the uniform twin's: an offload that silently did nothing inside the layers'
  scan (a trap other JAX projects fell into) would show none.

Marked `needs_toolchain` (tests/ci_gate.py).
"""

import pytest

from spillway.recipes.plan import planner
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.registry import get_recipe

pytestmark = [pytest.mark.needs_toolchain, pytest.mark.slow]  # one module fixture compiling a 12-layer Gemma 3 and its twin: 45 s on 2 cores, `make test-slow` (CI: .venv-jax011's slow step), keeping `make test` near 12 minutes

SMALL = ["model.num_layers=12", "model.d_model=512", "model.num_heads=4", "model.num_kv_heads=2",
         "model.head_dim=128", "model.mlp_hidden=2048", "model.vocab_size=1024", "model.max_seq_len=1024",
         "model.sliding_window=256", "data.seq_len=1024", "execution.dtype=bfloat16",
         "execution.param_dtype=bfloat16", "execution.attention_impl=flash", "execution.flash_block_size=128",
         "train.global_batch=4"]
UNIFORM = ["model.layer_pattern=G", "model.rope_global_scale=1.0"]
PLANS = [Candidate.of("save_all", "device"), Candidate.of("offload_dots", "device")]
HBM_TOLERANCE = 0.03


@pytest.fixture(scope="module")
def rows():
    out = {}
    for name, overrides in (("pattern", SMALL), ("uniform", SMALL + UNIFORM)):
        recipe = get_recipe("gemma3_tiny", overrides)
        result = planner.plan(recipe, "h200", 1, workers=1, plans=PLANS)
        for row in result.rows:
            assert row.error is None, row.error
        out[name] = {row.candidate.activations: row.report for row in result.rows}
    return out


def test_the_two_models_are_what_the_test_compares():
    pattern, uniform = get_recipe("gemma3_tiny", SMALL), get_recipe("gemma3_tiny", SMALL + UNIFORM)
    assert pattern.model.layer_kinds() == "LLLLLG" * 2 and uniform.model.layer_kinds() == "G" * 12
    assert pattern.num_params() == uniform.num_params()
    from spillway.layers.layer_pattern import needs_values
    assert needs_values(pattern.decoder_spec().layer_settings, pattern.decoder_spec().stack_runs())
    assert not needs_values(uniform.decoder_spec().layer_settings, uniform.decoder_spec().stack_runs())


@pytest.mark.parametrize("plan", ["save_all", "offload_dots"])
def test_per_layer_values_cost_no_hbm(rows, plan):
    pattern, uniform = rows["pattern"][plan]["hbm_bytes"], rows["uniform"][plan]["hbm_bytes"]
    assert abs(pattern - uniform) <= HBM_TOLERANCE * uniform, (plan, pattern, uniform)


def test_the_offload_reaches_host_memory_inside_the_layer_scan(rows):
    offload, save = rows["pattern"]["offload_dots"], rows["pattern"]["save_all"]
    assert offload["host_buffer_count"] > 0 and offload["host_temp_bytes"] > 0, "XLA dropped the offload"
    assert offload["device_to_host_bytes"] > 0 and offload["host_to_device_bytes"] > 0
    assert offload["host_temp_bytes"] == rows["uniform"]["offload_dots"]["host_temp_bytes"]
    assert offload["hbm_bytes"] < save["hbm_bytes"]
    assert save["host_bytes"] == 0
