"""MoE expert weights in pinned host memory, compiled for an H200 without a GPU: HBM holds a layer of experts,
not the stack, and the planner's weight-stream model counts what the compiled step moves.

One compile process per fixture (the planner's, recipes/plan/subprocess_runner.py)
runs benchmarks/host_params_toy.py with an MoE block (benchmarks/moe_blocks.py:
8 scanned layers, d 512, top-2 of 8 experts, expert hidden 512, float32): the
real train step (recipes/train/step.py) with every weight on device, only the
routed experts' weights on host (offload.params=experts; streamed update or the
host CPU's), and every block weight on host (offload.params=host), each with
the optimizer state on host. The buffer assignment (recipes/plan/hlo.py
largest_device_arrays: no HBM buffer of the program is larger than the
first) is read from the compiled HLO.

Each dispatch (dropless by ragged_dot and by blocks, capacity) is compiled
with the experts on host; the blocked one with gradient accumulation (the
running sums through the backward scan), the capacity and ragged ones on an
fsdp 2 mesh too, where the expert axis is split (docs/DESIGN.md section 12).

Marked `needs_toolchain` (tests/ci_gate.py) and `slow`: seven compiles, about four minutes on 2 cores.
"""

import argparse

import pytest

from benchmarks import host_params_toy
from benchmarks.moe_blocks import block_path
from spillway.recipes.plan import cost_model
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.plan.subprocess_runner import run_in_compile_process
from spillway.recipes.targets import get_target

pytestmark = [pytest.mark.needs_toolchain, pytest.mark.slow]

LAYERS = 8
D_MODEL = 512
# The toy's placements as the planner's candidates (its activation plan is recompute_all).
CANDIDATES = {
    "device_params": Candidate.of("recompute_all", "host", "device"),
    "host_experts": Candidate.of("recompute_all", "host", "experts"),
    "host_experts_host_update": Candidate.of("recompute_all", "host", "experts", update_on_host=True),
    "host_params": Candidate.of("recompute_all", "host", "host"),
}
# What the compiled update moves besides the model: the host CPU's partial sums of squared host gradients
# for the clipping norm, a float32 scalar per leaf.
SCALAR_BYTES = 1024


def compile_rows(dispatch: str, placements, grad_accum: int = 1, mesh: str = "1x1x1") -> dict:
    result = run_in_compile_process(
        "benchmarks.host_params_toy",
        ["--json", "--target", "h200", "--layers", LAYERS, "--d-model", D_MODEL, "--grad-accum", grad_accum,
         "--block", block_path("toy", dispatch), "--mesh", mesh, "--placements", ",".join(placements)],
        timeout_s=600)
    errors = {key: row["error"] for key, row in result["rows"].items() if "error" in row}
    assert not errors
    return result["rows"]


def toy_recipe(placement: str, dispatch: str, grad_accum: int = 1):
    args = argparse.Namespace(layers=LAYERS, d_model=D_MODEL, grad_accum=grad_accum, activations="recompute_all",
                              block=block_path("toy", dispatch))
    return host_params_toy.recipe_for(args, placement)


def assert_model_matches_passes(row: dict, placement: str, dispatch: str, grad_accum: int, mesh: dict,
                                by_pass: bool = True):
    """The planner's ParamTraffic against what the compiled step moves per autodiff pass (recompute_all
    offloads no activation: every byte the two passes move is a weight, a gradient or a running sum).

    by_pass=False: only the step's totals each way (see the fsdp dropless case below)."""
    candidate = CANDIDATES[placement]
    model = cost_model.param_traffic(candidate, toy_recipe(placement, dispatch, grad_accum), mesh)
    passes, report = row["traffic_by_pass"], row["report"]
    state = 0 if candidate.update_on_host else report["host_argument_bytes"] - model.host_weights
    if not by_pass:
        moved = {way: sum(p[way] for p in passes.values()) for way in ("host_to_device_bytes", "device_to_host_bytes")}
        assert moved["device_to_host_bytes"] == model.backward_out + state + model.update_out
        extra = moved["host_to_device_bytes"] - (model.forward_in + model.backward_in + state + model.update_in)
        assert 0 <= extra <= SCALAR_BYTES, extra
        return model
    assert passes["forward"] == {"host_to_device_bytes": model.forward_in, "device_to_host_bytes": 0}
    assert passes["backward"] == {"host_to_device_bytes": model.backward_in,
                                  "device_to_host_bytes": model.backward_out}
    assert passes["other"]["device_to_host_bytes"] == state + model.update_out
    extra = passes["other"]["host_to_device_bytes"] - (state + model.update_in)
    assert 0 <= extra <= SCALAR_BYTES, extra
    return model


def assert_no_hbm_buffer_larger_than_a_layer_of_experts(row: dict, key: str):
    largest = row["largest_device_arrays"][0]
    # One layer's slices (gate and up side by side) and the activations of this small batch are the biggest
    # HBM arrays; a stacked expert weight or gradient would be LAYERS x a layer's leaf.
    assert largest["nbytes"] <= row["layer_expert_bytes"], (key, largest)
    assert row["report"]["host_argument_bytes"] > 0


ONE_GPU = {"data": 1, "fsdp": 1, "tensor": 1}
FSDP2 = {"data": 1, "fsdp": 2, "tensor": 1}


@pytest.fixture(scope="module")
def rows():
    return compile_rows("dropless", CANDIDATES)


