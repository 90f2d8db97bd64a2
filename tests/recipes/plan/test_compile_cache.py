"""The planner's compile cache (recipes/plan/compile_cache.py) and its bounds before compiling
(recipes/plan/scheduler.py), with stand-in compile processes: no GPU compile, a few seconds.

The stand-in (`FakeCompiles`) answers as recipes/plan/child.py does: per candidate a report whose figures
depend on the candidate and the sequence length, its bounds, and a programs/ entry written under the
request's cache folder. It counts the candidates it was asked to compile, which is what these tests assert:
a repeated plan asks for none (and starts no compile process), a changed setting asks again, a damaged entry
is one warning and one compile again. The real compile process's cache (the lowered program as the key) is
checked by `test_the_program_key_ignores_source_positions_and_sees_the_program` on a CPU lowering, and end to
end by the slow test in tests/recipes/plan/test_plan_speed.py.
"""

from __future__ import annotations

import hashlib
import json

import jax
import jax.numpy as jnp
import pytest

from spillway.recipes.plan import compile_cache, planner, scheduler
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.registry import get_recipe
from spillway.recipes.train.host_memory import HostPhases

GiB = 2**30
SMALL = ["model.num_layers=4", "model.d_model=64", "model.num_heads=2", "model.num_kv_heads=2",
         "model.mlp_hidden=128", "model.vocab_size=256", "model.max_seq_len=256", "data.seq_len=128",
         "train.global_batch=2"]


def host_phases(state: int = 0) -> dict:
    return HostPhases(footprint=0, state=state, halved=0, weights=0, pending=0, step_host=0, saved_device=0,
                      saved_host=state).to_dict()


