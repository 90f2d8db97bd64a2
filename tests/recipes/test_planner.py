"""`spillway plan`: the train step of a small scanned Llama compiled for an H200 without a GPU.

One module fixture runs the planner once over every candidate plan (16
compiles in one compile process, about a minute on 2 cores); every test that
needs compiled figures reads that result, and the CLI tests replay it through
`plan_command` / `apply_plan` without compiling again. The rest (FLOP counts,
the seq_len search logic, input errors) needs no GPU compiler.

Ground truth for offload (DESIGN.md section 3): an offloading plan must show
activations in host memory in the compiled step (S(5) buffers and host temp
bytes). A preset that XLA silently dropped fails here.

Skipped only where the CUDA toolkit's ptxas/libdevice is missing; a missing
plugin fails with the install command (`make test` installs it).
"""

import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from spillway.layers import names
from spillway.layers.execution import Execution
from spillway.layers.offload import PRESETS, OffloadPolicy, RematPlan
from spillway.models.llama import Llama, llama_config
from spillway.recipes import cli
from spillway.recipes.plan import flops, planner
from spillway.recipes.plan import plugin
from spillway.recipes.plan.child import search_one
from spillway.recipes.registry import get_recipe
from spillway.recipes.train.step import make_loss_fn

needs_toolchain = pytest.mark.skipif(plugin.cuda_toolkit_missing_reason() is not None,
                                     reason=f"no CUDA toolkit: {plugin.cuda_toolkit_missing_reason()}")

# A Llama small enough to compile fast, with activations and optimizer state of
# comparable size (tens of MB each), so that both kinds of offload show.
SMALL_LLAMA = ["model.num_layers=4", "model.d_model=256", "model.num_heads=4", "model.num_kv_heads=2",
               "model.mlp_hidden=1024", "model.vocab_size=1024", "model.max_seq_len=1024",
               "execution.dtype=bfloat16", "execution.param_dtype=bfloat16", "execution.attention_impl=flash",
               "execution.flash_block_size=128", "data.seq_len=512", "train.global_batch=4"]


def small_recipe(*extra):
    return get_recipe("tiny", SMALL_LLAMA + list(extra))


@pytest.fixture(scope="module")
def small_plan():
    reason = plugin.plugin_missing_reason()
    if reason is not None:
        pytest.fail(f"deviceless GPU compile tests need the compiler plugin: {reason}")
    return planner.plan(small_recipe(), "h200", 1)


def rows_by_key(result):
    return {(row.candidate.activations, row.candidate.optimizer_state): row for row in result.rows}


# --- candidates and inputs (no compile) ---------------------------------------------

def test_candidates_are_every_preset_and_mix_times_both_state_placements():
    recipe = small_recipe()
    plans = planner.candidates(recipe)
    activations = {c.activations for c in plans}
    assert set(planner.PRESET_PLANS) <= activations
    assert {"offload_dots:2,recompute_all", "save_dots:2,recompute_all"} <= activations
    assert len(plans) == len(activations) * 2 + len(planner.HOST_COMPUTE_PLANS) == len(set(plans))
    assert {c.activations for c in plans if c.optimizer_state == planner.HOST_COMPUTE} == set(
        planner.HOST_COMPUTE_PLANS)
    for spec in activations:
        RematPlan.parse(spec).resolve(recipe.model.num_layers)   # all valid for the model
    assert set(planner.PRESET_PLANS) <= set(PRESETS)


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
        planner.resolve_mesh(small_recipe("train.global_batch=3"), 2)
    assert planner.resolve_mesh(small_recipe(), 4) == {"data": 1, "fsdp": 4, "tensor": 1}


