"""The planner's host figure is the peak over a run's phases (recipes/plan/host_peak.py): judged on plan rows
made by hand (no compile), and the per-GPU phases of a candidate from its abstract setup."""

import dataclasses

import jax

from spillway.layers.mesh import MeshConfig
from spillway.layers.sharding import make_mesh
from spillway.recipes.plan import host_peak
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.plan.result import Plan, PlanRow
from spillway.recipes.targets import get_target
from spillway.recipes.registry import get_recipe
from spillway.recipes.train.host_memory import (ASSUMED_GPU_FOOTPRINT_BYTES, PIECES_STAGING_BYTES,
                                               RESTORE_STAGING_BYTES, HostPhases)

GiB = 2**30


def row_with_phases(activations, state, step_ms, phases: HostPhases | None, host_gib=0.0):
    report = {"hbm_bytes": 20 * GiB, "temp_bytes": GiB, "host_bytes": host_gib * GiB, "host_temp_bytes": 0,
              "host_buffer_count": 0, "device_to_host_bytes": 0, "host_to_device_bytes": 0}
    if phases is not None:
        report["host_phases"] = phases.to_dict()
    row = PlanRow(Candidate.of(activations, state), "flash", report, None, {}, compute_s=0.0,
                          compile_s=0.0)
    row.forward_s, row.backward_s, row.update_s = step_ms / 1e3, 0.0, 0.0
    return row


def eight_b_like(**overrides):
    # One H200's share of an 8B run with host state: 90 GiB of state, 78 of it halved, 15 GiB of bf16 weights.
    base = dict(footprint=0, state=90 * GiB, halved=78 * GiB, weights=0, pending=0, step_host=90 * GiB,
                saved_device=15 * GiB, saved_host=90 * GiB)
    return HostPhases(**{**base, **overrides})


def plan_of(rows, host_ram_gib, devices=1):
    return Plan(get_recipe("tiny"), get_target("h200"), devices, {"data": devices}, 0.9, host_ram_gib * GiB,
                        rows, [], None, {}).judge()


def test_a_plan_whose_save_does_not_fit_the_hosts_ram_is_refused_naming_the_phase():
    """orbax's whole save (the halves joined, everything copied) does not fit 128 GiB; the save in pieces does,
    and then the save and the restore (in pieces both) peak alike."""
    whole = [row_with_phases("recompute_all", "host", 100.0, eight_b_like(save_in_pieces=False), host_gib=90.0),
             row_with_phases("save_dots", "device", 150.0, eight_b_like(state=0, halved=0, step_host=0, saved_host=0,
                                                                       saved_device=105 * GiB, save_in_pieces=False))]
    plan = plan_of(whole, 128)
    host_row, device_row = plan.rows
    # 90 state + 78 halves joined + orbax: 2 x 15 + 90, + the process's assumed footprint
    expected = (90 + 78 + 30 + 90) * GiB + ASSUMED_GPU_FOOTPRINT_BYTES
    assert host_row.why_not == f"host {expected / GiB:.1f} GiB at checkpoint save > 128.0 GiB"
    assert not host_row.fits and device_row.fits is False     # the device plan's save stages 2 x 105 GiB
    assert PlanRow.to_dict(host_row, 1)["host_peak"] == {"phase": "checkpoint save", "bytes": expected}

    in_pieces = [row_with_phases("recompute_all", "host", 100.0, eight_b_like(), host_gib=90.0),
                 row_with_phases("save_dots", "device", 150.0, eight_b_like(state=0, halved=0, step_host=0,
                                                                           saved_host=0, saved_device=105 * GiB))]
    plan = plan_of(in_pieces, 128)
    assert all(row.fits for row in plan.rows) and plan.picked.candidate.activations == "recompute_all"
    restore = 90 * GiB + RESTORE_STAGING_BYTES + ASSUMED_GPU_FOOTPRINT_BYTES
    assert PlanRow.to_dict(plan.rows[0], 1)["host_peak"] == {"phase": "checkpoint save", "bytes": restore}
    save = HostPhases.from_dict(in_pieces[0].report["host_phases"]).by_phase()["checkpoint save"]
    assert save == 90 * GiB + PIECES_STAGING_BYTES      # the state and the pieces in flight
    tight = plan_of(in_pieces, 96)
    assert tight.rows[0].why_not == f"host {restore / GiB:.1f} GiB at checkpoint save > 96.0 GiB"


