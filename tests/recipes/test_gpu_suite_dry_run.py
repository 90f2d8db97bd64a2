"""benchmarks/gpu_suite.py's deviceless checks before a GPU call: every case is judged against the GPU machine
(one H200, 128 GiB of host RAM) from the planner's predictions and the host phases, and a case that would not
fit is skipped with the reason; --dry-run prints it all without a GPU."""

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_suite

REPO = Path(__file__).resolve().parents[2]
GiB = 2**30
TINY_HOST = gpu_suite.Case("tiny", "recompute_all", "host", 32, overrides=("model.max_seq_len=64",))


def test_a_case_whose_host_peak_exceeds_the_machines_ram_is_skipped_naming_the_phase():
    fit = gpu_suite.fit_case("tiny/host", {"hbm_bytes": GiB, "host_bytes": 10**6, "step_s": 0.01},
                             host_ram_bytes=GiB, case=TINY_HOST)
    # the process's assumed footprint (6 GiB) alone is above 1 GiB
    assert not fit["fits"] and fit["why_not"].startswith("host ") and "> 1.0 GiB" in fit["why_not"]
    assert fit["host_phase"] in ("state creation", "step")
    roomy = gpu_suite.fit_case("tiny/host", {"hbm_bytes": GiB, "host_bytes": 10**6, "step_s": 0.01}, case=TINY_HOST)
    assert roomy["fits"] and roomy["why_not"] == ""


def test_a_case_above_the_hbm_limit_is_skipped_and_a_missing_prediction_is_said():
    too_big = gpu_suite.fit_case("tiny/host", {"hbm_bytes": 200 * GiB}, case=TINY_HOST)
    assert not too_big["fits"] and too_big["why_not"].startswith("HBM 200.0 > ")
    unknown = gpu_suite.fit_case("tiny/host", {}, case=TINY_HOST)
    assert unknown["fits"] and "run --predict" in unknown["note"]


def test_the_dry_run_table_shows_predictions_and_skips():
    rows = {"a": {"fits": True, "why_not": "", "hbm_bytes": 35 * GiB, "host_peak_bytes": 95 * GiB,
                  "host_phase": "state creation", "predicted_step_s": 2.5, "tokens_per_step": 8192, "note": ""},
            "b": {"fits": False, "why_not": "host 200.0 GiB at step > 128.0 GiB", "hbm_bytes": None,
                  "host_peak_bytes": 200 * GiB, "host_phase": "step", "predicted_step_s": None,
                  "tokens_per_step": 8192, "note": ""}}
    table = gpu_suite.dry_run_table(rows)
    assert "35.00G" in table and "2500.0" in table and "3277" in table   # 8192 tokens / 2.5 s
    assert "skip: host 200.0 GiB at step > 128.0 GiB" in table


def test_every_default_case_is_a_case_and_the_cli_refuses_a_bad_ram():
    assert set(gpu_suite.DEFAULT_CASES) <= set(gpu_suite.CASES)
    out = subprocess.run([sys.executable, "-m", "benchmarks.gpu_suite", "--dry-run", "--host-ram-gib", "-1"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2 and "--host-ram-gib must be positive, got -1.0" in out.stderr


@pytest.mark.slow   # 8 fake CPU devices, a compile of the deferred step: over a minute on 2 loaded cores
@pytest.mark.parametrize("case", [
    TINY_HOST._replace(update="next_forward"),
    TINY_HOST._replace(update="next_forward", grad_accum=2,
                       overrides=TINY_HOST.overrides + (gpu_suite.PENDING_IN_HBM,))],
    ids=["one batch", "two micro-batches"])
def test_a_deferred_update_case_measures_on_cpu(case):
    """The next_forward cases take and return the pending update (float32 with micro-batches): run one step's
    worth on CPU first."""
    row = gpu_suite.measure_case("tiny/host_in_fwd", warmup=1, timed=1, case=case,
                                 extra_overrides=("train.global_batch=8",))
    assert row["step_s"] > 0 and row["host_resident_peak_bytes"] > 0


def test_a_case_with_xla_flags_runs_its_process_with_them_added(monkeypatch):
    """The command-buffer cases reach XLA through the child's XLA_FLAGS (appended to any set outside); the
    other cases leave XLA_FLAGS as they found it."""
    seen = {}

    def fake_run(cmd, env, **kwargs):
        seen[cmd[-1]] = env.get("XLA_FLAGS")
        return subprocess.CompletedProcess(cmd, 0, stdout='{"case": "x"}\n', stderr="")

    monkeypatch.setattr(gpu_suite.subprocess, "run", fake_run)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    flagged = "1b/recompute_all/host/cudnn/ga8/no_command_buffers"
    assert gpu_suite.CASES[flagged].xla_flags == ("--xla_gpu_enable_command_buffer=",)
    gpu_suite.run_child(flagged, timeout_s=1)
    gpu_suite.run_child("1b/recompute_all/host/cudnn/ga8", timeout_s=1)
    assert seen[flagged] == "--xla_dump_to=/tmp/x --xla_gpu_enable_command_buffer="
    assert seen["1b/recompute_all/host/cudnn/ga8"] == "--xla_dump_to=/tmp/x"
