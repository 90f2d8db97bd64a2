"""Block weights in pinned host memory, compiled for an H200 without a GPU: HBM holds a layer, not the stack.

CPU JAX treats memory kinds as no-ops, so only a GPU compile can show the
saving. One child process (the planner's compile process) runs
benchmarks/host_params_toy.py, which compiles the real train step
(recipes/train/step.py) of a small 8-layer Llama with the block weights on
device and on host, and reports the buffer figures read from the compiled HLO.

The planner's weight-stream model (recipes/plan/planner.py ParamTraffic) is
checked here against the same compiles: the bytes it attributes to the
forward and backward passes must be what the compiled program moves in them,
told apart by JAX's own names for its autodiff passes (recipes/plan/hlo.py
traffic_by_pass), and a host-weights plan must pay for them in its step time.

Marked `needs_toolchain` (tests/ci_gate.py), like tests/recipes/optim/test_optimizer_aot.py.
"""

import argparse
import dataclasses

import pytest

from benchmarks import host_params_toy
from spillway.recipes.config import NEXT_FORWARD
from spillway.recipes.plan import cost_model, planner
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.plan.subprocess_runner import run_in_compile_process
from spillway.recipes.targets import get_target

pytestmark = [pytest.mark.needs_toolchain, pytest.mark.slow]  # one module fixture compiling every host-weights placement: 150 s on 2 cores, `make test-slow` (CI: .venv-jax011's slow step), keeping `make test` near 12 minutes

LAYERS = 8
ONE_GPU = {"data": 1, "fsdp": 1, "tensor": 1}
# The toy's placements as the planner's candidates (its activation plan is recompute_all).
CANDIDATES = {
    "device_params": Candidate.of("recompute_all", "host", "device"),
    "host_params": Candidate.of("recompute_all", "host", "host"),
    "host_params_host_update": Candidate.of("recompute_all", "host", "host", update_on_host=True),
}
# What the compiled update moves besides the model: the host CPU's partial sums
# of squared host gradients for the clipping norm, a float32 scalar per leaf.
SCALAR_BYTES = 1024


def compile_rows(grad_accum: int, *extra) -> dict:
    result = run_in_compile_process(
        "benchmarks.host_params_toy",
        ["--json", "--target", "h200", "--layers", LAYERS, "--d-model", 512, "--grad-accum", grad_accum, *extra],
        timeout_s=400)
    errors = {key: row["error"] for key, row in result["rows"].items() if "error" in row}
    assert not errors
    return result["rows"]


def toy_recipe(placement: str, grad_accum: int = 1):
    args = argparse.Namespace(layers=LAYERS, d_model=512, grad_accum=grad_accum, activations="recompute_all")
    return host_params_toy.recipe_for(args, placement)


def assert_model_matches_passes(row: dict, placement: str, grad_accum: int, mesh=ONE_GPU):
    """The planner's ParamTraffic against what the compiled step moves per autodiff pass.

    recompute_all offloads no activation, so every byte the forward and
    backward passes move is a weight or a gradient; the rest of the program
    (the update, the micro-batch gradient sums) is OTHER.
    """
    candidate = CANDIDATES[placement]
    model = cost_model.param_traffic(candidate, toy_recipe(placement, grad_accum), mesh)
    passes, report = row["traffic_by_pass"], row["report"]
    assert passes["forward"] == {"host_to_device_bytes": model.forward_in, "device_to_host_bytes": 0}
    assert passes["backward"] == {"host_to_device_bytes": model.backward_in,
                                  "device_to_host_bytes": model.backward_out}
    state = 0 if candidate.update_on_host else \
        report["host_argument_bytes"] - model.host_weights
    assert passes["other"]["device_to_host_bytes"] == state + model.update_out
    extra = passes["other"]["host_to_device_bytes"] - (state + model.update_in)
    assert 0 <= extra <= SCALAR_BYTES, extra
    return model


@pytest.fixture(scope="module")
def rows():
    return compile_rows(1, "--placements", ",".join(CANDIDATES))


def test_no_hbm_buffer_holds_more_than_a_layer_of_weights(rows):
    for key in ("host_params", "host_params_host_update"):
        row = rows[key]
        largest = row["largest_device_arrays"][0]
        # The per-layer slices (and activations of this small batch) are the biggest device
        # arrays; a stacked weight or gradient (LAYERS x a layer) would be 8x the largest leaf.
        assert largest["nbytes"] <= 2 * row["largest_layer_leaf_bytes"], (key, largest)
        assert row["report"]["host_argument_bytes"] > 0
    # With the weights on device the stacked arrays are in HBM: the check above can fail.
    device_largest = rows["device_params"]["largest_device_arrays"][0]
    assert device_largest["nbytes"] >= LAYERS * rows["device_params"]["largest_layer_leaf_bytes"]