def test_the_peak_of_a_host_counts_every_gpus_share_and_the_process_once():
    phases = eight_b_like(state=10 * GiB, halved=8 * GiB, step_host=10 * GiB, saved_device=2 * GiB,
                          saved_host=10 * GiB, save_in_pieces=False)
    report = {"host_bytes": 10 * GiB, "host_phases": phases.to_dict()}
    phase, peak = host_peak.host_peak(report, devices=8)
    assert phase == "checkpoint save"
    assert peak == 8 * (10 + 8 + 4 + 10) * GiB + ASSUMED_GPU_FOOTPRINT_BYTES
    # in pieces: one process writes every GPU's share, a piece at a time: the pieces counted once
    pieces = host_peak.host_phases({"host_phases": dataclasses.replace(phases, save_in_pieces=True).to_dict()}, 8)
    assert pieces.by_phase()["checkpoint save"] == 80 * GiB + PIECES_STAGING_BYTES + ASSUMED_GPU_FOOTPRINT_BYTES


def test_reports_without_phases_fall_back_to_the_steps_host_bytes():
    assert host_peak.host_peak({"host_bytes": 5 * GiB}, devices=4) == ("step", 20 * GiB)


def test_a_candidates_phases_are_one_gpus_share():
    """On 8 (CPU stand-in) devices with fsdp 8 each GPU holds an eighth of the host state..."""
    recipe = get_recipe("tiny", ["offload.optimizer_state=host", "model.d_model=64", "model.num_heads=4",
                                 "model.num_kv_heads=2", "model.vocab_size=256", "model.mlp_hidden=128"])
    one = host_peak.phases_of_candidate(recipe, make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1]), step_host_bytes=0)
    eight = host_peak.phases_of_candidate(recipe, make_mesh(MeshConfig(1, 8, 1), devices=jax.devices()[:8]), step_host_bytes=0)
    assert one["state"] == 8 * recipe.num_params()
    # ... except the norm scales (two per layer and the final one, d_model wide), which stay whole.
    norm_state = (2 * recipe.model.num_layers + 1) * recipe.model.d_model * 8
    assert eight["state"] == (one["state"] - norm_state) // 8 + norm_state
    assert dataclasses.asdict(HostPhases.from_dict(one))["state"] == one["state"]


def test_plans_refused_before_compiling_are_named_with_their_phase_not_as_failed_compiles():
    """A host too small for any plan's save: the planner compiles nothing; the table says why each was refused
    (the phase and the bytes), not "every compile failed" nor that a faster plan fits."""
    from spillway.recipes.plan.render import render
    because = "cannot fit: host 6.5 GiB at checkpoint save > 0.0 GiB, whatever the step holds"
    refused = [{**Candidate.of(activations, "host").to_dict(), "label": f"{activations} / optimizer_state=host",
                "because": because, "cannot_fit": True} for activations in ("save_all", "recompute_all")]
    plan = Plan(get_recipe("tiny"), get_target("h200"), 1, {"data": 1}, 0.9, 0.01 * GiB, [], [], None,
                {"jax_version": "test", "compiles": 0, "total_s": 1.0, "workers": 1, "child_startup_s": 0.0},
                skipped=refused).judge()
    text = render(plan)
    assert f"no plan fits: every plan was refused before compiling (e.g. save_all / optimizer_state=host: {because})" \
        in text
    assert ("not compiled (2), as they cannot fit whatever their step holds: save_all / optimizer_state=host "
            "(host 6.5 GiB at checkpoint save > 0.0 GiB); recompute_all") in text
    assert "every compile failed" not in text and "at least as fast" not in text


