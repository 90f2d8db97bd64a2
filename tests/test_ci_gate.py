"""CI cannot pass by skipping: the gate's decisions, and a real pytest run under CI=1 that fails a skip."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ci_gate


@pytest.mark.parametrize("toolkit,plugin,ci,expected", [
    (None, None, False, None),
    (None, None, True, None),
    ("no ptxas", None, False, "skip"),
    ("no ptxas", None, True, "fail"),
    (None, "not installed", False, "fail"),
    ("no ptxas", "not installed", True, "fail"),
])
def test_toolchain_verdict(toolkit, plugin, ci, expected):
    verdict = ci_gate.toolchain_verdict(toolkit, plugin, ci)
    assert (verdict and verdict[0]) == expected
    if verdict:
        assert (toolkit if verdict[1].count("ptxas") else plugin) in verdict[1]


@pytest.mark.parametrize("value,ci", [("", False), ("0", False), ("false", False), ("1", True), ("true", True),
                                      ("yes", True), ("github-actions", True)])
def test_under_ci(value, ci):
    assert ci_gate.under_ci({"CI": value}) is ci
    assert ci_gate.under_ci({}) is False


def test_a_skip_under_ci_is_a_failure(tmp_path):
    """A throwaway test file beside this one that only skips: it passes locally and fails with CI=1."""
    probe = Path(__file__).parent / f"test_zz_probe_{os.getpid()}.py"
    probe.write_text("import pytest\n\ndef test_skips():\n    pytest.skip('nothing to run here')\n")
    try:
        def run(ci: str):
            env = {**os.environ, "CI": ci}
            return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(probe)],
                                  capture_output=True, text=True, env=env, cwd=Path(__file__).parent.parent,
                                  timeout=300)
        local, ci = run(""), run("1")
    finally:
        probe.unlink()
    assert local.returncode == 0 and "1 skipped" in local.stdout, local.stdout
    assert ci.returncode == 1 and "1 failed" in ci.stdout, ci.stdout
    assert "CI does not pass by skipping: nothing to run here" in ci.stdout


def test_ci_script_sets_ci():
    script = (Path(__file__).parent.parent / ".ci" / "run").read_text()
    assert 'export CI="${CI:-1}"' in script
    assert "\nrequired test\n" in script            # the README's test command, which must pass
    # every slow test runs somewhere, once: those with a torch reference and those that compile for the CPU
    # alone in the floor's venv (the only one with torch; its code generation the cheap one), those that
    # compile for a GPU in jax 0.11's (the GPU machine's) ...
    torch = '\nrequired test-slow SLOW_MARKS="slow and needs_torch"\n'
    cpu = 'within_budget test-slow SLOW_MARKS="slow and not needs_torch and not needs_toolchain and not recipe_picks"\n'
    assert torch + cpu in script
    gpu = '\nwithin_budget test-jax011 SUITE=test-slow SLOW_MARKS="slow and needs_toolchain and not recipe_picks"\n'
    # ... and the planner's picks of the stored GPU recipes (half of the slow time) in a step of their own, last
    picks = 'within_budget test-jax011 SUITE=test-slow SLOW_MARKS="recipe_picks"\n'
    assert script.endswith(gpu + picks)


def test_only_a_declared_torchless_environment_may_skip_parity_tests_under_ci():
    torch_reason = "HF parity tests need torch (CPU build) from the dev extra"
    assert not ci_gate.skip_allowed_under_ci(torch_reason, {})
    assert ci_gate.skip_allowed_under_ci(torch_reason, {"SPILLWAY_ENV_WITHOUT_TORCH": "1"})
    # The declaration covers torch alone: a missing toolchain still fails CI there.
    assert not ci_gate.skip_allowed_under_ci("no CUDA toolkit: ptxas not found", {"SPILLWAY_ENV_WITHOUT_TORCH": "1"})
