"""offload.update=next_forward with grad_accum > 1 compiled for an H200 without a GPU (the planner's compile
process, benchmarks/host_params_toy.py's 8-layer toy, bfloat16 weights with float32 masters, 2 micro-batches):
the host state crosses in the first micro-batch's forward pass and nowhere else, and the planner prices it
beside that one forward pass, not beside both.

Marked `needs_toolchain` (tests/ci_gate.py), like tests/recipes/plan/test_host_params_aot.py.
"""

import argparse

import jax
import pytest

from benchmarks import host_params_toy
from spillway.recipes.config import NEXT_FORWARD
from spillway.recipes.plan import cost_model, hlo
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.plan.subprocess_runner import run_in_compile_process
from spillway.recipes.targets import get_target
from spillway.recipes.train.step import abstract_model

pytestmark = [pytest.mark.needs_toolchain, pytest.mark.slow]   # one compile process: 1 to 3 minutes on 2 cores

LAYERS, GRAD_ACCUM = 8, 2
ONE_GPU = {"data": 1, "fsdp": 1, "tensor": 1}
AFTER, DEFERRED = "device_params", "device_params_update_in_forward_pending_device"


def _args():
    return argparse.Namespace(layers=LAYERS, d_model=512, grad_accum=GRAD_ACCUM, activations="recompute_all",
                              param_dtype="bfloat16")


@pytest.fixture(scope="module")
def rows():
    result = run_in_compile_process(
        "benchmarks.host_params_toy",
        ["--json", "--target", "h200", "--layers", LAYERS, "--d-model", 512, "--grad-accum", GRAD_ACCUM,
         "--param-dtype", "bfloat16", "--placements", f"{AFTER},{DEFERRED}"], timeout_s=600)
    assert not {key: row["error"] for key, row in result["rows"].items() if "error" in row}
    return result["rows"]


def _stacked_state_bytes(recipe) -> int:
    """mu and nu in float32 and a float32 master of each bfloat16 stacked weight (float32 norm scales: none)."""
    _, model_state = abstract_model(recipe)
    return sum(leaf.size * (12 if leaf.dtype.itemsize == 2 else 8)
               for path, leaf in jax.tree_util.tree_flatten_with_path(model_state)[0]
               if "blocks" in jax.tree_util.keystr(path))


def test_the_state_crosses_in_the_first_micro_batch_forward_pass_only(rows):
    """The first micro-batch's forward pass brings the stacked state in and sends the new state out (and
    layer 0's rows once more, as with one batch per step); no gradient crosses (the running sum is in HBM) and
    the second micro-batch moves nothing: its passes (hlo LATER_*) are absent from the compiled step. HBM:
    about that of the update after the backward pass (measured: 382.1 MiB against 294.3, the hook's state
    rows of one or two layers on device, 43.5 MiB each; 47.1 MiB more with one batch per step), below
    2.5 layers' state rows more, which a second copy of the float32 gradients (117 MiB) would exceed."""
    recipe = host_params_toy.recipe_for(_args(), DEFERRED)
    state = _stacked_state_bytes(recipe)
    passes = rows[DEFERRED]["traffic_by_pass"]
    assert set(passes) == {hlo.FORWARD, hlo.BACKWARD, hlo.OTHER}, passes
    assert passes[hlo.FORWARD] == {"device_to_host_bytes": state + state // LAYERS, "host_to_device_bytes": state}
    assert passes[hlo.BACKWARD] == {"device_to_host_bytes": 0, "host_to_device_bytes": 0}
    assert rows[AFTER]["traffic_by_pass"][hlo.FORWARD] == {"device_to_host_bytes": 0, "host_to_device_bytes": 0}
    deferred_hbm, after_hbm = rows[DEFERRED]["report"]["hbm_bytes"], rows[AFTER]["report"]["hbm_bytes"]
    assert deferred_hbm <= after_hbm + 5 * state // (2 * LAYERS), (deferred_hbm, after_hbm, state // LAYERS)


def test_the_planner_prices_the_state_beside_one_micro_batch_forward_pass(rows):
    """The forward phase is at least the first micro-batch's link time plus the second one's compute: the
    state's copies cannot hide under compute that runs after the new weights are needed."""
    recipe = host_params_toy.recipe_for(_args(), DEFERRED)
    target = get_target("h200")
    candidate = Candidate.of("recompute_all", "host", "device", NEXT_FORWARD, pending_gradients="device")
    report = rows[DEFERRED]["report"]
    row = cost_model.plan_row(candidate, {"report": report}, recipe, target, ONE_GPU)
    moved = report["transfer_bytes_by_pass"][hlo.FORWARD]
    link_s = cost_model.link_seconds(moved["device_to_host_bytes"], moved["host_to_device_bytes"],
                                     report["overlapped_bytes_by_pass"].get(hlo.FORWARD, 0),
                                     target.host_link_bytes_per_s)
    one_forward_s = row.compute_s * row.flops["forward"] / row.flops["total"] / GRAD_ACCUM
    assert row.forward_s >= link_s + one_forward_s * (GRAD_ACCUM - 1) > 0
    assert row.update_s < row.forward_s