def test_nothing_fits_exits_2_after_the_table_and_names_the_hosts_ram_where_hbm_holds_a_plan(monkeypatch, capsys):
    """A new user's findings: `spillway plan` with no pick exited 0 (only --hbm-budget made it an error), and
    where every plan fit HBM but not the host, the line blamed HBM and advised a smaller batch."""
    from types import SimpleNamespace

    from spillway.recipes import cli
    from spillway.recipes.plan import commands
    from spillway.recipes.plan.host_peak import over
    from spillway.recipes.plan.result import nothing_fits_numbers

    because = "cannot fit: host 6.5 GiB at checkpoint save > 0.0 GiB, whatever the step holds"
    refused = [{**Candidate.of("save_all", "host").to_dict(), "label": "save_all / optimizer_state=host",
                "because": because, "cannot_fit": True}]
    plan = Plan(get_recipe("tiny"), get_target("h200"), 1, {"data": 1}, 0.9, 0.01 * GiB, [], [], None,
                {"jax_version": "test", "compiles": 0, "total_s": 1.0, "workers": 1, "child_startup_s": 0.0},
                skipped=refused).judge()
    monkeypatch.setattr(commands, "plan", lambda *args, **kwargs: plan)
    assert cli.main(["plan", "tiny"]) == 2
    captured = capsys.readouterr()
    assert "no plan fits" in captured.out   # the table first
    assert captured.err.startswith("spillway plan: error: no offload plan fits") and len(captured.err.splitlines()) == 1

    def row(label, hbm, host):
        return SimpleNamespace(report={"hbm_bytes": hbm, "host_bytes": host}, candidate=SimpleNamespace(label=label))
    fake = SimpleNamespace(rows=[row("save_all", 0.2 * GiB, 9 * GiB), row("recompute_all", 0.1 * GiB, 7 * GiB)],
                           skipped=[], hbm_limit_bytes=100 * GiB, devices=1, host_ram_bytes=1 * GiB,
                           host_ram_given=False)
    said = nothing_fits_numbers(fake)
    assert said.startswith("2 plan(s) fit HBM, but none the host's RAM: the least host memory is 7.00 GiB at step "
                           "(recompute_all) against 1.00 GiB") and "give the machine's RAM with --host-ram-gb" in said
    fake.host_ram_given = True   # given already: the advice to give it misled
    assert nothing_fits_numbers(fake).endswith("against 1.00 GiB of host RAM (--host-ram-gb); plan for a host "
                                               "with more")
    assert over(0.0867 * GiB, 0.05 * GiB) == "0.09 > 0.05 GiB"   # one decimal said "0.1 > 0.1 GiB"
    assert over(1.25 * GiB, 1.2 * GiB) == "1.25 > 1.20 GiB" and over(80 * GiB, 71.2 * GiB) == "80.00 > 71.20 GiB"
    assert over(0.27 * GiB, 0.1 * GiB) == "0.27 > 0.10 GiB"   # as the table shows it (it said "0.3 > 0.1")
    assert over(0.10003 * GiB, 0.1 * GiB) == "0.10003 > 0.10000 GiB"   # three decimals said "0.100 > 0.100"
    assert over(GiB + 1, GiB) == f"{GiB + 1} > {GiB} bytes"
    assert over(2**20, 1000) == "1.00 > 0.00 MiB"