class FakeCompiles:
    """Stands in for workers.run_children: the answer of compile processes, with their cache writes."""

    def __init__(self, device_argument_bytes: int = GiB, host_state_bytes: int = 0):
        self.compiled: list[Candidate] = []
        self.bounds_asked = 0
        self.device_argument_bytes, self.host_state_bytes = device_argument_bytes, host_state_bytes

    def __call__(self, request, workers, on_progress=None):
        seq_len = request["recipe"]["data"]["seq_len"]
        results = []
        for position, data in enumerate(request["candidates"]):
            candidate = Candidate.from_dict(data)
            # host:L (the next_forward candidates' split) counted as on host too: this fake has no embedding
            on_host = candidate.optimizer_state != "device"
            bounds = {"device_argument_bytes": 0 if on_host else self.device_argument_bytes,
                      "host_phases": host_phases(self.host_state_bytes if on_host else 0)}
            if request.get("bounds_only"):
                self.bounds_asked += 1
                results.append({"bounds": bounds, "seconds": 0.1})
                continue
            self.compiled.append(candidate)
            size = (1 + len(candidate.activations) + 3 * on_host) * seq_len * 2**20
            report = {name: 0 for name in compile_cache.REPORT_FIELDS}
            report.update(hbm_bytes=size, temp_bytes=size // 2, overlapped_bytes_by_pass={},
                          transfer_bytes_by_pass={}, host_buffer_count=int(candidate.offloads_activations),
                          host_temp_bytes=int(candidate.offloads_activations) * 2**20)
            key = hashlib.sha256(json.dumps([data, seq_len]).encode()).hexdigest()
            if request.get("cache"):
                compile_cache.CompileCache(request["cache"]["directory"]).put("programs", key, report)
            result = {"report": {**report, "host_phases": host_phases()}, "bounds": bounds, "cached": False,
                      "program": key if request.get("cache") else None, "seconds": 1.0}
            results.append(result)
            if on_progress is not None:
                on_progress(position, result)
        return {"jax_version": "fake", "mesh": {"data": 1, "fsdp": 1, "tensor": 1}, "results": results,
                "full_codegen": {}, "searches": None, "seconds": 1.0, "startup_seconds": 0.0,
                "cache_warnings": []}


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setenv(compile_cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(compile_cache.CACHE_SWITCH_ENV, raising=False)
    monkeypatch.setattr(planner, "check_toolchain", lambda: None)
    compiles = FakeCompiles()
    monkeypatch.setattr(scheduler, "run_children", compiles)
    return compiles


def plan(*sets, lines=None, **kwargs):
    return planner.plan(get_recipe("tiny", [*SMALL, *sets]), "h100", 1,
                        progress_write=None if lines is None else lines.append, **kwargs)


def figures(result):
    return [(row.candidate, row.report["hbm_bytes"], row.fits) for row in result.rows]


def test_a_repeated_plan_is_answered_from_the_cache_without_compiling(fake):
    first = plan()
    compiled, bounds_asked = len(fake.compiled), fake.bounds_asked
    assert compiled == first.timing["compiles"] > 0 and first.timing["cached"] == 0
    assert bounds_asked == len(first.rows) + len(first.skipped)
    lines = []
    again = plan(lines=lines)
    # no compile process asked anything
    assert len(fake.compiled) == compiled and fake.bounds_asked == bounds_asked
    assert again.timing["compiles"] == 0 and again.timing["cached"] == len(again.rows) == len(first.rows)
    assert figures(again) == figures(first) and again.picked.candidate == first.picked.candidate
    assert [entry["label"] for entry in again.skipped] == [entry["label"] for entry in first.skipped]
    assert len(lines) == len(first.rows) + len(first.skipped)
    assert sum("from the compile cache" in line for line in lines) == len(first.rows)


def test_a_changed_setting_compiles_again_and_a_judging_one_does_not(fake):
    first = plan()
    compiled = len(fake.compiled)
    plan(headroom=0.5)   # the limits judge the same compiles
    assert len(fake.compiled) == compiled
    longer = plan("data.seq_len=64")
    assert len(fake.compiled) == compiled + longer.timing["compiles"] and longer.timing["cached"] == 0
    assert {row.report["hbm_bytes"] for row in longer.rows} != {row.report["hbm_bytes"] for row in first.rows}


def test_a_damaged_entry_is_ignored_with_a_warning_and_compiled_again(fake, tmp_path):
    first = plan()
    compiled = len(fake.compiled)
    programs = sorted((tmp_path / "cache" / "plan" / "programs").rglob("*.json"))
    assert len(programs) == len(first.rows)
    programs[0].write_text('{"format": 1, "key": "trunc')
    lines = []
    again = plan(lines=lines)
    assert len(fake.compiled) == compiled + 1 and again.timing["compiles"] == 1
    warnings = [w for w in again.warnings if "damaged entry" in w]
    assert len(warnings) == 1 and str(programs[0]) in warnings[0]
    assert figures(again) == figures(first)
    assert json.loads(programs[0].read_text())["key"] == programs[0].stem   # written again


def test_the_cache_can_be_turned_off(fake, monkeypatch, tmp_path):
    monkeypatch.setenv(compile_cache.CACHE_SWITCH_ENV, "0")
    plan()
    compiled = len(fake.compiled)
    plan()
    assert len(fake.compiled) == 2 * compiled and not (tmp_path / "cache").exists()
    monkeypatch.delenv(compile_cache.CACHE_SWITCH_ENV)
    plan(cache=False)
    assert len(fake.compiled) == 3 * compiled and not (tmp_path / "cache").exists()


def test_candidates_their_bounds_rule_out_are_not_compiled_and_all_plans_compiles_them(fake):
    fake.device_argument_bytes = 200 * GiB   # more than an H100: the state cannot stay on device
    result = plan(cache=False)
    refused = [entry for entry in result.skipped if entry.get("cannot_fit")]
    assert {Candidate.from_dict(entry).optimizer_state for entry in refused} == {"device"}
    assert all("weights and optimizer state in HBM alone are 200.00 GiB > 71.20 GiB" in entry["because"]
               for entry in refused)
    assert not any(c.optimizer_state == "device" for c in fake.compiled)
    assert result.picked is not None and result.picked.candidate.optimizer_state == "host"
    fake.compiled.clear()
    exhaustive = plan(cache=False, prune=False)
    assert len(fake.compiled) == len(exhaustive.rows) and not exhaustive.skipped

    fake.device_argument_bytes, fake.host_state_bytes = GiB, 10**12   # host RAM, whatever the step holds
    result = plan(cache=False)
    refused = [entry for entry in result.skipped if entry.get("cannot_fit")]
    assert refused and all("whatever the step holds" in entry["because"] for entry in refused)
    assert all(row.candidate.optimizer_state == "device" for row in result.rows)


def _double(blank_lines: int):
    """The same function, written `blank_lines` lines further down its file."""
    scope: dict = {}
    exec(compile("\n" * blank_lines + "def double(x):\n    return x * 2\n", "written.py", "exec"), scope)
    return scope["double"]


def test_the_program_key_ignores_source_positions_and_sees_the_program():
    double, double_elsewhere = _double(0), _double(7)

    def triple(x):
        return x * 3

    x = jax.ShapeDtypeStruct((4,), jnp.float32)

    def key(fn):
        text = jax.jit(fn).lower(x).as_text(debug_info=True)
        return compile_cache.program_key(compile_cache.program_text(text), "target", 1, {"a": 0}, {"jax": 1})

    # Each traced once, by key(): a function's trace is cached with the call stack it was first traced under.
    assert key(double) == key(double_elsewhere)
    assert key(double) != key(triple)
    raw = jax.jit(_double(3)).lower(x).as_text(debug_info=True)
    text = compile_cache.program_text(raw)
    assert '"written.py":5:' in raw and '"written.py":' not in text   # positions cut
    assert "jit(double)/mul" in text   # op names kept
    assert compile_cache.program_key(text, "target", 1, {"a": 1}, {"jax": 1}) != key(double)   # the options


def test_the_code_that_reads_a_program_into_figures_is_part_of_every_key(tmp_path, monkeypatch):
    """A change to the analysis of compiled programs (recipes/plan/hlo.py, compile.py) changes a program's
    figures though the program did not change: its source is in the toolchain fingerprint, which both keys
    hold, and a module's digest follows its content."""
    fingerprint = compile_cache.toolchain_fingerprint()
    assert fingerprint["analysis"] == compile_cache.source_digest(compile_cache.ANALYSIS_MODULES, packages=())
    package = tmp_path / "analysis_stand_in"
    package.mkdir()
    (package / "__init__.py").write_text("")
    module = package / "reader.py"
    module.write_text("FIGURE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = compile_cache.source_digest(("analysis_stand_in.reader",), packages=())
    module.write_text("FIGURE = 2\n")
    assert compile_cache.source_digest(("analysis_stand_in.reader",), packages=()) != before
    text = "module @jit_f {}"
    assert compile_cache.program_key(text, "target", 1, None, {**fingerprint, "analysis": before}) != \
        compile_cache.program_key(text, "target", 1, None, fingerprint)


def test_the_command_says_what_each_compile_gave_on_stderr_when_it_is_not_a_terminal(fake, capsys):
    from spillway.recipes import cli

    assert cli.main(["plan", "tiny", *[f"--set={s}" for s in SMALL], "--gpu", "h100", "--json"]) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)   # stdout stays the document
    lines = captured.err.splitlines()
    total = len(planner.candidates(get_recipe("tiny", SMALL)))
    compiled = [line for line in lines if "compiled in" in line]
    assert len(compiled) == len(fake.compiled) > 0 and len(lines) == total
    assert compiled[0].startswith(f"spillway plan: [1/{total}] save_all / optimizer_state=device: compiled in 1.0 s, ")
    assert all(", fits; HBM " in line or "does not fit (" in line for line in compiled)
    assert cli.main(["plan", "tiny", *[f"--set={s}" for s in SMALL], "--gpu", "h100", "--no-cache"]) == 0
    assert len(fake.compiled) == 2 * len(compiled)   # --no-cache: compiled again although cached
    assert "from the compile cache" not in capsys.readouterr().err


def test_a_split_state_updated_by_the_host_cpu_is_priced_as_set(fake, capsys):
    """A new user's finding: `spillway plan --set offload.optimizer_state=host:2 --set
    optimizer.update_on_host=true`, which trains (the host CPU updating the last 2 layers), was compiled and
    priced with the update streamed through HBM instead, its row saying update_on_host false. Its row is the
    host CPU's update now, of the 2 host layers alone: their float32 gradients and weights out (no master
    copy), their new weights back, and their parameters at the host CPU's rate."""
    from spillway.recipes import cli
    from spillway.recipes.targets import get_target
    from spillway.recipes.train.step import abstract_model

    own = ["offload.optimizer_state=host:2", "optimizer.update_on_host=true"]
    assert cli.main(["plan", "tiny", *[f"--set={s}" for s in [*SMALL, *own]], "--gpu", "h100", "--json",
                     "--host-update-rate", "1e6", "--host-cores", "1"]) == 0
    rows = json.loads(capsys.readouterr().out)["plans"]
    (mine,) = [row for row in rows if row["optimizer_state"] == "host:2"]
    assert mine["update_on_host"] is True
    assert any(c.optimizer_state == "host:2" and c.update_on_host for c in fake.compiled)
    _, state = abstract_model(get_recipe("tiny", SMALL))
    stacked = sum(v.get_value().size for v in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "get_value"))
                  if v.get_value().shape[:1] == (4,))
    host_layer_params = stacked // 2
    link = get_target("h100").host_link_bytes_per_s
    assert mine["update_s"] == pytest.approx(3 * 4 * host_layer_params / link + host_layer_params / 1e6)
    # with the weights split at the same layer the host CPU updates them where they are: nothing crosses
    from spillway.recipes.plan import cost_model
    both = Candidate.of("save_all", "host:2", "host:2", update_on_host=True)
    traffic = cost_model.param_traffic(both, get_recipe("tiny", SMALL), {"data": 1, "fsdp": 1, "tensor": 1})
    assert traffic.update_in == traffic.update_out == 0


