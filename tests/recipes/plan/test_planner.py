"""`spillway plan`: the train step of a small scanned Llama compiled for an H200 without a GPU.

One module fixture runs the planner once over every candidate plan (16
compiles in one compile process, about a minute on 2 cores); every test that
needs compiled figures reads that result, and the CLI tests replay it through
`plan_command` / `apply_plan` without compiling again. The rest (FLOP counts,
the seq_len search logic, input errors) needs no GPU compiler; the FLOP count
is checked against XLA's in tests/models/test_flops.py.

Ground truth for offload (docs/DESIGN.md section 3): an offloading plan must show
activations in host memory in the compiled step (S(5) buffers and host temp
bytes). A preset that XLA silently dropped fails here.

The compiling tests are marked `needs_toolchain` (tests/ci_gate.py): skipped
only where the CUDA toolkit's ptxas/libdevice is missing, never under CI; a
missing plugin fails with the install command (`make test` installs it).
"""

import json
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from spillway.layers import names
from spillway.layers.memory import MEMORIES
from spillway.layers.offload import PRESETS, RematPlan
from spillway.models import flops
from spillway.recipes import cli
from spillway.recipes.config import AFTER_BACKWARD, NEXT_FORWARD
from spillway.recipes.plan import candidates as plan_candidates
from spillway.recipes.plan import commands, compute_model, cost_model, mesh_rules, planner, plugin, pruning, scheduler, workers
from spillway.recipes.plan import render as plan_render
from spillway.recipes.plan import result as plan_result
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.plan.child import search_one
from spillway.recipes.registry import get_recipe

needs_toolchain = pytest.mark.needs_toolchain   # tests/ci_gate.py: never skipped under CI

# A Llama small enough to compile fast, with activations and optimizer state of
# comparable size (tens of MB each), so that both kinds of offload show.
SMALL_LLAMA = ["model.num_layers=4", "model.d_model=256", "model.num_heads=4", "model.num_kv_heads=2",
               "model.mlp_hidden=1024", "model.vocab_size=1024", "model.max_seq_len=1024",
               "execution.dtype=bfloat16", "execution.param_dtype=bfloat16", "execution.attention_impl=flash",
               "execution.flash_block_size=128", "data.seq_len=512", "train.global_batch=4"]


def small_recipe(*extra):
    return get_recipe("tiny", SMALL_LLAMA + list(extra))


# The update in the next forward pass for two activation plans, not all six: `make test` stays under
# 15 minutes, and the tests read only these (test_the_update_in_the_next_forward_is_priced...).
IN_FORWARD_PLANS = ("recompute_all", "offload_inputs")


def in_forward_compiled(candidate) -> bool:
    """Whether the module's plan compiles this next_forward candidate: the two plans above, the whole state and
    pending gradients in host memory (the ones in HBM are compiled by tests/recipes/plan/test_host_params_aot.py;
    host:L, the non-stacked leaves' state in HBM, is compiled for an H200 by benchmarks/gpu_suite.py --predict)."""
    return (candidate.activations in IN_FORWARD_PLANS and candidate.pending_gradients == "host"
            and candidate.optimizer_state == "host")


@pytest.fixture(scope="module")
def small_plan():
    """Every candidate compiled (prune=False): the tests below read the rows of all placements."""
    todo = [c for c in plan_candidates.candidates(small_recipe())
            if c.update != NEXT_FORWARD or in_forward_compiled(c)]
    return planner.plan(small_recipe(), "h200", 1, prune=False, plans=todo)


def rows_by_key(result):
    """(activations, optimizer state as the table names it) -> row, for the plans that update after the backward
    pass."""
    return {(row.candidate.activations, row.candidate.state_word): row for row in result.rows
            if row.candidate.update == AFTER_BACKWARD}


@pytest.mark.slow  # reads the module's small_plan (16 compiles, 1-4 minutes on 2 cores): `make test-slow` (CI: .venv-jax011's slow step)
def test_the_update_in_the_next_forward_is_priced_in_the_forward_pass(small_plan):
    """host_in_fwd rows: the compiled step moves the stacked leaves' state in the forward pass, both
    directions at once, and the price follows those bytes. The oracle is the bytes of the model's shapes:
    per stacked element fp32 mu and nu, plus an fp32 master for bf16 weights (the fp32 norm scales keep
    none), in and out again, and the pending gradient (the weight's dtype) in; the next layer is fetched one
    layer ahead, so the last one may be fetched twice. (The phase formulas themselves: test_cost_model.py.)"""
    recipe, link = small_plan.recipe, small_plan.target.host_link_bytes_per_s
    model = nnx.eval_shape(lambda: recipe.build_model(nnx.Rngs(0)))
    variables = jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))
    stacked = [v.get_value() for v in variables if v.get_metadata()["logical_axes"][0] == names.LAYERS]
    state = sum(x.size * (12 if x.dtype == jnp.bfloat16 else 8) for x in stacked)
    pending = sum(x.size * x.dtype.itemsize for x in stacked)
    layers = recipe.model.num_layers
    after = rows_by_key(small_plan)
    for row in small_plan.rows:
        if row.candidate.update != NEXT_FORWARD:
            continue
        moved, overlapped = row.report["transfer_bytes_by_pass"], row.report["overlapped_bytes_by_pass"]
        forward, backward = moved["forward"], moved["backward"]
        assert state + pending <= forward["host_to_device_bytes"], row.candidate.label
        if not row.candidate.offloads_activations:
            assert forward["host_to_device_bytes"] <= (state + pending) * (layers + 1) / layers, row.candidate.label
        assert forward["device_to_host_bytes"] >= state and backward["device_to_host_bytes"] >= pending
        assert overlapped["forward"] > 0, row.candidate.label
        # Both directions busy at once: the forward phase takes at least the larger direction's time, and
        # at most its compute (at the measured efficiency) and both directions added (what the schedule
        # runs beside a matmul hides under the compute: cost_model.beside_compute).
        forward_compute = row.flops["forward"] / compute_model.effective_flops_per_s(
            small_plan.target.peak_bf16_flops, "flash")
        assert row.forward_s >= forward["host_to_device_bytes"] / link * (1 - 1e-9), row.candidate.label
        assert row.forward_s <= (forward_compute + (forward["host_to_device_bytes"]
                                                    + forward["device_to_host_bytes"]) / link) * (1 + 1e-9)
        streamed = after[row.candidate.activations, "host"]
        assert row.update_s < streamed.update_s / 2, row.candidate.label
        assert row.compute_s == pytest.approx(streamed.compute_s)