def test_no_plan_fits_names_the_plans_the_hosts_ram_refused_before_compiling():
    """A new user's finding: llama3_1b (2 layers) on an L4 under --hbm-budget 5 --host-ram-gb 10 said only "the
    smallest HBM is 5.57 GiB (...host:2 / update=next_forward...); reduce data.seq_len or train.global_batch":
    the plans with the whole state on host, 2.67 GiB of HBM, had been refused before compiling for the host's
    RAM (10.8 GiB at a checkpoint save), which no smaller batch helps."""
    from types import SimpleNamespace

    from spillway.recipes.plan.result import nothing_fits_numbers

    def refusal(label, because):
        return {"label": label, "because": f"cannot fit: {because}", "cannot_fit": True}
    hbm = refusal("save_all / optimizer_state=device", "its weights and optimizer state in HBM alone are 5.01 GiB > "
                                                       "5.00 GiB")
    ram = refusal("save_all / optimizer_state=host", "host 10.8 GiB at checkpoint save > 9.3 GiB, whatever the step "
                                                     "holds")
    compiled = SimpleNamespace(report={"hbm_bytes": 5.57 * GiB, "host_bytes": 1.59 * GiB},
                               candidate=SimpleNamespace(label="recompute_all / optimizer_state=host:2"))
    fake = SimpleNamespace(rows=[compiled], skipped=[hbm, ram], hbm_limit_bytes=5 * GiB, devices=1,
                           host_ram_bytes=9.3 * GiB, host_ram_given=True, headroom=0.9, hbm_budget_bytes=5 * GiB,
                           target=get_target("l4"))
    said = nothing_fits_numbers(fake)
    assert said.startswith("the smallest HBM is 5.57 GiB (recompute_all / optimizer_state=host:2, host 1.59 GiB)")
    assert ("; 1 other plan(s) were not compiled, as the host's RAM cannot hold them (e.g. save_all / "
            "optimizer_state=host: host 10.8 GiB at checkpoint save > 9.3 GiB); reduce data.seq_len") in said
    assert said.endswith("or use more GPUs, or plan for a host with more RAM")
    fake.skipped = [hbm]   # refused for HBM alone: the line as it was
    assert "not compiled" not in nothing_fits_numbers(fake)
    assert nothing_fits_numbers(fake).endswith("or use more GPUs")


def test_the_search_table_says_which_plans_had_their_offload_dropped():
    """A new user's finding: `--search seq_len` listed a plan the table above refused (its offload dropped by
    XLA) as fitting at the cap, 1.0x the best without offload, with no word of it."""
    from types import SimpleNamespace

    from spillway.recipes.plan.render import render_search

    dropped = Candidate.of("offload_dots:1,recompute_all", "device")
    kept = Candidate.of("recompute_all", "device")
    rows = [SimpleNamespace(candidate=dropped, report={"host_buffer_count": 0, "host_temp_bytes": 0}),
            SimpleNamespace(candidate=kept, report={"host_buffer_count": 0, "host_temp_bytes": 0})]
    results = [{**c.to_dict(), "best": 128, "at_cap": True, "resolved": True, "errors": [], "compiles": 1,
                "seconds": 1.0} for c in (dropped, kept)]
    lines = render_search(SimpleNamespace(rows=rows, search={"axis": "seq_len", "step": 64, "cap": 128,
                                                             "results": results}))
    (dropped_line,) = [line for line in lines if "offload_dots:1" in line]
    assert "offload dropped in the compiled step" in dropped_line
    assert not any("offload dropped" in line for line in lines if line.lstrip().startswith("recompute_all"))


def test_the_search_tables_columns_line_up_whatever_the_labels_length():
    """A new user's finding: the --search table's columns were 36 and 44 characters wide, so a longer activation
    plan or split placement pushed that row's figures out from under their header."""
    from types import SimpleNamespace

    from spillway.recipes.plan.render import render_search

    short = Candidate.of("recompute_all", "device")
    long = Candidate.of("save_qkv_offload_mlp:12,offload_dots:20,recompute_all", "host:7",
                        params="host:3", params_keep=2)
    results = [{**c.to_dict(), "best": best, "at_cap": False, "resolved": True, "errors": [], "compiles": 3,
                "seconds": 1.5} for c, best in ((short, 2048), (long, 16384))]
    lines = render_search(SimpleNamespace(rows=[], search={"axis": "seq_len", "step": 64, "cap": 32768,
                                                           "results": results}))
    header = next(line for line in lines if "settings" in line)
    figures_end = header.index("seq_len") + len("seq_len")
    rows = [line for line in lines if "recompute_all" in line]
    assert len(rows) == 2
    for line, best in zip(rows, ("2048", "16384")):
        assert line[:figures_end].endswith(best), (header, line)