def test_start_up_creates_host_weights_without_holding_them_in_hbm(rows):
    """The program that creates the weights makes host-resident ones a layer at a time, in host memory."""
    device_init = rows["device_params"]["init"]["report"]
    stacked_weights = LAYERS * rows["host_params"]["layer_weight_bytes"]
    assert device_init["hbm_bytes"] >= stacked_weights   # on device they are all in HBM at the end
    for key in ("host_params", "host_params_host_update"):
        init = rows[key]["init"]
        assert init["largest_device_arrays"][0]["nbytes"] <= 2 * rows[key]["largest_layer_leaf_bytes"], init
        assert init["report"]["hbm_bytes"] <= 2 * rows[key]["layer_weight_bytes"], init["report"]
        assert init["report"]["host_bytes"] >= stacked_weights
        # Nor does creating the optimizer state hold a stacked leaf in HBM.
        assert rows[key]["optimizer_init"]["report"]["hbm_bytes"] <= 2 * rows[key]["layer_weight_bytes"]


def test_hbm_falls_by_most_of_the_weights_and_gradients(rows):
    device, host = rows["device_params"]["report"], rows["host_params"]["report"]
    stacked_weights = LAYERS * rows["host_params"]["layer_weight_bytes"]
    # Weights and their gradients leave HBM (fp32 each); a few layers' worth may stay.
    assert device["hbm_bytes"] - host["hbm_bytes"] >= 2 * stacked_weights - 6 * rows["host_params"]["layer_weight_bytes"]
    assert host["hbm_bytes"] < device["hbm_bytes"] / 2


@pytest.fixture(scope="module")
def bfloat16_rows():
    """bfloat16 weights with float32 masters, the optimizer state on host, updated after the backward pass
    or in the next forward pass."""
    return compile_rows(1, "--param-dtype", "bfloat16", "--placements",
                        "device_params,device_params_update_in_forward,device_params_update_in_forward_pending_device")


@pytest.mark.slow   # a compile process of its own, 40 s: CI runs it in .venv-jax011's slow step
def test_the_update_in_the_next_forward_moves_the_state_there_both_ways_at_once(bfloat16_rows):
    """offload.update=next_forward: the stacked leaves' state crosses in the forward pass, with both link
    directions in flight together, and their gradients leave HBM in the backward pass: HBM holds no
    stacked gradient, and one layer's new state rows on device in the carry."""
    import jax

    from spillway.recipes.train.step import abstract_model

    after, deferred = bfloat16_rows["device_params"], bfloat16_rows["device_params_update_in_forward"]
    args = argparse.Namespace(layers=LAYERS, d_model=512, grad_accum=1, activations="recompute_all",
                              param_dtype="bfloat16")
    recipe = host_params_toy.recipe_for(args, "device_params_update_in_forward")
    _, model_state = abstract_model(recipe)
    stacked = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(model_state)[0]
               if "blocks" in jax.tree_util.keystr(path)]
    weights = sum(leaf.size * leaf.dtype.itemsize for leaf in stacked)   # = their pending gradients
    # mu and nu in float32, and a float32 master of a bfloat16 weight (norm scales are float32: none)
    state = sum(leaf.size * (12 if leaf.dtype.itemsize == 2 else 8) for leaf in stacked)
    forward, backward = deferred["traffic_by_pass"]["forward"], deferred["traffic_by_pass"]["backward"]
    # The new state out, and layer 0's once more (the carry writes its unchanged rows back in the first
    # iteration: recipes/optim/update_in_forward.py); the state and the pending gradient in.
    assert forward == {"device_to_host_bytes": state + state // LAYERS, "host_to_device_bytes": state + weights}, forward
    # at least the state; XLA versions differ in the few small copies they put beside the same matmuls
    # (jax 0.11.2: 1.5 MB more of 365 MB), so within 1% of it
    assert state <= deferred["overlapped_by_pass"]["forward"] <= 1.01 * state, deferred["overlapped_by_pass"]
    assert backward == {"host_to_device_bytes": 0, "device_to_host_bytes": weights}, backward
    # Before: nothing crossed in the forward pass; the state crossed after the backward pass, each way.
    assert after["traffic_by_pass"]["forward"] == {"host_to_device_bytes": 0, "device_to_host_bytes": 0}
    assert after["traffic_by_pass"]["other"]["device_to_host_bytes"] >= state
    # No stacked gradient in HBM, but the carry holds a layer's new state rows on device until the next
    # iteration writes them over the old ones (in place): on this toy that costs more than the gradient
    # saves (208.8 MB against 194.6 MB after the backward pass; under 179.4 MB before the in-place write,
    # as this test then required), so the
    # bound is one layer of state above.
    assert deferred["report"]["hbm_bytes"] < after["report"]["hbm_bytes"] + state // LAYERS, (
        deferred["report"]["hbm_bytes"], after["report"]["hbm_bytes"])
    # The planner prices the state in the forward pass, beside its compute, not after the backward pass:
    # the two directions overlapped, the larger one sets the link time.
    target = get_target("h200")
    candidate = Candidate.of("recompute_all", "host", "device", NEXT_FORWARD)
    row = cost_model.plan_row(candidate, {"report": deferred["report"]}, recipe, target, ONE_GPU)
    assert row.forward_s >= (state + weights) / target.host_link_bytes_per_s
    assert row.update_s < row.forward_s / 4