def test_a_placement_the_user_sets_is_priced_though_no_candidate_and_beaten(fake, capsys):
    """A new user's finding: `spillway plan --set offload.optimizer_state=host:2` was validated, then replaced by
    the candidates without a word (no host:2 among them; the pruning would skip it beside a plan that fits)."""
    from spillway.recipes import cli

    own = ["offload.optimizer_state=host:2", "offload.activations=recompute_all"]
    assert Candidate.of_recipe(get_recipe("tiny", [*SMALL, *own])) not in planner.candidates(get_recipe("tiny", SMALL))
    assert cli.main(["plan", "tiny", *[f"--set={s}" for s in [*SMALL, *own]], "--gpu", "h100", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["plans"]
    mine = [row for row in rows if row["optimizer_state"] == "host:2" and row["plan"] == "recompute_all"]
    assert len(mine) == 1 and mine[0]["hbm_bytes"] > 0
    assert any(c.optimizer_state == "host:2" for c in fake.compiled)
    # without such a --set, the candidates alone, as before
    fake.compiled.clear()
    assert cli.main(["plan", "tiny", *[f"--set={s}" for s in SMALL], "--gpu", "h100", "--json"]) == 0
    assert not any(row["optimizer_state"] == "host:2" for row in json.loads(capsys.readouterr().out)["plans"])