def test_a_shape_the_compiler_rejects_in_every_plan_stops_the_plan_in_one_line():
    """A new user's finding: d_model 72 made every compile fail with XLA's "Couldn't find output tile sizes",
    42 candidates and five minutes on, then "no plan fits". The same error in a whole stage stops it."""
    from types import SimpleNamespace

    import pytest

    from spillway.recipes.plan.planner import SAME_FAILURE_ROWS, _refuse_a_shape_no_plan_compiles

    def failed(n):
        return SimpleNamespace(error=f"JaxRuntimeError: INTERNAL: Couldn't find output tile sizes that satisfy hlo: "
                                     f"%dot.{n} = f32[2048,72]{{1,0}} dot(...)\nmore lines")
    with pytest.raises(ValueError, match=r"every plan compiled \(4\) failed with the same compiler error.*tile sizes"):
        _refuse_a_shape_no_plan_compiles([failed(n) for n in range(SAME_FAILURE_ROWS)])
    _refuse_a_shape_no_plan_compiles([failed(n) for n in range(SAME_FAILURE_ROWS - 1)])   # too few to tell
    _refuse_a_shape_no_plan_compiles([failed(1), failed(2), failed(3), SimpleNamespace(error=None)])   # one compiled
    _refuse_a_shape_no_plan_compiles([failed(1), failed(2), failed(3), SimpleNamespace(error="out of memory")])


def test_the_same_compiler_error_under_other_op_names_stops_the_plan_too():
    """A new user's finding: qwen3_moe_tiny on an A100 failed every compile with one "Couldn't find output tile
    sizes" (its [2048, 192] f32 dot), 50 candidates and eight minutes on: the op name in the error's metadata
    says "checkpoint" under a remat plan and not under save_all, so no two stages' errors looked the same."""
    from types import SimpleNamespace

    import pytest

    from spillway.recipes.plan.planner import _refuse_a_shape_no_plan_compiles

    def failed(n, scope):
        return SimpleNamespace(error=f"JaxRuntimeError: INTERNAL: Couldn't find output tile sizes that satisfy hlo: "
                                     f"%dot.{n} = f32[2048,192]{{1,0}} dot(%bitcast.{n}, %parameter_1.13), "
                                     f"lhs_contracting_dims={{1}}, rhs_contracting_dims={{1}}, metadata={{op_name="
                                     f"\"jit(train_step)/transpose(jvp())/while/body/closed_call/{scope}btd,dnh->btnh/"
                                     f"dot_general\" stack_frame_id={n}}}, backend_config={{\"sizes\":[\"{n}\"]}}\n"
                                     f"more lines")
    with pytest.raises(ValueError, match=r"every plan compiled \(4\) failed with the same compiler error.*tile sizes"):
        _refuse_a_shape_no_plan_compiles([failed(334, ""), failed(365, "checkpoint/"), failed(369, "checkpoint/"),
                                          failed(329, "checkpoint/")])
    other = SimpleNamespace(error="JaxRuntimeError: INTERNAL: Couldn't find output tile sizes that satisfy hlo: "
                                  "%dot.1 = f32[2048,72]{1,0} dot(%a, %b)")   # another instruction: not the same
    _refuse_a_shape_no_plan_compiles([failed(334, ""), failed(365, "checkpoint/"), failed(369, ""), other])


def test_a_refusal_before_compiling_tells_its_two_sizes_apart():
    """A new user's finding: --hbm-budget 0.01 on the tiny recipe said "in HBM alone are 0.0 GiB > 0.0 GiB"."""
    from spillway.recipes.plan.pruning import refusal_before_compile

    bounds = {"device_argument_bytes": 0.0123 * GiB, "host_phases": None}
    assert refusal_before_compile(bounds, 0.01 * GiB, 1, 100 * GiB) == \
        "cannot fit: its weights and optimizer state in HBM alone are 0.012 GiB > 0.010 GiB"