def test_missing_plugin_names_the_install_command(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv(plugin.PLUGIN_DIR_ENV, str(tmp_path / "no-plugin-here"))
    code, _, err = run_cli(["plan", "tiny", "--gpu", "h200"], capsys)
    assert code == 2
    assert plugin.install_command_text() in err


def test_cudnn_attention_is_planned_with_flash_and_xla_warns():
    recipe, warnings = planner.planned_recipe(small_recipe("execution.attention_impl=cudnn"))
    assert recipe.execution.attention_impl == "flash" and "cuDNN" in warnings[0]
    recipe, warnings = planner.planned_recipe(small_recipe("execution.attention_impl=xla"))
    assert recipe.execution.attention_impl == "xla" and "materialises" in warnings[0]


# --- the compiled plans ------------------------------------------------------------------

@needs_toolchain
def test_every_candidate_compiled_for_the_h200(small_plan):
    assert [row.candidate for row in small_plan.rows] == planner.candidates(small_plan.recipe)
    for row in small_plan.rows:
        assert row.error is None, row.error
        assert row.report["device_kind"] == "NVIDIA H200 141GB HBM3e"
        assert row.attention_impl == "flash"


@needs_toolchain
def test_offloading_plans_keep_activations_in_host_memory(small_plan):
    """The ground truth: S(5) buffers and host bytes for every plan that offloads, none otherwise."""
    for row in small_plan.rows:
        r = row.report
        if row.candidate.offloads_activations:
            assert r["host_buffer_count"] > 0, f"{row.candidate.label}: XLA dropped the offload"
            assert r["host_temp_bytes"] > 0, f"{row.candidate.label}: no activation in host memory"
            assert r["device_to_host_bytes"] > 0 and r["host_to_device_bytes"] > 0
            assert not row.dropped_offload
        elif row.candidate.optimizer_state != planner.HOST_COMPUTE:   # host compute has host temps
            assert r["host_temp_bytes"] == 0, row.candidate.label
        if row.candidate.optimizer_state in ("host", planner.HOST_COMPUTE):
            assert r["host_argument_bytes"] > 0 and r["host_buffer_count"] > 0, row.candidate.label
        elif not row.candidate.offloads_activations:
            assert r["host_bytes"] == 0 and r["host_buffer_count"] == 0, row.candidate.label


@needs_toolchain
def test_hbm_orders_as_the_policies_say(small_plan):
    rows = rows_by_key(small_plan)
    hbm = {key: row.report["hbm_bytes"] for key, row in rows.items()}
    for state in planner.OPTIMIZER_STATES:
        assert hbm["offload_dots", state] <= hbm["save_dots", state]
        assert hbm["recompute_all", state] < hbm["save_all", state]
        assert hbm["save_dots", state] < hbm["save_all", state]
    for plan in planner.activation_plans(small_plan.recipe.model.num_layers):
        assert hbm[plan, "host"] < hbm[plan, "device"], plan


@needs_toolchain
def test_transfers_and_times(small_plan):
    link, rate = small_plan.target.host_link_bytes_per_s, small_plan.target.peak_bf16_flops
    for row in small_plan.rows:
        if row.candidate.optimizer_state == planner.HOST_COMPUTE:
            continue   # priced by the host update rate: test_host_compute_plans_pay_the_host_cpu
        r = row.report
        to_host, from_host = r["device_to_host_bytes"], r["host_to_device_bytes"]
        overlapped = r["overlapped_transfer_bytes"]
        assert 0 <= overlapped <= min(to_host, from_host)
        assert row.transfer_s == pytest.approx((to_host + from_host - overlapped) / link)
        expected = flops.train_step_flops(small_plan.recipe.decoder_spec(), 4, 512, remat=row.candidate.activations)
        assert row.flops["total"] == pytest.approx(expected.total)
        # Phases: activations leave in the forward and come back in the backward, each phase
        # as slow as the slower of its compute and its transfers; the host state's copies
        # in and out form the update, with nothing to hide behind; what the compiled schedule
        # moves in both directions at once is counted once.
        state = r["host_argument_bytes"] if row.candidate.optimizer_state == "host" else 0
        assert row.forward_s == pytest.approx(max(expected.forward / rate, (to_host - state) / link))
        assert row.backward_s == pytest.approx(
            max((expected.backward + expected.recompute) / rate, (from_host - state) / link))
        assert row.update_s == pytest.approx((2 * state - min(overlapped, state)) / link)
        assert row.step_s == pytest.approx(row.forward_s + row.backward_s + row.update_s)
        assert row.step_s >= row.compute_s * (1 - 1e-9)
        if row.candidate.no_offload:
            assert row.step_s == pytest.approx(row.compute_s)
    rows = rows_by_key(small_plan)
    # Optimizer state in host memory: fp32 mu and nu, plus an fp32 master copy of each bf16
    # parameter (the norm scales are fp32 and need none). It all crosses the link both ways.
    model = nnx.eval_shape(lambda: small_plan.recipe.build_model(nnx.Rngs(0)))
    state_bytes = sum(x.size * (12 if x.dtype == jnp.bfloat16 else 8)
                      for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    for plan in planner.activation_plans(small_plan.recipe.model.num_layers):
        report = rows[plan, "host"].report
        assert report["host_argument_bytes"] == state_bytes
        assert report["host_to_device_bytes"] >= state_bytes and report["device_to_host_bytes"] >= state_bytes
        # The stacked layers' state (most of it) streams with both link directions busy at once.
        assert report["overlapped_transfer_bytes"] > 0, plan
        assert rows[plan, "host"].update_s < 2 * state_bytes / link, plan
    assert rows["recompute_all", "device"].flops["recompute"] > rows["save_dots", "device"].flops["recompute"]
    assert rows["save_all", "device"].flops["recompute"] == 0


@needs_toolchain
def test_host_compute_plans_pay_the_host_cpu(small_plan):
    """State on the host, updated by its CPU: no state in HBM, the update priced at the host's rate."""
    rows = rows_by_key(small_plan)
    link = small_plan.target.host_link_bytes_per_s
    pricing = small_plan.host_update
    per_second = pricing["params_per_s_per_core"] * pricing["cores_per_gpu"]
    n = small_plan.recipe.num_params()
    for plan in planner.HOST_COMPUTE_PLANS:
        row = rows[plan, planner.HOST_COMPUTE]
        assert row.report["hbm_bytes"] < rows[plan, "device"].report["hbm_bytes"], plan
        # bf16 weights with fp32 masters: bf16 gradients go out, bf16 parameters come back
        assert row.update_s == pytest.approx((2 * n + 2 * n) / link + n / per_second)
    # a faster host makes the same plan faster
    faster = planner._row(rows["recompute_all", planner.HOST_COMPUTE].candidate,
                          {"report": rows["recompute_all", planner.HOST_COMPUTE].report},
                          small_plan.recipe, small_plan.target, 1, 10 * per_second)
    assert faster.update_s < rows["recompute_all", planner.HOST_COMPUTE].update_s


@needs_toolchain
def test_pick_fits_and_is_the_fastest_that_fits(small_plan):
    picked = small_plan.picked
    assert picked is not None and picked.fits
    assert sum(row.pick for row in small_plan.rows) == 1
    assert picked.step_s == min(row.step_s for row in small_plan.rows if row.fits)
    assert all(row.report["hbm_bytes"] <= small_plan.hbm_limit_bytes for row in small_plan.rows if row.fits)


@needs_toolchain
def test_nothing_fits_under_a_tiny_headroom_and_the_message_has_numbers(small_plan):
    smallest = min(row.report["hbm_bytes"] for row in small_plan.rows)
    tight = small_plan.rejudged(headroom=smallest * 0.5 / small_plan.target.hbm_bytes)
    assert tight.picked is None and not any(row.fits for row in tight.rows)
    with pytest.raises(ValueError, match=r"no offload plan fits .* smallest HBM is \d+\.\d+ GiB") as error:
        planner.choose(tight)
    assert f"{smallest / 2**30:.2f} GiB" in str(error.value)
    # Host RAM is a limit too: with almost none, only plans without host memory fit.
    no_host = small_plan.rejudged(host_ram_bytes=1)
    assert {row.candidate.no_offload for row in no_host.rows if row.fits} == {True}


@needs_toolchain
def test_cli_table_and_json_show_every_plan(small_plan, monkeypatch, capsys):
    monkeypatch.setattr(planner, "plan", lambda *args, **kwargs: small_plan)
    code, out, _ = run_cli(["plan", "tiny", "--gpu", "h200"], capsys)
    assert code == 0
    lines = out.splitlines()
    for row in small_plan.rows:
        assert any(line[2:].split()[:2] == [row.candidate.activations, row.candidate.optimizer_state]
                   for line in lines), row.candidate.label
    assert sum(line.startswith("* ") for line in lines) == 1
    assert "H200" in out and "tokens/step" in out and "attention flash" in out
    assert "the overlapped bytes are not counted twice" in out

    code, out, _ = run_cli(["plan", "tiny", "--gpu", "h200", "--json"], capsys)
    document = json.loads(out)
    assert code == 0
    assert [(p["plan"], p["optimizer_state"]) for p in document["plans"]] == [
        (row.candidate.activations, row.candidate.optimizer_state) for row in small_plan.rows]
    assert document["pick"] == small_plan.picked.candidate.to_dict()
    assert document["summary"]["params"] == small_plan.recipe.model.num_params()
    assert document["summary"]["tokens_per_step"] == 4 * 512
    for key in ("hbm_bytes", "host_bytes", "transfer_s", "compute_s", "step_s", "fits"):
        assert all(key in p for p in document["plans"])


@needs_toolchain
def test_apply_plan_applies_the_pick_or_refuses(small_plan, monkeypatch):
    calls = []

    def replay(recipe, gpu, devices, **kwargs):
        calls.append((gpu, devices, kwargs))
        return small_plan
    monkeypatch.setattr(planner, "plan", replay)
    recipe = small_recipe()
    planned = planner.apply_plan(recipe, "auto", gpu="h200", devices=1, echo=lambda *a: None)
    assert planned.offload.activations == small_plan.picked.candidate.activations
    assert planned.offload.optimizer_state == small_plan.picked.candidate.optimizer_state
    assert planned.model == recipe.model and planned.data == recipe.data
    assert calls[0][:2] == ("h200", 1)

    tight = small_plan.rejudged(headroom=1e-6)
    monkeypatch.setattr(planner, "plan", lambda *args, **kwargs: tight)
    with pytest.raises(ValueError, match=r"no offload plan fits .*GiB"):
        planner.apply_plan(recipe, "auto", gpu="h200", devices=1)


@needs_toolchain
def test_per_gpu_activation_memory_stays_flat_as_gpus_and_batch_grow():
    """One sequence per GPU: per-GPU activation bytes must not grow with the GPU count.

    Regression: without activation sharding constraints XLA copied the
    weights' layout (embed split over fsdp) onto the activations, so each GPU
    held a d_model slice of the whole global batch and temp grew ~linearly
    with the device count (save_all 819 GiB per GPU planned for 8 H100s).
    """
    plans = [planner.Candidate("save_all", "device"), planner.Candidate("offload_dots", "device")]
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


def test_candidates_split_over_compile_processes_come_back_in_order(monkeypatch):
    """`_run_children` deals candidates round-robin and merges answers as one process would give them."""
    seen = []

    def fake_child(request):
        seen.append([c["activations"] for c in request["candidates"]])
        names = [c["activations"] for c in request["candidates"]]
        return {"jax_version": "x", "device_kind": "k", "mesh": {}, "setup_seconds": 0.0, "seconds": len(names),
                "startup_seconds": 0.5, "results": [{"report": {"name": n}} for n in names],
                "full_codegen": {str(j): {"report": {"name": n}} for j in request["verify_full_codegen"]
                                 for n in [names[j]]},
                "searches": [{"best": n} for n in names]}

    monkeypatch.setattr(planner, "_run_child", fake_child)
    names = [f"plan{i}" for i in range(7)]
    request = {"candidates": [{"activations": n, "optimizer_state": "device"} for n in names],
               "verify_full_codegen": [0, 1, 4], "search": {"axis": "seq_len"}}
    merged = planner._run_children(request, workers=3)
    assert sorted(map(tuple, seen)) == [("plan0", "plan3", "plan6"), ("plan1", "plan4"), ("plan2", "plan5")]
    assert [r["report"]["name"] for r in merged["results"]] == names
    assert [s["best"] for s in merged["searches"]] == names
    assert {k: v["report"]["name"] for k, v in merged["full_codegen"].items()} == {
        "0": "plan0", "1": "plan1", "4": "plan4"}
    assert merged["seconds"] == 3
    assert planner._run_children(request, workers=1)["results"] == merged["results"]
    assert planner.default_workers(1) == 1


def test_workers_below_one_are_refused(monkeypatch):
    monkeypatch.setattr(planner, "_check_toolchain", lambda: None)
    with pytest.raises(ValueError, match="--workers must be at least 1"):
        planner.plan(small_recipe(), "h200", 1, workers=0)


@pytest.mark.slow
@needs_toolchain
def test_fast_codegen_gives_the_same_memory_figures():
    """The planner skips LLVM optimisation and ptxas: memory must be what a full compile says."""
    recipe = small_recipe()
    result = planner.plan(recipe, "h200", 1, plans=[planner.Candidate("offload_dots", "host")],
                          verify_full_codegen=1)
    (check,) = result.full_codegen_check
    assert check["fast"] == check["full"]


@pytest.mark.slow
@needs_toolchain
def test_seq_len_search_finds_the_boundary():
    recipe = small_recipe("data.seq_len=256", "model.max_seq_len=8192")
    plans = [planner.Candidate("save_all", "device"), planner.Candidate("offload_dots", "host")]
    result = planner.plan(recipe, "h200", 1, plans=plans, search="seq_len", headroom=0.002)
    found = {r["activations"]: r for r in result.search["results"]}
    assert found["offload_dots"]["best"] > found["save_all"]["best"]
    for r in found.values():
        assert r["resolved"]
        points = {int(k): v for k, v in r["points"].items()}
        assert points[r["best"]]["fits"]
        if r["first_fail"] is not None:
            assert not points[r["first_fail"]]["fits"] and r["first_fail"] - r["best"] == result.search["step"]


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


# --- FLOP count against XLA's own ------------------------------------------------------

@pytest.mark.parametrize("remat", ["save_all", "recompute_all"])
def test_flop_count_matches_xla_cost_analysis_on_cpu(remat):
    """recipes/plan/flops.py against `cost_analysis()['flops']` of the CPU compile, within 2%.

    One layer: XLA's cost analysis counts a while loop's body once, whatever its
    trip count, so a scanned stack of L layers would read as one. Dense ("xla")
    attention, whose every (query, key) pair XLA multiplies. The rest of the
    difference is elementwise work flops.py leaves out (norms, RoPE, SiLU,
    softmax, the loss): 0.7-0.9% here.
    """
    cfg = llama_config("tiny", vocab_size=512, d_model=256, num_layers=1, num_heads=4, num_kv_heads=2,
                       mlp_hidden=768, max_seq_len=256)
    execution = Execution(dtype="float32", attention_impl="xla")
    spec = cfg.decoder_spec(execution)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Llama(cfg, execution, rngs=nnx.Rngs(0), remat=remat)))
    batch, seq = 2, 128
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
    loss_fn = make_loss_fn(graphdef)
    forward_xla = jax.jit(loss_fn).lower(params, tokens).compile().cost_analysis()["flops"]
    step_xla = jax.jit(jax.value_and_grad(loss_fn)).lower(params, tokens).compile().cost_analysis()["flops"]

    counted = flops.train_step_flops(spec, batch, seq, remat=remat, attention_impl="xla")
    assert counted.forward == flops.forward_flops(spec, batch, seq, attention="full")
    assert forward_xla == pytest.approx(counted.forward, rel=0.02)
    assert step_xla == pytest.approx(counted.total, rel=0.02)
    assert (counted.recompute > 0) == (remat == "recompute_all")