def test_with_experts_on_host_no_hbm_buffer_holds_more_than_a_layer_of_experts(rows):
    for key in ("host_experts", "host_experts_host_update", "host_params"):
        assert_no_hbm_buffer_larger_than_a_layer_of_experts(rows[key], key)
    # With the weights on device the stacked experts are in HBM: the check above can fail.
    device = rows["device_params"]
    assert device["largest_device_arrays"][0]["nbytes"] >= LAYERS * device["largest_layer_expert_leaf_bytes"]
    assert device["layer_expert_bytes"] > 0.8 * device["layer_weight_bytes"]   # the experts are most of a layer


def test_hbm_falls_by_the_experts_weights_and_gradients(rows):
    device, experts, every = (rows[k]["report"] for k in ("device_params", "host_experts", "host_params"))
    layer_experts = rows["host_experts"]["layer_expert_bytes"]
    # The experts' weights and gradients leave HBM (float32 each); a few layers' worth may stay.
    assert device["hbm_bytes"] - experts["hbm_bytes"] >= 2 * LAYERS * layer_experts - 6 * layer_experts
    # Attention, norms and router stay: more HBM than with every block weight on host, less host memory.
    assert every["hbm_bytes"] < experts["hbm_bytes"] < device["hbm_bytes"] / 2
    assert every["host_bytes"] > experts["host_bytes"]


def test_start_up_creates_the_experts_in_host_memory_a_layer_at_a_time(rows):
    device_init = rows["device_params"]["init"]["report"]
    layer_experts = rows["host_experts"]["layer_expert_bytes"]
    for key in ("host_experts", "host_experts_host_update"):
        init = rows[key]["init"]
        assert init["largest_device_arrays"][0]["nbytes"] <= layer_experts, init
        # What stays on device, and one or two layers of experts in the making.
        assert init["report"]["hbm_bytes"] <= device_init["hbm_bytes"] - (LAYERS - 2) * layer_experts
        assert init["report"]["host_bytes"] >= LAYERS * layer_experts


def test_the_planner_counts_the_expert_stream_the_compiled_step_moves(rows):
    for placement in CANDIDATES:
        model = assert_model_matches_passes(rows[placement], placement, "dropless", 1, ONE_GPU)
        if placement == "device_params":
            assert model == cost_model.ParamTraffic()
        else:   # each layer's streamed weights in per forward, in again and their gradients out per backward
            streamed = rows[placement]["layer_expert_bytes" if "experts" in placement else "layer_weight_bytes"]
            assert model.forward_in == model.weights_in_backward == model.gradients_out == LAYERS * streamed


def test_experts_on_host_cost_their_link_time_in_the_passes(rows):
    target = get_target("h200")
    link = target.host_link_bytes_per_s
    row = cost_model.plan_row(CANDIDATES["host_experts"], {"report": rows["host_experts"]["report"]},
                              toy_recipe("host_experts", "dropless"), target, ONE_GPU)
    forward_in = rows["host_experts"]["traffic_by_pass"]["forward"]["host_to_device_bytes"]
    assert forward_in == LAYERS * rows["host_experts"]["layer_expert_bytes"]
    assert row.forward_s >= forward_in / link * (1 - 1e-9)


@pytest.mark.parametrize("dispatch,grad_accum,mesh", [
    ("dropless_blocked", 2, "1x1x1"), ("capacity", 1, "1x2x1"), ("dropless", 1, "1x2x1")])
def test_every_dispatch_streams_host_experts_and_the_model_counts_them(dispatch, grad_accum, mesh):
    """Each dispatch with the experts on host: no HBM buffer above a layer of experts, and the bytes the
    planner counts are what the step moves. fsdp 2 splits the expert axis, so each GPU streams half the
    experts; grad_accum 2 sends the float32 running sums through the backward scan a layer at a time.

    Dropless on fsdp 2 (its experts gathered in a shard_map): the step moves the bytes the model counts, but
    XLA (jaxlib 0.10.2) peels the backward scan's last iteration into the entry computation and fuses each
    layer's gradient write-back into copies that carry no JAX op_name, so hlo.traffic_by_pass files those
    bytes under "other" (one layer's weights in, every layer's gradients out) and the planner prices them
    in the update phase, not beside the backward compute: its step estimate is high there. Only the totals
    are compared for that case."""
    (row,) = compile_rows(dispatch, ["host_experts"], grad_accum, mesh).values()
    mesh_axes = host_params_toy.mesh_shape(mesh)
    # The dropless dispatch gathers a layer's experts on each GPU (as FSDP gathers a weight): a whole layer.
    assert_no_hbm_buffer_larger_than_a_layer_of_experts(row, dispatch)
    named = not (dispatch == "dropless" and mesh_axes["fsdp"] > 1)
    model = assert_model_matches_passes(row, "host_experts", dispatch, grad_accum, mesh_axes, by_pass=named)
    if not named:   # the unnamed part is what the docstring says: the last layer's weights and the gradients
        passes = row["traffic_by_pass"]
        layer = row["layer_expert_bytes"] // mesh_axes["fsdp"]
        assert passes["backward"]["host_to_device_bytes"] == model.backward_in - layer
        assert passes["backward"]["device_to_host_bytes"] == 0
    streamed = LAYERS * row["layer_expert_bytes"] // mesh_axes["fsdp"]   # each GPU streams its experts
    assert model.forward_in == grad_accum * streamed
    if grad_accum > 1:   # float32 toy: the running sums are the experts' size, in and out per micro-batch
        assert model.sums_in == model.gradients_out == grad_accum * streamed
