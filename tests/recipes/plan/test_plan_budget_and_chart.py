"""`spillway plan --hbm-budget` and `--png` on plan tables made by hand: no compile needed.

The rows stand in for compiled candidates (their reports hold only the fields
the judging and the drawing read), so these tests check the choice under a
budget, its error, and the drawn file, in a second.
"""

import types

import pytest

from spillway.recipes import cli
from spillway.recipes.plan import commands, planner
from spillway.recipes.plan import result as plan_result
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.registry import get_recipe
from spillway.recipes.targets import get_target

GiB = 2**30


def fake_row(activations, state, hbm_gib, step_ms, host_gib=0.0, temp_gib=1.0):
    report = {"hbm_bytes": hbm_gib * GiB, "temp_bytes": temp_gib * GiB, "host_bytes": host_gib * GiB,
              "host_temp_bytes": host_gib * GiB, "host_buffer_count": 1 if host_gib else 0,
              "device_to_host_bytes": host_gib * GiB, "host_to_device_bytes": host_gib * GiB}
    row = plan_result.PlanRow(Candidate.of(activations, state), "flash", report, None, {}, compute_s=0.0,
                          compile_s=0.0)
    row.forward_s, row.backward_s, row.update_s = step_ms / 1e3, 0.0, 0.0
    return row


def fake_plan(budget_gib=None):
    rows = [fake_row("save_all", "device", 60.0, 100.0),
            fake_row("save_dots", "device", 40.0, 110.0),
            fake_row("offload_dots", "host", 20.0, 150.0, host_gib=50.0),
            fake_row("recompute_all", "host", 12.0, 180.0, host_gib=40.0)]
    return plan_result.Plan(get_recipe("tiny"), get_target("h200"), 1, {"data": 1}, 0.9, 512 * GiB, rows, [],
                        None, {"jax_version": "test", "compiles": 4, "total_s": 1.0, "workers": 1,
                               "child_startup_s": 0.0},
                        hbm_budget_bytes=None if budget_gib is None else budget_gib * GiB).judge()


def test_budget_picks_the_fastest_plan_under_it():
    assert fake_plan().picked.candidate.activations == "save_all"        # 60 GiB fits 0.9 x H200
    assert fake_plan(45).picked.candidate.activations == "save_dots"
    assert fake_plan(20).picked.candidate.activations == "offload_dots"   # the limit is inclusive
    assert fake_plan(45).hbm_limit_bytes == 45 * GiB
    assert fake_plan(1000).hbm_limit_bytes == 0.9 * get_target("h200").hbm_bytes   # the lower limit wins


def test_budget_that_nothing_fits_names_the_smallest_plan():
    with pytest.raises(ValueError, match=r"smallest HBM is 12\.00 GiB \(recompute_all / optimizer_state=host.*"
                                         r"budget 8\.00 GiB"):
        plan_result.choose(fake_plan(8))
    assert fake_plan().rejudged(hbm_budget_bytes=8 * GiB).picked is None


def test_cli_budget_prints_the_table_then_fails_naming_the_smallest(monkeypatch, capsys):
    seen = {}

    def replay(recipe, gpu, devices, **kwargs):
        seen.update(kwargs)
        return fake_plan(kwargs["hbm_budget_gib"])
    monkeypatch.setattr(commands, "plan", replay)
    assert cli.main(["plan", "tiny", "--hbm-budget", "45"]) == 0
    out = capsys.readouterr().out
    assert seen["hbm_budget_gib"] == 45.0 and "budget 45.00 GiB" in out
    assert "* save_dots" in out
    assert cli.main(["plan", "tiny", "--hbm-budget", "8"]) == 2
    captured = capsys.readouterr()
    assert "recompute_all" in captured.out        # the table still shows every plan
    assert "error: no offload plan fits" in captured.err and "12.00 GiB" in captured.err


@pytest.mark.parametrize("limits", [{"hbm_budget_gib": 0}, {"hbm_budget_gib": float("nan")},
                                    {"host_ram_gb": float("nan")}, {"host_ram_gb": float("inf")}])
def test_a_limit_that_is_not_a_positive_number_is_refused(limits):
    """A NaN passed `<= 0` and was taken as no budget, or priced the host as "nan GiB" with advice to shrink."""
    with pytest.raises(ValueError, match="must be a positive (finite )?number"):
        planner.plan(get_recipe("tiny"), "h200", 1, **limits)


