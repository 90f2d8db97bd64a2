"""The planner's compute model (recipes/plan/compute_model.py): FLOPs at the fraction of peak measured on an
H200 per attention kernel, each figure saying whether it is measured."""

import pytest

from spillway.recipes.plan import compute_model


def test_the_measured_fractions_are_the_h200_step_times():
    # Llama 3.2 1B, recompute_all, 8,192 tokens: 93.1 ms at peak; 199.8 ms (cuDNN), 716.2 ms (blockwise).
    assert 93.1e-3 / compute_model.efficiency("cudnn").fraction == pytest.approx(199.8e-3)
    flash = compute_model.efficiency("flash").fraction
    assert 93.1 / 716.2 < flash < 77.0 / 547.8
    assert compute_model.efficiency("cudnn").measured and compute_model.efficiency("flash").measured
    assert not compute_model.efficiency("xla").measured


def test_effective_rate_and_description():
    assert compute_model.effective_flops_per_s(1e15, "cudnn") == pytest.approx(1e15 * 93.1 / 199.8)
    text = compute_model.efficiency("cudnn").describe("cudnn")
    assert text.startswith("46.6% of peak (measured, cudnn attention:")
    assert "assumed" in compute_model.efficiency("xla").describe("xla")


def test_an_unknown_kernel_is_one_error():
    with pytest.raises(ValueError, match=r"no compute efficiency for attention_impl 'magic'; known: "):
        compute_model.efficiency("magic")