def test_pending_gradients_in_hbm_never_cross_the_link_and_leave_host_memory_to_the_state(bfloat16_rows):
    """offload.pending_gradients=device: the forward pass brings in the state alone (no pending gradient), the
    backward pass sends nothing out, the step's host arguments are the state alone, every host byte aliased;
    HBM gains the stacked gradient (what the update after the backward pass holds too)."""
    import jax

    from spillway.recipes.train.step import abstract_model

    on_host = bfloat16_rows["device_params_update_in_forward"]
    in_hbm = bfloat16_rows["device_params_update_in_forward_pending_device"]
    args = argparse.Namespace(layers=LAYERS, d_model=512, grad_accum=1, activations="recompute_all",
                              param_dtype="bfloat16")
    _, model_state = abstract_model(host_params_toy.recipe_for(args, "device_params_update_in_forward_pending_device"))
    stacked = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(model_state)[0]
               if "blocks" in jax.tree_util.keystr(path)]
    weights = sum(leaf.size * leaf.dtype.itemsize for leaf in stacked)   # = their pending gradients
    state = sum(leaf.size * (12 if leaf.dtype.itemsize == 2 else 8) for leaf in stacked)
    forward, backward = in_hbm["traffic_by_pass"]["forward"], in_hbm["traffic_by_pass"]["backward"]
    assert forward == {"device_to_host_bytes": state + state // LAYERS, "host_to_device_bytes": state}, forward
    assert backward == {"host_to_device_bytes": 0, "device_to_host_bytes": 0}, backward
    report, host_report = in_hbm["report"], on_host["report"]
    assert host_report["host_argument_bytes"] - report["host_argument_bytes"] == weights
    assert report["host_alias_bytes"] == report["host_argument_bytes"] and report["host_temp_bytes"] == 0
    # The stacked gradient in HBM once: at most the pending-on-host step's HBM + the gradients (made in the
    # old ones' buffer; stacked by the scan's transpose into a new one, as first built, old and new were both
    # there: the 1B's 9.78 GiB against 6.33 + 1.81), and most of them (measured on this toy: 208.1 MiB on host,
    # 258.9 in HBM, the gradients 58.4; 211.8 after the backward pass, whose update holds them too).
    assert host_report["hbm_bytes"] + weights - 2 * weights // LAYERS <= report["hbm_bytes"] <= \
        host_report["hbm_bytes"] + weights, (report["hbm_bytes"], host_report["hbm_bytes"], weights)
    # The planner prices it below the pending-on-host plan: the same compute, less over the link.
    target = get_target("h200")
    recipe = host_params_toy.recipe_for(args, "device_params_update_in_forward_pending_device")
    rows = {key: cost_model.plan_row(Candidate.of("recompute_all", "host", "device", NEXT_FORWARD,
                                                  pending_gradients=pending), {"report": r["report"]}, recipe,
                                     target, ONE_GPU)
            for key, pending, r in (("host", "host", on_host), ("device", "device", in_hbm))}
    assert rows["device"].step_s <= rows["host"].step_s


def test_the_planner_counts_the_weight_stream_the_compiled_step_moves(rows):
    for placement in CANDIDATES:
        model = assert_model_matches_passes(rows[placement], placement, grad_accum=1)
        if placement == "device_params":
            assert model == cost_model.ParamTraffic()
        else:   # every layer's weights, in per forward, in again and their gradients out per backward
            assert model.forward_in == model.weights_in_backward == model.gradients_out == \
                LAYERS * rows[placement]["layer_weight_bytes"]


def test_host_weights_cost_their_link_time_in_forward_and_backward_not_in_the_update(rows):
    target = get_target("h200")
    link = target.host_link_bytes_per_s
    device, host = (cost_model.plan_row(CANDIDATES[p], {"report": rows[p]["report"]}, toy_recipe(p), target, ONE_GPU)
                    for p in ("device_params", "host_params"))
    passes = rows["host_params"]["traffic_by_pass"]
    forward_weights = passes["forward"]["host_to_device_bytes"]
    backward_weights = passes["backward"]["host_to_device_bytes"] + passes["backward"]["device_to_host_bytes"]
    assert forward_weights > 0 and backward_weights > 0
    overlapped = rows["host_params"]["report"]["overlapped_bytes_by_pass"]["backward"]
    # A tiny model on an H200: the link, not compute (at the efficiency compute_model measured), sets both passes.
    assert host.compute_s < min(forward_weights, backward_weights - overlapped) / link
    assert host.forward_s == pytest.approx(forward_weights / link)
    # The H200's link directions take turns (GpuTarget.host_link_duplex): what the schedule has in flight
    # both ways is not credited; on a duplex link it is, once.
    assert host.backward_s == pytest.approx(backward_weights / link)
    duplex = dataclasses.replace(target, host_link_duplex=True)
    host_on_duplex = cost_model.plan_row(CANDIDATES["host_params"], {"report": rows["host_params"]["report"]},
                                         toy_recipe("host_params"), duplex, ONE_GPU)
    assert host_on_duplex.backward_s == pytest.approx((backward_weights - overlapped) / link)
    assert host.step_s >= device.step_s + (forward_weights + backward_weights) / link * (1 - 1e-9)
    # The update's time covers at most what the compiled step moves outside the two passes.
    other = passes["other"]
    assert host.update_s <= (other["host_to_device_bytes"] + other["device_to_host_bytes"]) / link
    moved = sum(sum(moved.values()) for moved in passes.values())
    assert host.transfer_s == pytest.approx(moved / link)
    assert host_on_duplex.transfer_s == pytest.approx(
        (moved - rows["host_params"]["report"]["overlapped_transfer_bytes"]) / link)


def test_sharded_weights_stream_one_gpu_share():
    """fsdp x tensor split each weight; the norm scales are not split: each GPU streams its share."""
    mesh = host_params_toy.mesh_shape("1x2x2")
    (row,) = compile_rows(1, "--mesh", "1x2x2", "--placements", "host_params").values()
    model = assert_model_matches_passes(row, "host_params", grad_accum=1, mesh=mesh)
    whole = LAYERS * row["layer_weight_bytes"]
    assert whole / 4 < model.forward_in < whole / 2


@pytest.mark.slow  # in `make test-slow` (CI runs it): three more compiles, keeping `make test` under 15 minutes
def test_with_gradient_accumulation_no_hbm_buffer_holds_a_stacked_gradient():
    """grad_accum > 1: the float32 running sums of the host gradients are accumulated inside the backward
    scan a layer at a time (layers/host_weights.AccumulatingWeight), so HBM still holds about a layer of
    them; the planner counts the sums crossing both ways per micro-batch and the weights streamed per
    micro-batch."""
    rows = compile_rows(grad_accum=2)
    for key in ("host_params", "host_params_host_update"):
        row = rows[key]
        largest = row["largest_device_arrays"][0]
        # A one-layer float32 slice of the largest weight (the toy is float32), or an activation.
        assert largest["nbytes"] <= 2 * row["largest_layer_leaf_bytes"], (key, largest)
    assert rows["host_params"]["report"]["hbm_bytes"] < rows["device_params"]["report"]["hbm_bytes"] / 4
    for placement in CANDIDATES:
        model = assert_model_matches_passes(rows[placement], placement, grad_accum=2)
        if placement != "device_params":
            layer_bytes = rows[placement]["layer_weight_bytes"]
            assert model.forward_in == 2 * LAYERS * layer_bytes
            # float32 toy: the running sums are the weights' size, in and out per micro-batch.
            assert model.sums_in == model.gradients_out == 2 * LAYERS * layer_bytes
    # A layer's new sum goes out while the next layer's weights and sum come in: on a duplex link the
    # planner credits the bytes in flight together to the backward phase, as the schedule has them; on the
    # H200's, measured taking turns, both directions add.
    report, passes = rows["host_params"]["report"], rows["host_params"]["traffic_by_pass"]["backward"]
    overlapped = report["overlapped_bytes_by_pass"]["backward"]
    assert 0 < overlapped <= passes["device_to_host_bytes"]
    target = get_target("h200")
    moved = passes["device_to_host_bytes"] + passes["host_to_device_bytes"]
    for link_target, credited in ((target, 0), (dataclasses.replace(target, host_link_duplex=True), overlapped)):
        row = cost_model.plan_row(CANDIDATES["host_params"], {"report": report}, toy_recipe("host_params", 2),
                                  link_target, ONE_GPU)
        assert row.backward_s == pytest.approx((moved - credited) / target.host_link_bytes_per_s, rel=1e-6)


def test_a_mesh_the_toy_cannot_read_is_named_in_one_line():
    for bad in ("1x2", "1x0x1", "axbxc"):
        with pytest.raises(argparse.ArgumentTypeError, match=rf"DATAxFSDPxTENSOR .* got '{bad}'"):
            host_params_toy.mesh_shape(bad)