def test_recompute_follows_what_the_policy_keeps():
    spec = llama_config("llama3_1_8b").decoder_spec(Execution(attention_impl="flash"))
    layer = flops.layer_flops(spec, 1, 8192)
    per_layer = {name: flops.recompute_per_layer(PRESETS[name], layer, "flash") for name in PRESETS}
    assert per_layer["save_all"] == 0
    # recompute_all re-runs the block forward except the down projection (its output is never read back).
    assert per_layer["recompute_all"] == pytest.approx(layer.total - layer.mlp_out)
    assert per_layer["offload_inputs"] == per_layer["recompute_all"]
    # The dot presets keep every matmul output and the flash kernel's o and logsumexp
    # (both tagged ATTN_CONTEXT): no product is recomputed.
    assert per_layer["save_dots"] == per_layer["offload_dots"] == 0
    # Without ATTN_CONTEXT the kernel's forward re-runs in the backward pass.
    keep_qkv_only = OffloadPolicy.of({names.QKV: "device"})
    assert flops.recompute_per_layer(keep_qkv_only, layer, "flash") == pytest.approx(
        layer.attention + layer.attn_out + layer.mlp_hidden)
    assert flops.attention_pairs(8, causal=True) == 36 and flops.attention_pairs(8, causal=False) == 64
    assert flops.attention_pairs(8, sliding_window=3) == 6 + 5 * 3
    assert names.MLP_OUT in names.DOT_NAMES
