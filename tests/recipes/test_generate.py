"""`spillway generate` on a run a new user has: a corrupt newest step, a step deleted by the live run's
retention while it is read (and `spillway export` of one), a damaged recipe.json, more --tokens than fit."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import pytest

from child_env import child_env
from micro_recipe import micro
from spillway.layers.errors import ConfigError
from spillway.recipes import cli
from spillway.recipes.generate import generate_from_checkpoint
from spillway.recipes.train import checkpoint as ckpt_lib
from spillway.recipes.train.loop import train


pytestmark = [pytest.mark.slow]  # one module fixture training the run it reads: 45 s on 2 cores, `make test-slow` (CI: .venv-jax011's slow step), keeping `make test` near 12 minutes


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """Steps 2 and 4 saved."""
    base = tmp_path_factory.mktemp("generate-run")
    run_dir = base / "run"
    train(micro(base / "cache", run_dir, "train.steps=4", "checkpoint.every_steps=2", "checkpoint.keep=3"),
          progress=False)
    return run_dir


@pytest.fixture
def run_copy(saved_run, tmp_path):
    shutil.copytree(saved_run, tmp_path / "run")
    return tmp_path / "run"


def sample(run_dir, warnings, tokens=4):
    return generate_from_checkpoint(str(run_dir), "def ", max_new_tokens=tokens, temperature=0.0, top_p=1.0,
                                    warn=warnings.append)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_corrupt_newest_step_falls_back_to_the_one_before_with_a_warning(run_copy):
    expected_from_step_2 = sample(run_copy / "checkpoints" / "2", [])
    for name in glob.glob(str(run_copy / "checkpoints" / "4" / "params" / "**" / "d" / "*"), recursive=True):
        os.remove(name)
    warnings = []
    assert sample(run_copy, warnings) == expected_from_step_2
    assert len(warnings) == 1 and f"{run_copy / 'checkpoints' / '4'} is corrupt, using the step before it" \
        in warnings[0]
    assert (run_copy / "checkpoints" / "4").is_dir()   # generate only reads: nothing renamed


def test_a_truncated_newest_step_is_one_warning_line_on_stderr_and_nothing_else(run_copy):
    """Truncated array files fail one tensorstore read while others are in flight; those finish after orbax's
    event loop closed and printed dozens of tracebacks around the warning (recipes/train/stray_callbacks.py)."""
    for name in glob.glob(str(run_copy / "checkpoints" / "4" / "params" / "**" / "d" / "*"), recursive=True):
        os.truncate(name, 10)
    done = subprocess.run([sys.executable, "-m", "spillway.recipes.cli", "generate", str(run_copy), "--prompt",
                           "def ", "--tokens", "4"], cwd=run_copy.parent, env=child_env(), capture_output=True,
                          text=True, timeout=300)
    err = done.stderr.splitlines()
    assert done.returncode == 0 and done.stdout.startswith("def ")
    assert len(err) == 1 and err[0].startswith(f"warning: {run_copy / 'checkpoints' / '4'} is corrupt"), err


def test_a_step_deleted_by_retention_while_read_is_read_again_from_the_newest(run_copy, monkeypatch):
    real = ckpt_lib.restore_params_only
    calls = []

    def retention_strikes_once(step_dir, target):
        calls.append(str(step_dir))
        if len(calls) == 1:
            shutil.rmtree(step_dir)   # as the live run's checkpoint.keep removes the step being read
        return real(step_dir, target)
    monkeypatch.setattr(ckpt_lib, "restore_params_only", retention_strikes_once)
    warnings = []
    assert sample(run_copy, warnings).startswith("def ")
    assert calls == [str(run_copy / "checkpoints" / "4"), str(run_copy / "checkpoints" / "2")]
    assert warnings == []   # no "corrupt": nothing was damaged


def test_an_export_of_a_step_deleted_by_retention_while_read_exports_the_newest(run_copy, monkeypatch, tmp_path):
    """`spillway export` of a live run failed 1 time in 10 with 'checkpoints/10: no such checkpoint directory'."""
    import json

    from spillway.recipes.export import export_run

    real = ckpt_lib.restore_params_only
    calls = []

    def retention_strikes_once(step_dir, target):
        calls.append(str(step_dir))
        if len(calls) == 1:
            shutil.rmtree(step_dir)
        return real(step_dir, target)
    monkeypatch.setattr(ckpt_lib, "restore_params_only", retention_strikes_once)
    export_run(str(run_copy), str(tmp_path / "out"), say=lambda line: None)
    assert calls == [str(run_copy / "checkpoints" / "4"), str(run_copy / "checkpoints" / "2")]
    assert json.loads((tmp_path / "out" / "spillway_export.json").read_text())["step"] == "2"


def test_a_damaged_recipe_json_is_named_with_its_line_and_the_step_before_is_read(run_copy):
    """A damaged recipe.json is a damaged step, as `train` treats it: the step before it is read (it stopped
    generate and export); a recipe this version cannot read names its file (it said only "unknown field")."""
    expected_from_step_2 = sample(run_copy / "checkpoints" / "2", [])
    recipe_file = run_copy / "checkpoints" / "4" / "recipe" / "recipe.json"
    recipe_file.write_text("{\n  \"name\": \"tiny\",\n  oops\n}\n")
    warnings = []
    assert sample(run_copy, warnings) == expected_from_step_2
    assert len(warnings) == 1 and f"{recipe_file}: not valid JSON (line 3, column 3" in warnings[0]
    with pytest.raises(ckpt_lib.CorruptCheckpointError, match=rf"{recipe_file}: not valid JSON \(line 3, column 3"):
        sample(run_copy / "checkpoints" / "4", [])   # that step named: no other step stands in
    recipe_file.write_text('{"a": 1}')
    with pytest.raises(ConfigError, match=rf"{recipe_file}: the saved recipe cannot be read by this version .*'a'"):
        sample(run_copy, [])


def test_an_export_of_a_run_whose_newest_step_is_damaged_names_the_older_step_to_pass(run_copy, tmp_path, capsys):
    for name in glob.glob(str(run_copy / "checkpoints" / "4" / "params" / "**" / "d" / "*"), recursive=True):
        os.truncate(name, 10)
    assert cli.main(["export", str(run_copy), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"(older steps [2]: pass one of their folders, e.g. {run_copy / 'checkpoints' / '2'})" in err, err
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_more_tokens_than_fit_are_capped_with_a_word(run_copy, capsys):
    assert cli.main(["generate", str(run_copy), "--prompt", "def ", "--tokens", "1000", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert "warning: --tokens 1000 capped at" in captured.err and "max_seq_len is 64" in captured.err
    assert captured.out.startswith("def ")
