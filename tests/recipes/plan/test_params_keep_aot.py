"""The weights across the turn (offload.params_keep=K), compiled for an H200 without a GPU: K streamed layers'
weights fewer into HBM per micro-batch, and the planner's count of them.

One compile process runs benchmarks/host_params_toy.py for a 4-layer Llama with every block weight in host
memory, with and without the last 2 layers' weights kept (grad_accum 2, recompute_all: every byte the passes
move is a weight or a running sum). Each streamed layer's fetch is in the branch of a conditional that the
kept layers do not take; hlo.py counts every branch, so the compile's conditional bytes are all N layers'
fetches in both passes, and the planner takes the kept K of N out (cost_model.host_to_device_moved).

Marked `needs_toolchain` (tests/ci_gate.py), like tests/recipes/plan/test_host_params_aot.py.
"""

import pytest

from spillway.recipes.plan import cost_model
from spillway.recipes.plan.candidates import Candidate
from tests.recipes.plan.test_host_params_aot import ONE_GPU
from spillway.recipes.plan.subprocess_runner import run_in_compile_process

pytestmark = [pytest.mark.needs_toolchain, pytest.mark.slow]   # two deviceless compiles: about a minute

LAYERS, KEEP, ACCUM = 4, 2, 2
CANDIDATES = {"host_params": Candidate.of("recompute_all", "host", "host"),
              "host_params_keep": Candidate.of("recompute_all", "host", "host", params_keep=KEEP)}


@pytest.fixture(scope="module")
def rows():
    result = run_in_compile_process(
        "benchmarks.host_params_toy",
        ["--json", "--target", "h200", "--layers", LAYERS, "--d-model", 256, "--grad-accum", ACCUM,
         "--placements", ",".join(CANDIDATES)], timeout_s=400)
    assert not {key: row["error"] for key, row in result["rows"].items() if "error" in row}
    return result["rows"]


def _recipe(placement: str):
    import argparse

    from benchmarks import host_params_toy
    args = argparse.Namespace(layers=LAYERS, d_model=256, grad_accum=ACCUM, activations="recompute_all")
    return host_params_toy.recipe_for(args, placement)


def test_kept_layers_are_brought_in_once_and_the_planner_counts_the_bytes_not_moved(rows):
    plain, kept = rows["host_params"], rows["host_params_keep"]
    layer = kept["layer_weight_bytes"]
    assert plain["report"]["conditional_host_to_device_bytes"] == 0
    # Every streamed layer's fetch, in the forward and the backward pass, per micro-batch, sits in a branch.
    assert kept["report"]["conditional_host_to_device_bytes"] == 2 * ACCUM * LAYERS * layer
    moved = {key: cost_model.host_to_device_moved(
        cost_model.param_traffic(CANDIDATES[key], _recipe(key), ONE_GPU), rows[key]["report"]) for key in rows}
    assert moved["host_params"] == plain["report"]["host_to_device_bytes"]
    # The bytes not moved: K layers' weights per micro-batch, which the backward pass does not fetch again.
    traffic = cost_model.param_traffic(CANDIDATES["host_params_keep"], _recipe("host_params_keep"), ONE_GPU)
    assert moved["host_params"] - moved["host_params_keep"] == traffic.kept_weights == ACCUM * KEEP * layer


def test_kept_layers_cost_at_most_their_weights_in_hbm(rows):
    """The kept rows live in HBM from before the forward scan to the end of the backward one: at most K layers'
    weights more at the peak (here the peak lies elsewhere, in the streamed update)."""
    extra = rows["host_params_keep"]["report"]["hbm_bytes"] - rows["host_params"]["report"]["hbm_bytes"]
    assert 0 <= extra <= KEEP * rows["host_params_keep"]["layer_weight_bytes"]