def test_png_draws_every_compiled_plan(tmp_path, monkeypatch, capsys):
    from PIL import Image

    from spillway.recipes.plan.chart import draw_plan

    plan = fake_plan(45)
    plan.rows.append(plan_result.PlanRow(Candidate.of("save_qkv_offload_mlp", "host"), "flash", None,
                                     "compile failed", {}, compute_s=0.0, compile_s=0.0))
    path = draw_plan(plan, tmp_path / "plan.png")
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] > 600 and image.size[1] > 400
        # not a blank canvas: the bars and lines put several colours on it
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 16) or []) > 10

    monkeypatch.setattr(commands, "plan", lambda *args, **kwargs: fake_plan())
    capsys.readouterr()
    assert cli.main(["plan", "tiny", "--png", str(tmp_path / "cli.png")]) == 0
    assert (tmp_path / "cli.png").stat().st_size > 10_000
    assert f"plan chart: {tmp_path / 'cli.png'}" in capsys.readouterr().out   # where it went, as train says


def test_png_of_a_plan_where_nothing_compiled_says_so(tmp_path):
    from spillway.recipes.plan.chart import draw_plan

    plan = fake_plan()
    empty = types.SimpleNamespace(**{**plan.__dict__, "rows": []})
    with pytest.raises(ValueError, match="no plan compiled"):
        draw_plan(empty, tmp_path / "x.png")


def host_cpu_plan():
    """A plan whose pick is the host CPU's update with the weights on host, on `tiny` (save_all, all on device)."""
    rows = [fake_row("save_dots", "device", 90.0, 100.0),    # over the budget below
            fake_row("offload_dots", "host", 20.0, 150.0, host_gib=50.0)]
    pick = Candidate.of("recompute_all", "host", "host", update_on_host=True)
    rows.append(plan_result.PlanRow(pick, "flash", {**rows[1].report, "hbm_bytes": 10 * GiB}, None, {},
                                    compute_s=0.0, compile_s=0.0))
    rows[2].forward_s, rows[2].backward_s, rows[2].update_s = 0.1, 0.0, 0.0
    return plan_result.Plan(get_recipe("tiny"), get_target("h200"), 1, {"data": 1}, 0.9, 512 * GiB, rows, [],
                            None, {"jax_version": "test", "compiles": 3, "total_s": 1.0, "workers": 1,
                                   "child_startup_s": 0.0}, hbm_budget_bytes=50 * GiB).judge()


def test_the_table_and_json_say_how_to_train_the_pick_in_recipe_fields(monkeypatch, capsys):
    import json
    import shlex

    monkeypatch.setattr(commands, "plan", lambda *args, **kwargs: host_cpu_plan())
    assert cli.main(["plan", "tiny", "--set", "data.seq_len=64", "--set", "offload.params=device"]) == 0
    out = capsys.readouterr().out
    wanted = ("spillway train tiny --set data.seq_len=64 --set offload.activations=recompute_all "
              "--set offload.optimizer_state=host --set offload.params=host --set optimizer.update_on_host=true")
    assert f"train it:  {wanted}" in out   # the user's own offload.params=device gives way to the pick's
    assert "host_compute" not in out and "+params" not in out
    assert "* recompute_all                        host   host    true        after_backward" in out
    assert "* pick: recompute_all / optimizer_state=host / update_on_host=true / params=host" in out

    assert cli.main(["plan", "tiny", "--set", "data.seq_len=64", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["pick"]["set"] == ["offload.activations=recompute_all", "offload.optimizer_state=host",
                                       "offload.params=host", "optimizer.update_on_host=true"]
    assert shlex.split(document["pick"]["train_command"])[:3] == ["spillway", "train", "tiny"]
    assert "host_compute" not in json.dumps(document)
    assert [row["set"] for row in document["plans"]] == [
        ["offload.activations=save_dots"], ["offload.activations=offload_dots", "offload.optimizer_state=host"],
        document["pick"]["set"]]


def test_a_pick_the_recipe_already_trains_needs_no_set_and_a_stale_cpu_update_is_turned_off():
    plan = fake_plan()   # picks save_all with the state on device
    plan.recipe = get_recipe("tiny", ["offload.activations=save_all"])
    assert plan.pick_set_arguments() == [] and plan.train_command() == "spillway train tiny"
    offload = get_recipe("llama3_8b_offload", ["optimizer.update_on_host=true"])   # updated by the host CPU
    assert Candidate.of("save_all", "device").set_arguments(offload) == [
        "offload.activations=save_all", "offload.optimizer_state=device", "optimizer.update_on_host=false"]


def test_the_charts_scale_is_the_bars_not_a_limit_far_above_them():
    """A new user's finding: a tiny model's plan drawn against 89 GiB of host RAM per GPU showed no bars."""
    from spillway.recipes.plan.chart import y_scale

    height, drawn = y_scale(0.08, {"HBM limit": 126.9, "host RAM per GPU": 89.0})
    assert drawn == set() and height < 0.2
    height, drawn = y_scale(100.0, {"HBM limit": 126.9, "host RAM per GPU": 900.0})
    assert drawn == {"HBM limit"} and 126.9 < height < 200