# --- candidates and inputs (no compile) ---------------------------------------------

def test_candidates_are_every_preset_and_mix_times_both_state_placements():
    recipe = small_recipe()
    plans = plan_candidates.candidates(recipe)
    activations = {c.activations for c in plans}
    assert set(plan_candidates.PRESET_PLANS) <= activations
    assert {"offload_dots:2,recompute_all", "save_dots:2,recompute_all"} <= activations
    in_forward = [c for c in plans if c.update == NEXT_FORWARD]
    # By hand, for this 4-layer model with one batch per step: 6 presets and 2 mixes over the first 2 layers
    # are 8 activation plans, each with the state on device and on host (16); the host CPU's update for
    # recompute_all and offload_dots (18); the update in the next forward pass for the 6 presets with every
    # block layer's state on host and the rest in HBM (host:4), its pending gradients in host memory (24) and in
    # HBM (30), then the same with the whole state on host (42).
    assert len(plans) == len(set(plans)) == 42
    assert [c.placement_label for c in plans] == (
        ["optimizer_state=device"] * 8 + ["optimizer_state=host"] * 8
        + ["optimizer_state=host / update_on_host=true"] * 2
        + ["optimizer_state=host:4 / update=next_forward"] * 6
        + ["optimizer_state=host:4 / update=next_forward / pending_gradients=device"] * 6
        + ["optimizer_state=host / update=next_forward"] * 6
        + ["optimizer_state=host / update=next_forward / pending_gradients=device"] * 6)
    assert [c.activations for c in plans[:8]] == [
        "save_all", "recompute_all", "offload_inputs", "save_dots", "offload_dots", "save_qkv_offload_mlp",
        "offload_dots:2,recompute_all", "save_dots:2,recompute_all"]
    assert {c.activations for c in plans if c.update_on_host} == set(
        plan_candidates.HOST_COMPUTE_PLANS)
    # One batch per step: the host state's update in the next forward pass, for every single-policy plan.
    assert recipe.train.grad_accum == 1
    assert {(c.activations, c.optimizer_state, c.params, c.pending_gradients) for c in in_forward} == {
        (plan, state, "device", pending) for plan in plan_candidates.PRESET_PLANS for pending in ("host", "device")
        for state in ("host:4", "host")}
    # Each candidate is the recipe it trains: its --set line names the pending gradients where they differ.
    in_hbm = next(c for c in in_forward if c.pending_gradients == "device")
    assert "offload.pending_gradients=device" in in_hbm.set_arguments(recipe)
    assert plan_candidates.Candidate.of_recipe(in_hbm.applied_to(recipe)) == in_hbm
    assert plan_candidates.Candidate.from_dict(in_hbm.to_dict()) == in_hbm
    # The table tells the two placements apart in its update column.
    assert plan_render._settings_cells(in_hbm).split()[4:6] == ["next_forward", "pending=device"]
    # With micro-batches: the update in the next forward pass too, its pending gradients (the float32 running
    # sum) in HBM only; each is a recipe that passes its checks (dataclasses.replace runs them: ConfigError).
    accumulated = small_recipe("train.grad_accum=2")
    in_forward_accumulated = [c for c in plan_candidates.candidates(accumulated) if c.update == NEXT_FORWARD]
    assert {(c.activations, c.optimizer_state, c.pending_gradients) for c in in_forward_accumulated} == {
        (plan, state, "device") for plan in plan_candidates.PRESET_PLANS for state in ("host:4", "host")}
    for candidate in in_forward_accumulated:
        assert plan_candidates.Candidate.of_recipe(candidate.applied_to(accumulated)) == candidate
    for spec in activations:
        RematPlan.parse(spec).resolve(recipe.model.num_layers)   # all valid for the model
    assert set(plan_candidates.PRESET_PLANS) <= set(PRESETS)


def test_host_params_candidates_only_for_large_models_and_only_with_host_state():
    assert all(c.params == "device" for c in plan_candidates.candidates(small_recipe()))
    large = get_recipe("llama3_8b")
    host_params = [c for c in plan_candidates.candidates(large) if c.params == "host"]
    assert {c.state_word for c in host_params} == {"host", plan_candidates.HOST_COMPUTE}
    assert {c.activations for c in host_params} == set(plan_candidates.HOST_COMPUTE_PLANS)
    for c in host_params:   # each applies to a valid recipe (config checks host params need host state)
        applied = c.applied_to(large)
        assert applied.offload.params == "host" and applied.offload.optimizer_state == "host"
        assert Candidate.from_dict(c.to_dict()) == c
        assert c.label.endswith("/ params=host") and "host_compute" not in c.label


def run_cli(argv, capsys):
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_unknown_gpu_lists_the_known_ones(capsys):
    code, _, err = run_cli(["plan", "tiny", "--gpu", "rtx9090"], capsys)
    assert code == 2
    assert "unknown GPU target 'rtx9090'" in err and "h100" in err and "h200" in err


