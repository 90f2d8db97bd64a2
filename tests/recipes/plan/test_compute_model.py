"""The planner's compute model (recipes/plan/compute_model.py): FLOPs at the fraction of peak measured on an
H200 per attention kernel, each figure saying whether it is measured.

The fractions are checked against the record of the measurement, BENCHMARKS.md's "On a GPU: one H200" table
(its "step ms", measured, and "predicted ms", the planner's counted FLOPs at peak), read from the document here,
so that a re-measured table and the code cannot drift apart.
"""

import re
from pathlib import Path

import pytest

from spillway.recipes.plan import compute_model

BENCHMARKS = Path(__file__).resolve().parents[3] / "BENCHMARKS.md"


def h200_table() -> dict[str, dict[str, str]]:
    """case -> column -> cell of the table under '## On a GPU: one H200'."""
    section = BENCHMARKS.read_text().split("## On a GPU: one H200", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[1:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if not re.fullmatch(r"-+", cells[0]):
            rows[cells[0]] = dict(zip(header, cells))
    return rows


def measured_over_peak(at_peak_case: str, measured_case: str) -> float:
    """The fraction of peak a measured step reached: its counted FLOPs' time at peak over its measured time."""
    rows = h200_table()
    return float(rows[at_peak_case]["predicted ms"]) / float(rows[measured_case]["step ms"])


def test_the_measured_fractions_are_the_h200_step_times_on_record():
    # cuDNN plans compile as blockwise ones (docs/DESIGN.md section 5): the same counted FLOPs as the blockwise row.
    cudnn = measured_over_peak("1b/recompute_all/device", "1b/recompute_all/device/cudnn")
    assert compute_model.efficiency("cudnn").fraction == pytest.approx(cudnn, rel=1e-3)
    flash = [measured_over_peak(case, case) for case in ("1b/recompute_all/device", "1b/save_all/device")]
    assert compute_model.efficiency("flash").fraction == pytest.approx(sum(flash) / 2, rel=1e-3)
    assert compute_model.efficiency("cudnn").measured and compute_model.efficiency("flash").measured
    assert not compute_model.efficiency("xla").measured


def test_a_steps_counted_flops_at_the_effective_rate_take_the_measured_time():
    rows = h200_table()
    peak = 989e12                                          # H200 dense bf16, recipes/targets.py
    counted = float(rows["1b/recompute_all/device"]["predicted ms"]) * 1e-3 * peak
    measured_s = float(rows["1b/recompute_all/device/cudnn"]["step ms"]) * 1e-3
    assert counted / compute_model.effective_flops_per_s(peak, "cudnn") == pytest.approx(measured_s, rel=1e-3)
    text = compute_model.efficiency("cudnn").describe("cudnn")
    assert text.startswith(f"{cudnn_percent(rows)} of peak (measured, cudnn attention:")
    assert "assumed" in compute_model.efficiency("xla").describe("xla")


def cudnn_percent(rows) -> str:
    at_peak, measured = float(rows["1b/recompute_all/device"]["predicted ms"]), float(
        rows["1b/recompute_all/device/cudnn"]["step ms"])
    return f"{at_peak / measured:.1%}"


def test_an_unknown_kernel_is_one_error():
    with pytest.raises(ValueError, match=r"no compute efficiency for attention_impl 'magic'; known: "):
        compute_model.efficiency("magic")


def test_float32_compute_is_priced_at_tf32s_peak_half_of_bf16s():
    """A float32 recipe's step was counted at the bf16 peak the table showed beside 'float32 compute'."""
    from spillway.recipes.plan import cost_model
    from spillway.recipes.plan.candidates import Candidate
    from spillway.recipes.registry import get_recipe
    from spillway.recipes.targets import get_target

    h100 = get_target("h100")
    assert compute_model.peak_flops(h100, "float32") == (989e12 / 2, "tf32 (float32 compute)")
    assert compute_model.peak_flops(h100, "bfloat16") == (989e12, "bf16")
    compute_s = {dtype: cost_model.plan_row(Candidate.of("save_all", "device"), {}, get_recipe(
        "tiny", [f"execution.dtype={dtype}"]), h100, {"data": 1, "fsdp": 1, "tensor": 1}).compute_s
        for dtype in ("float32", "bfloat16")}
    assert compute_s["float32"] == pytest.approx(2 * compute_s["bfloat16"])