def test_recipe_that_does_not_build_gives_the_config_error(capsys):
    code, _, err = run_cli(["plan", "tiny", "--gpu", "h200", "--set", "model.num_heads=5"], capsys)
    assert code == 2
    assert "model.num_heads=5" in err and "num_heads (5) does not divide d_model (192)" in err


def test_mesh_that_does_not_match_the_devices_is_refused(capsys):
    code, _, err = run_cli(["plan", "tiny", "--devices", "2", "--set", "mesh.fsdp=1"], capsys)
    assert code == 2
    assert "needs 1 GPUs, but --devices is 2" in err
    code, _, err = run_cli(["plan", "tiny", "--devices", "3", "--set", "mesh.data=2"], capsys)
    assert code == 2 and "does not fit 3 GPUs" in err
    with pytest.raises(ValueError, match="must be divisible by the data x fsdp mesh size"):
        mesh_rules.resolve_mesh(small_recipe("train.global_batch=3"), 2)
    assert mesh_rules.resolve_mesh(small_recipe(), 4) == {"data": 1, "fsdp": 4, "tensor": 1}


def test_missing_plugin_names_the_install_command(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv(plugin.PLUGIN_DIR_ENV, str(tmp_path / "no-plugin-here"))
    code, _, err = run_cli(["plan", "tiny", "--gpu", "h200"], capsys)
    assert code == 2
    assert plugin.install_command_text() in err


def test_cudnn_attention_is_planned_with_flash_and_xla_warns():
    recipe, warnings = plan_candidates.planned_recipe(small_recipe("execution.attention_impl=cudnn"))
    assert recipe.execution.attention_impl == "flash" and "cuDNN" in warnings[0]
    recipe, warnings = plan_candidates.planned_recipe(small_recipe("execution.attention_impl=xla"))
    assert recipe.execution.attention_impl == "xla" and "materialises" in warnings[0]


# --- the compiled plans ------------------------------------------------------------------

@needs_toolchain
@pytest.mark.slow  # reads the module's small_plan (16 compiles, 1-4 minutes on 2 cores): `make test-slow` (CI: .venv-jax011's slow step)
def test_every_candidate_compiled_for_the_h200(small_plan):
    assert [row.candidate for row in small_plan.rows] == [
        c for c in plan_candidates.candidates(small_plan.recipe)
        if c.update != NEXT_FORWARD or in_forward_compiled(c)]
    for row in small_plan.rows:
        assert row.error is None, row.error
        assert row.report["device_kind"] == "NVIDIA H200 141GB HBM3e"
        assert row.attention_impl == "flash"


@needs_toolchain
@pytest.mark.slow  # reads the module's small_plan (16 compiles, 1-4 minutes on 2 cores): `make test-slow` (CI: .venv-jax011's slow step)
def test_offloading_plans_keep_activations_in_host_memory(small_plan):
    """The ground truth: S(5) buffers and host bytes for every plan that offloads, none otherwise."""
    for row in small_plan.rows:
        r = row.report
        if row.candidate.offloads_activations:
            assert r["host_buffer_count"] > 0, f"{row.candidate.label}: XLA dropped the offload"
            assert r["host_temp_bytes"] > 0, f"{row.candidate.label}: no activation in host memory"
            assert r["device_to_host_bytes"] > 0 and r["host_to_device_bytes"] > 0
            assert not row.dropped_offload
        elif not row.candidate.update_on_host:   # host compute has host temps
            assert r["host_temp_bytes"] == 0, row.candidate.label
        if row.candidate.optimizer_state == "host":
            assert r["host_argument_bytes"] > 0 and r["host_buffer_count"] > 0, row.candidate.label
        elif not row.candidate.offloads_activations:
            assert r["host_bytes"] == 0 and r["host_buffer_count"] == 0, row.candidate.label


@needs_toolchain
@pytest.mark.slow  # reads the module's small_plan (16 compiles, 1-4 minutes on 2 cores): `make test-slow` (CI: .venv-jax011's slow step)
def test_hbm_orders_as_the_policies_say(small_plan):
    rows = rows_by_key(small_plan)
    hbm = {key: row.report["hbm_bytes"] for key, row in rows.items()}
    for state in MEMORIES:
        assert hbm["offload_dots", state] <= hbm["save_dots", state]
        assert hbm["recompute_all", state] < hbm["save_all", state]
        assert hbm["save_dots", state] < hbm["save_all", state]
    for plan in plan_candidates.activation_plans(small_plan.recipe.model.num_layers):
        assert hbm[plan, "host"] < hbm[plan, "device"], plan


@needs_toolchain
@pytest.mark.slow  # reads the module's small_plan (16 compiles, 1-4 minutes on 2 cores): `make test-slow` (CI: .venv-jax011's slow step)
def test_transfers_and_times(small_plan):
    """Times against quantities computed here from the model's shapes, not against the planner's own formula.

    Optimizer state in host memory: fp32 mu and nu, plus an fp32 master copy of each bf16 parameter
    (the norm scales are fp32 and need none); the update moves all of it in and back out, and what the
    compiled schedule moves in both directions at once (the streamed write-back beside the next
    prefetch) is still counted twice: the H200's link measured taking turns (GpuTarget.host_link_duplex;
    the credit on a duplex link: test_cost_model.py). offload_inputs sends each layer's bf16 block input [batch, seq, d_model]
    to host in the forward pass and back in the backward; with this small model the host link, not the
    GPU, sets both phases' time.
    """
    recipe, target = small_plan.recipe, small_plan.target
    # compute at the efficiency measured for the blockwise kernel (recipes/plan/compute_model.py)
    link, rate = target.host_link_bytes_per_s, compute_model.effective_flops_per_s(target.peak_bf16_flops, "flash")
    model = nnx.eval_shape(lambda: recipe.build_model(nnx.Rngs(0)))
    state_bytes = sum(x.size * (12 if x.dtype == jnp.bfloat16 else 8)
                      for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    block_inputs_bytes = recipe.model.num_layers * 4 * 512 * recipe.model.d_model * 2
    rows = rows_by_key(small_plan)
    for (plan, state), row in rows.items():
        if state == plan_candidates.HOST_COMPUTE:
            continue   # priced by the host update rate: test_host_compute_plans_pay_the_host_cpu
        r = row.report
        overlapped = r["overlapped_transfer_bytes"]
        assert 0 <= overlapped <= min(r["device_to_host_bytes"], r["host_to_device_bytes"])
        expected_flops = flops.train_step_flops(recipe.decoder_spec(), 4, 512, remat=plan)
        assert row.compute_s == pytest.approx(expected_flops.total / rate)
        assert not target.host_link_duplex
        assert row.transfer_s == pytest.approx((r["device_to_host_bytes"] + r["host_to_device_bytes"]) / link)
        if state == "host":
            # In and out, the directions taking turns: two crossings of the state.
            assert row.update_s == pytest.approx(2 * state_bytes / link, rel=1e-3), plan
            # The stacked layers' state (most of it) is scheduled with both link directions busy at once
            # (reported, not credited).
            assert overlapped > 0, plan
        else:
            assert row.update_s == 0.0
        assert row.step_s >= row.compute_s * (1 - 1e-9)
        if row.candidate.no_offload:
            assert row.step_s == pytest.approx(row.compute_s)
        if state == "host":
            assert r["host_argument_bytes"] == state_bytes
            assert r["host_to_device_bytes"] >= state_bytes and r["device_to_host_bytes"] >= state_bytes
    counted = flops.train_step_flops(recipe.decoder_spec(), 4, 512, remat="offload_inputs")
    # Each phase takes the longer of its compute (at the measured efficiency) and its block-input transfers.
    forward = max(counted.forward / rate, block_inputs_bytes / link)
    backward = max((counted.backward + counted.recompute) / rate, block_inputs_bytes / link)
    for state in ("device", "host"):
        row = rows["offload_inputs", state]
        assert row.forward_s == pytest.approx(forward)
        assert row.backward_s == pytest.approx(backward)
        assert row.step_s == pytest.approx(forward + backward + row.update_s)
    assert rows["recompute_all", "device"].flops["recompute"] > rows["save_dots", "device"].flops["recompute"]
    assert rows["save_all", "device"].flops["recompute"] == 0


@needs_toolchain
@pytest.mark.slow  # reads the module's small_plan (16 compiles, 1-4 minutes on 2 cores): `make test-slow` (CI: .venv-jax011's slow step)
def test_host_compute_plans_pay_the_host_cpu(small_plan):
    """State on the host, updated by its CPU: no state in HBM, the update priced at the host's rate."""
    rows = rows_by_key(small_plan)
    link = small_plan.target.host_link_bytes_per_s
    pricing = small_plan.host_update
    per_second = pricing["params_per_s_per_core"] * pricing["cores_per_gpu"]
    n = small_plan.recipe.num_params()
    # recompute_all offloads no activation: all the compiled step moves is the update's
    # (gradients out, and the fp32 norm scales, which have no master copy; parameters back).
    only_update = rows["recompute_all", plan_candidates.HOST_COMPUTE].report
    update_bytes = only_update["device_to_host_bytes"] + only_update["host_to_device_bytes"]
    assert update_bytes == pytest.approx(4 * n, rel=0.01)   # bf16: 2 bytes out, 2 back per parameter
    for plan in plan_candidates.HOST_COMPUTE_PLANS:
        row = rows[plan, plan_candidates.HOST_COMPUTE]
        assert row.report["hbm_bytes"] < rows[plan, "device"].report["hbm_bytes"], plan
        assert row.update_s == pytest.approx(update_bytes / link + n / per_second)
    # a faster host makes the same plan faster
    faster = cost_model.plan_row(rows["recompute_all", plan_candidates.HOST_COMPUTE].candidate,
                          {"report": rows["recompute_all", plan_candidates.HOST_COMPUTE].report},
                          small_plan.recipe, small_plan.target, small_plan.mesh, 10 * per_second)
    assert faster.update_s < rows["recompute_all", plan_candidates.HOST_COMPUTE].update_s


@needs_toolchain
@pytest.mark.slow  # reads the module's small_plan (16 compiles, 1-4 minutes on 2 cores): `make test-slow` (CI: .venv-jax011's slow step)
def test_pick_fits_and_is_the_fastest_that_fits(small_plan):
    picked = small_plan.picked
    assert picked is not None and picked.fits
    assert sum(row.pick for row in small_plan.rows) == 1
    assert picked.step_s == min(row.step_s for row in small_plan.rows if row.fits)
    assert all(row.report["hbm_bytes"] <= small_plan.hbm_limit_bytes for row in small_plan.rows if row.fits)


@needs_toolchain
@pytest.mark.slow  # reads the module's small_plan (16 compiles, 1-4 minutes on 2 cores): `make test-slow` (CI: .venv-jax011's slow step)
def test_nothing_fits_under_a_tiny_headroom_and_the_message_has_numbers(small_plan):
    smallest = min(row.report["hbm_bytes"] for row in small_plan.rows)
    tight = small_plan.rejudged(headroom=smallest * 0.5 / small_plan.target.hbm_bytes)
    assert tight.picked is None and not any(row.fits for row in tight.rows)
    with pytest.raises(ValueError, match=r"no offload plan fits .* smallest HBM is \d+\.\d+ GiB") as error:
        plan_result.choose(tight)
    assert f"{smallest / 2**30:.2f} GiB" in str(error.value)
    # Host RAM is a limit too: with almost none nothing fits (every run has a process, and its checkpoint
    # save copies what it saves into host memory: recipes/plan/host_peak.py), and each refusal names its phase.
    no_host = small_plan.rejudged(host_ram_bytes=1)
    assert not any(row.fits for row in no_host.rows)
    assert all(re.search(r"host \S+ GiB at [a-z ]+ > 0.0 GiB", row.why_not) for row in no_host.rows if row.report)


@needs_toolchain
@pytest.mark.slow  # reads the module's small_plan (16 compiles, 1-4 minutes on 2 cores): `make test-slow` (CI: .venv-jax011's slow step)
def test_cli_table_and_json_show_every_plan(small_plan, monkeypatch, capsys):
    monkeypatch.setattr(commands, "plan", lambda *args, **kwargs: small_plan)
    code, out, _ = run_cli(["plan", "tiny", "--gpu", "h200"], capsys)
    assert code == 0
    lines = out.splitlines()
    for row in small_plan.rows:
        settings = row.candidate.settings()
        table_order = ("offload.activations", "offload.optimizer_state", "offload.params",
                       "optimizer.update_on_host", "offload.update")   # the table's plan/state/params/upd_on_host/update
        assert any(line[2:].split()[:5] == [settings[field] for field in table_order]
                   for line in lines), row.candidate.label
    assert "host_compute" not in out
    assert sum(line.startswith("* ") for line in lines) == 1
    assert "H200" in out and "tokens/step" in out and "attention flash" in out
    assert "the overlapped bytes count once only on a duplex link" in out
    assert "directions taking turns" in out   # the rates line: no shipped target is duplex

    code, out, _ = run_cli(["plan", "tiny", "--gpu", "h200", "--json"], capsys)
    document = json.loads(out)
    assert code == 0
    assert [(p["plan"], p["optimizer_state"]) for p in document["plans"]] == [
        (row.candidate.activations, row.candidate.optimizer_state) for row in small_plan.rows]
    assert Candidate.from_dict(document["pick"]) == small_plan.picked.candidate
    assert document["pick"]["train_command"].startswith("spillway train tiny")
    assert document["summary"]["params"] == small_plan.recipe.model.num_params()
    assert document["summary"]["tokens_per_step"] == 4 * 512
    for key in ("hbm_bytes", "host_bytes", "transfer_s", "compute_s", "step_s", "fits"):
        assert all(key in p for p in document["plans"])


@needs_toolchain
@pytest.mark.slow  # reads the module's small_plan (16 compiles, 1-4 minutes on 2 cores): `make test-slow` (CI: .venv-jax011's slow step)
def test_apply_plan_applies_the_pick_or_refuses(small_plan, monkeypatch):
    calls = []

    def replay(recipe, gpu, devices, **kwargs):
        calls.append((gpu, devices, kwargs))
        return small_plan
    monkeypatch.setattr(commands, "plan", replay)
    recipe = small_recipe()
    planned = commands.apply_plan(recipe, "auto", gpu="h200", devices=1, echo=lambda *a: None)
    assert planned.offload.activations == small_plan.picked.candidate.activations
    assert planned.offload.optimizer_state == small_plan.picked.candidate.optimizer_state
    assert planned.model == recipe.model and planned.data == recipe.data
    assert calls[0][:2] == ("h200", 1)

    tight = small_plan.rejudged(headroom=1e-6)
    monkeypatch.setattr(commands, "plan", lambda *args, **kwargs: tight)
    with pytest.raises(ValueError, match=r"no offload plan fits .*GiB"):
        commands.apply_plan(recipe, "auto", gpu="h200", devices=1)


@needs_toolchain
@pytest.mark.slow  # in `make test-slow` (CI runs it): minutes on 2 cores
def test_per_gpu_activation_memory_stays_flat_as_gpus_and_batch_grow():
    """One sequence per GPU: per-GPU activation bytes must not grow with the GPU count.

    Regression: without activation sharding constraints XLA copied the
    weights' layout (embed split over fsdp) onto the activations, so each GPU
    held a d_model slice of the whole global batch and temp grew ~linearly
    with the device count (save_all 819 GiB per GPU planned for 8 H100s).
    """
    plans = [Candidate.of("save_all", "device"), Candidate.of("offload_dots", "device")]
    per_gpu = {}
    for devices in (2, 8):
        result = planner.plan(small_recipe("model.d_model=512", "model.num_heads=8", "model.num_kv_heads=8",
                                           f"train.global_batch={devices}", "data.seq_len=1024"),
                              "h100", devices, plans=plans)
        per_gpu[devices] = {row.candidate.activations: row.report for row in result.rows}
    for activations in ("save_all", "offload_dots"):
        two, eight = per_gpu[2][activations], per_gpu[8][activations]
        assert eight["temp_bytes"] <= 1.2 * two["temp_bytes"], (activations, two["temp_bytes"], eight["temp_bytes"])
    assert per_gpu[8]["offload_dots"]["host_bytes"] <= 1.05 * per_gpu[2]["offload_dots"]["host_bytes"]
    assert per_gpu[8]["offload_dots"]["host_bytes"] > 0


def test_a_mesh_that_cannot_split_the_model_is_refused_before_any_compile(monkeypatch, capsys):
    """3 GPUs for a 4096-wide model: the weights would be replicated while compute counted as split."""
    def no_compiles(*args, **kwargs):
        raise AssertionError("nothing may be compiled for a mesh that cannot split the model")
    monkeypatch.setattr(scheduler, "run_children", no_compiles)
    eight_b = get_recipe("llama3_8b", ["train.global_batch=3", "train.grad_accum=1"])
    with pytest.raises(ValueError, match=r"mesh.fsdp=3 does not divide embed \(4096\)\. \d+ weights \([\d.]+ GiB\) "
                                         r"would be replicated"):
        planner.plan(eight_b, "h200", 3)
    tensor = get_recipe("llama3_8b", ["mesh.fsdp=1", "mesh.tensor=3"])
    with pytest.raises(ValueError, match=r"mesh.tensor=3 does not divide heads \(32\), kv_heads \(8\), "
                                         r"mlp \(14336\)"):
        planner.plan(tensor, "h200", 3)
    code, _, err = run_cli(["plan", "llama3_8b", "--devices", "3", "--set", "train.global_batch=3",
                            "--set", "train.grad_accum=1"], capsys)
    assert code == 2 and err.count("\n") == 1 and "does not divide embed (4096)" in err
    # What divides plans: fsdp=4 and tensor=2 both divide every dimension they shard.
    assert mesh_rules.check_sharding(get_recipe("llama3_8b", ["mesh.fsdp=4", "mesh.tensor=2"]),
                                  {"data": 1, "fsdp": 4, "tensor": 2}) is None


def test_a_micro_batch_the_batch_axes_cannot_split_is_refused():
    with pytest.raises(ValueError, match=r"a micro-batch of 2 sequences .* cannot be split over the data x fsdp "
                                         r"mesh size \(4\)"):
        mesh_rules.resolve_mesh(small_recipe("train.global_batch=8", "train.grad_accum=4"), 4)
    assert mesh_rules.resolve_mesh(small_recipe("train.global_batch=8", "train.grad_accum=2"), 4)["fsdp"] == 4


def test_candidates_split_over_compile_processes_come_back_in_order(monkeypatch):
    """`_run_children` deals candidates round-robin and merges answers as one process would give them."""
    seen = []

    def fake_child(request, on_progress=None):
        seen.append([c["activations"] for c in request["candidates"]])
        names = [c["activations"] for c in request["candidates"]]
        return {"jax_version": "x", "device_kind": "k", "mesh": {}, "setup_seconds": 0.0, "seconds": len(names),
                "startup_seconds": 0.5, "results": [{"report": {"name": n}} for n in names],
                "full_codegen": {str(j): {"report": {"name": n}} for j in request["verify_full_codegen"]
                                 for n in [names[j]]},
                "searches": [{"best": n} for n in names]}

    monkeypatch.setattr(workers, "run_child", fake_child)
    names = [f"plan{i}" for i in range(7)]
    request = {"candidates": [{"activations": n, "optimizer_state": "device"} for n in names],
               "verify_full_codegen": [0, 1, 4], "search": {"axis": "seq_len"}}
    merged = workers.run_children(request, workers=3)
    assert sorted(map(tuple, seen)) == [("plan0", "plan3", "plan6"), ("plan1", "plan4"), ("plan2", "plan5")]
    assert [r["report"]["name"] for r in merged["results"]] == names
    assert [s["best"] for s in merged["searches"]] == names
    assert {k: v["report"]["name"] for k, v in merged["full_codegen"].items()} == {
        "0": "plan0", "1": "plan1", "4": "plan4"}
    assert merged["seconds"] == 3
    assert workers.run_children(request, workers=1)["results"] == merged["results"]
    assert workers.default_workers(1) == 1


def test_workers_below_one_are_refused(monkeypatch):
    monkeypatch.setattr(planner, "check_toolchain", lambda: None)
    with pytest.raises(ValueError, match="--workers must be at least 1"):
        planner.plan(small_recipe(), "h200", 1, workers=0)


class _LoweredThatLacksALevel0Kernel:
    """A lowered step whose compile fails as jaxlib 0.11's does for some GEMMs at autotune level 0."""

    def __init__(self, message="INTERNAL: No supported config found for HLO: %gemm_fusion_dot.65 = ..."):
        self.message, self.levels = message, []

    def compile(self, compiler_options=None):
        level = (compiler_options or {}).get("xla_gpu_autotune_level")
        self.levels.append(level)
        if level == 0:
            raise RuntimeError(self.message)
        return f"compiled at level {level}"


def test_a_gemm_without_a_level_0_kernel_is_compiled_again_at_level_1(monkeypatch):
    from spillway.recipes.plan import child

    monkeypatch.setattr(child, "_AUTOTUNE_LEVEL_1", False)
    options = {"xla_backend_optimization_level": 0, "xla_gpu_autotune_level": 0}
    other = _LoweredThatLacksALevel0Kernel("RESOURCE_EXHAUSTED: out of memory")
    with pytest.raises(RuntimeError, match="out of memory"):     # any other failure is the candidate's own
        child.compile_lowered(other, options)
    assert other.levels == [0]
    lowered = _LoweredThatLacksALevel0Kernel()
    assert child.compile_lowered(lowered, options) == "compiled at level 1"
    assert lowered.levels == [0, 1] and options["xla_gpu_autotune_level"] == 0   # caller's dict untouched
    later = _LoweredThatLacksALevel0Kernel()
    assert child.compile_lowered(later, options) == "compiled at level 1"
    assert later.levels == [1]                                   # the process remembers: no level-0 attempt
    full = _LoweredThatLacksALevel0Kernel()
    assert child.compile_lowered(full, None) == "compiled at level None"   # a full compile is left alone


@pytest.mark.slow
@needs_toolchain
def test_fast_codegen_gives_the_same_memory_figures():
    """The planner skips LLVM optimisation and ptxas: memory must be what a full compile says."""
    recipe = small_recipe()
    result = planner.plan(recipe, "h200", 1, plans=[Candidate.of("offload_dots", "host")],
                          verify_full_codegen=1)
    (check,) = result.full_codegen_check
    assert check["fast"] == check["full"]


@pytest.mark.slow
@needs_toolchain
def test_seq_len_search_finds_the_boundary():
    recipe = small_recipe("data.seq_len=256", "model.max_seq_len=8192")
    plans = [Candidate.of("save_all", "device"), Candidate.of("offload_dots", "host")]
    result = planner.plan(recipe, "h200", 1, plans=plans, search="seq_len", headroom=0.002)
    found = {r["activations"]: r for r in result.search["results"]}
    assert found["offload_dots"]["best"] > found["save_all"]["best"]
    for r in found.values():
        assert r["resolved"]
        points = {int(k): v for k, v in r["points"].items()}
        assert points[r["best"]]["fits"]
        if r["first_fail"] is not None:
            assert not points[r["first_fail"]]["fits"] and r["first_fail"] - r["best"] == result.search["step"]


def test_a_plan_with_an_unknown_params_placement_is_refused_by_name():
    # A candidate is the offload section it stands for: the section's own check refuses it.
    with pytest.raises(ValueError, match=r"offload.params must be one of \('device', 'host', 'experts'\) or a split "
                                         r"host:N / host:F / experts:N / experts:F, got 'gpu'"):
        Candidate.of("recompute_all", "host", "gpu")


def test_weights_on_device_add_no_parameter_traffic():
    assert cost_model.param_traffic(Candidate.of("save_all", "host"), small_recipe(),
                                 {"data": 1, "fsdp": 1, "tensor": 1}) == cost_model.ParamTraffic()


# --- search logic (synthetic HBM curves, no compile) ----------------------------------

@pytest.mark.parametrize("curve", ["affine", "convex", "step", "concave"])
@pytest.mark.parametrize("boundary", [700, 5000, 9000, 49_999, 200_000])
def test_search_is_exact_and_bounded(curve, boundary):
    shapes = {"affine": lambda s: 1e6 + 2e3 * s,
              "convex": lambda s: 1e6 + 2e3 * s + 0.05 * s * s,
              "step": lambda s: 1e6 + 2e3 * s + (3e7 if s > 30_000 else 0),
              "concave": lambda s: 1e6 + 6e5 * s ** 0.5}
    hbm = shapes[curve]
    limit = hbm(boundary)
    measured = []

    def measure(value):
        measured.append(value)
        return {"hbm_bytes": hbm(value), "host_bytes": 0}

    result = search_one(measure, 8192, measure(8192), {"hbm_bytes": limit, "host_bytes_per_device": 1},
                        step=1024, cap=131072, max_compiles=10)
    truth = max((v for v in range(1024, 131073, 1024) if hbm(v) <= limit), default=None)
    assert result["best"] == truth and result["resolved"]
    assert result["compiles"] == len(measured) - 1 <= 10
    assert all(v % 1024 == 0 for v in measured)
    assert result["at_cap"] == (truth == 131072)


def test_search_reports_compile_errors_and_stops():
    def measure(value):
        if value > 10_000:
            raise RuntimeError("compiler fell over")
        return {"hbm_bytes": value, "host_bytes": 0}

    result = search_one(measure, 8192, measure(8192), {"hbm_bytes": 1e9, "host_bytes_per_device": 1},
                        step=1024, cap=131072, max_compiles=10)
    assert result["best"] == 8192 and not result["resolved"]
    assert "compiler fell over" in result["errors"][0]


# --- pruning: plans that cannot beat one that fits are not compiled ------------------

def _fitting_row(candidate, fits):
    row = plan_result.PlanRow(candidate, "flash", None, None, {}, compute_s=1.0, compile_s=0.0)
    row.fits = fits
    return row


def test_a_plan_is_skipped_only_for_the_same_activations_with_less_in_host_memory_that_fits():
    todo = plan_candidates.candidates(small_recipe())
    index = {c: i for i, c in enumerate(todo)}
    device = Candidate.of("recompute_all", "device")
    host = Candidate.of("recompute_all", "host")
    host_params = Candidate.of("recompute_all", "host", "host")
    host_cpu_params = Candidate.of("recompute_all", "host", "host", update_on_host=True)
    # Nothing compiled yet, or the device plan does not fit: compile.
    assert pruning.faster_plan_that_fits(host, todo, {}, []) is None
    assert pruning.faster_plan_that_fits(host, todo, {index[device]: _fitting_row(device, False)}, []) is None
    # Another activation plan fitting on device says nothing about this one.
    other = Candidate.of("save_all", "device")
    assert pruning.faster_plan_that_fits(host, todo, {index[other]: _fitting_row(other, True)}, []) is None
    rows = {index[device]: _fitting_row(device, True)}
    assert pruning.faster_plan_that_fits(host, todo, rows, []) == device.label
    assert pruning.faster_plan_that_fits(host_params, todo, rows, []) == device.label
    # Weights on host after the state on host fits (device did not): skipped for the host-state plan.
    rows = {index[device]: _fitting_row(device, False), index[host]: _fitting_row(host, True)}
    assert pruning.faster_plan_that_fits(host_params, todo, rows, []) == host.label
    # ...but not the host-CPU-update plan with weights on host, whose own ancestor did not fit.
    assert pruning.faster_plan_that_fits(host_cpu_params, todo, rows, []) is None
    skipped = [{**host.to_dict(), "label": host.label, "because": device.label}]
    assert pruning.faster_plan_that_fits(host_params, todo, {}, skipped) == device.label
    # The update in the next forward pass with its pending gradients on host, after the same with them in HBM
    # fits (fewer host bytes, no gradient over the link, the same compute); not before, nor when it does not fit.
    in_hbm = Candidate.of("recompute_all", "host", "device", "next_forward", pending_gradients="device")
    on_host = Candidate.of("recompute_all", "host", "device", "next_forward")
    assert pruning.faster_plan_that_fits(in_hbm, todo, {}, []) is None
    assert pruning.faster_plan_that_fits(on_host, todo, {index[in_hbm]: _fitting_row(in_hbm, False)}, []) is None
    assert pruning.faster_plan_that_fits(on_host, todo, {index[in_hbm]: _fitting_row(in_hbm, True)}, []) == \
        in_hbm.label
    # The whole state on host after host:L (the embedding's and head's state in HBM, nothing else moved) fits.
    every_layer = Candidate.of("recompute_all", "host:4", "device", "next_forward", pending_gradients="device")
    assert pruning.faster_plan_that_fits(in_hbm, todo, {index[every_layer]: _fitting_row(every_layer, False)},
                                         []) is None
    assert pruning.faster_plan_that_fits(in_hbm, todo, {index[every_layer]: _fitting_row(every_layer, True)},
                                         []) == every_layer.label
    # Stages hold the plans that the plans before them decide (a small model has no weights-on-host stage): the
    # state on device; on host after the backward pass, and host:L updated in the next forward pass with the
    # pending gradients in HBM; then the host CPU's update, host:L with them on host, and the whole state on
    # host with them in HBM; last the whole state on host with them on host.
    deferred = lambda c, state, pending: (c.update, c.optimizer_state, c.pending_gradients) == (  # noqa: E731
        "next_forward", state, pending)
    assert [[todo[i] for i in stage] for stage in pruning.stages(todo)] == [
        [c for c in todo if c.optimizer_state == "device"],
        [c for c in todo if (c.optimizer_state == "host" and c.update == "after_backward" and not c.update_on_host)
         or deferred(c, "host:4", "device")],
        [c for c in todo if c.update_on_host or deferred(c, "host:4", "host") or deferred(c, "host", "device")],
        [c for c in todo if deferred(c, "host", "host")]]


def _row_with_step(candidate, fits, step_s, compute_s=1.0):
    row = _fitting_row(candidate, fits)
    row.compute_s = compute_s
    row.forward_s, row.backward_s, row.update_s = compute_s, 0.0, step_s - compute_s
    return row


def test_a_host_cpu_update_is_skipped_when_the_streamed_update_beats_its_cpu_time_alone():
    todo = plan_candidates.candidates(small_recipe())
    index = {c: i for i, c in enumerate(todo)}
    streamed = Candidate.of("recompute_all", "host")
    host_cpu = Candidate.of("recompute_all", "host", update_on_host=True)
    # The streamed plan takes 1.5 s with 1 s of compute: a host CPU needing 0.6 s for the update alone
    # cannot beat it, one needing 0.4 s might.
    rows = {index[streamed]: _row_with_step(streamed, True, 1.5)}
    assert pruning.faster_plan_that_fits(host_cpu, todo, rows, [], host_update_floor_s=0.6) == streamed.label
    assert pruning.faster_plan_that_fits(host_cpu, todo, rows, [], host_update_floor_s=0.4) is None
    # Without the rate, or when the streamed plan does not fit (the host CPU's may, with less HBM): compile.
    assert pruning.faster_plan_that_fits(host_cpu, todo, rows, []) is None
    rows = {index[streamed]: _row_with_step(streamed, False, 1.5)}
    assert pruning.faster_plan_that_fits(host_cpu, todo, rows, [], host_update_floor_s=0.6) is None
    # With the weights on host the streamed plan with the weights on host is the one compared.
    host_cpu_params = Candidate.of("recompute_all", "host", "host", update_on_host=True)
    streamed_params = Candidate.of("recompute_all", "host", "host")
    todo = todo + [c for c in (streamed_params, host_cpu_params) if c not in index]   # a small model has none
    index = {c: i for i, c in enumerate(todo)}
    rows = {index[streamed]: _row_with_step(streamed, False, 1.5),
            index[streamed_params]: _row_with_step(streamed_params, True, 1.5)}
    assert pruning.faster_plan_that_fits(host_cpu_params, todo, rows, [],
                                          host_update_floor_s=0.6) == streamed_params.label


@pytest.mark.slow  # an end-to-end run of 107 s on 2 cores: `make test-slow` (CI: .venv-jax011's slow step), keeping `make test` near 12 minutes
@needs_toolchain
def test_pruned_plan_compiles_less_and_picks_the_same(small_plan):
    pruned = planner.plan(small_recipe(), "h200", 1)
    assert pruned.picked.candidate == small_plan.picked.candidate
    assert len(pruned.rows) + len(pruned.skipped) == len(plan_candidates.candidates(small_recipe()))
    assert pruned.skipped and pruned.timing["compiles"] == len(pruned.rows) < len(small_plan.rows)
    full = {row.candidate: row for row in small_plan.rows}
    for entry in pruned.skipped:   # what was skipped is really no faster than what it was skipped for
        skipped = full.get(Candidate.from_dict(entry))
        if entry.get("cannot_fit"):   # its bounds ruled it out before compiling: the exhaustive row agrees
            assert skipped is None or not skipped.fits
            continue
        if skipped is None:
            continue   # not compiled in small_plan either (IN_FORWARD_PLANS)
        because = next(row for row in small_plan.rows if row.candidate.label == entry["because"])
        assert because.fits and skipped.step_s >= because.step_s
    assert "not compiled (" in plan_render.render(pruned)
