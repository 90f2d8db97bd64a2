"""Checkpoints that protect the run, end to end on the micro recipe: nothing lost, nothing silent.

The last step is always saved; a run owns its directory; resuming checks the
recipe against the saved one and records what changed; diverged weights are
never saved and the NaN stop names the intact step; a corrupt newest step is
set aside with a warning; Ctrl-C saves and exits 130; a failed save stops the
run at once; metrics rows are replaced, not repeated, after a resume from an
earlier step; a fine-tune loads what it names, with the source's tokenizer.

One short run (`short_run`, steps 2 and 4 saved) is trained once per module;
tests that change a run work on a copy of it.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spillway.data import load_documents, load_tokenizer, train_tokenizer
from spillway.recipes import cli
from spillway.recipes.registry import get_recipe
from spillway.recipes.train import checkpoint as ckpt_lib
from spillway.recipes.train.checkpoint import CheckpointError, RunCheckpointer
from spillway.recipes.train.errors import RunError
from spillway.recipes.train.finetune import FineTuneTokenizerError
from spillway.recipes.train.loop import train
from spillway.recipes.train.metrics import NonFiniteLossError, read_metrics
from spillway.recipes.train.resume import RecipeMismatchError, read_history
from spillway.recipes.train.run_lock import RunLockedError

MICRO = ["data.source=builtin:stdlib:400000", "data.seq_len=32", "data.num_proc=1",
         "model.vocab_size=512", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=2", "model.mlp_hidden=64", "model.max_seq_len=64",
         "train.global_batch=8", "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0",
         "optimizer.warmup_steps=2", "optimizer.learning_rate=1e-2"]


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("spillway-cache")


def micro_overrides(data_cache, run_dir, *extra) -> list[str]:
    return [*MICRO, f"data.cache_dir={data_cache}", f"checkpoint.dir={run_dir}", *extra]


def micro(data_cache, run_dir, *extra):
    return get_recipe("tiny", micro_overrides(data_cache, run_dir, *extra))


def saved_steps(run_dir: Path) -> list[int]:
    with RunCheckpointer(run_dir / "checkpoints", keep=10, every_steps=1) as ckpt:
        return ckpt.all_steps()


def losses_by_step(run_dir: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_metrics(run_dir / "metrics.jsonl") if "loss" in row}


def metric_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def short_run(data_cache, tmp_path_factory):
    """Steps 1..4 trained, steps 2 and 4 saved (every_steps=2, keep=3)."""
    run_dir = tmp_path_factory.mktemp("short") / "run"
    train(micro(data_cache, run_dir, "train.steps=4", "checkpoint.every_steps=2", "checkpoint.keep=3"),
          progress=False)
    return run_dir


@pytest.fixture
def run_copy(short_run, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(short_run, target)
    return target


# -- the last step -------------------------------------------------------------------------------------


@pytest.mark.slow  # an end-to-end run of 33 s on 2 cores: `make test-slow` (CI: .venv-jax011's slow step), keeping `make test` near 12 minutes
def test_the_last_step_is_saved_whatever_the_period(data_cache, tmp_path, capsys):
    run_dir = tmp_path / "run"
    train(micro(data_cache, run_dir, "train.steps=3", "checkpoint.every_steps=1000"), progress=False)
    assert saved_steps(run_dir) == [3]
    capsys.readouterr()
    # and `spillway generate` takes the run directory, its checkpoints directory or the step folder
    for path in (run_dir, run_dir / "checkpoints", run_dir / "checkpoints" / "3"):
        assert cli.main(["generate", str(path), "--prompt", "def ", "--tokens", "4", "--temperature", "0"]) == 0
        assert capsys.readouterr().out.startswith("def ")


# -- resuming: the recipe, the history, the step ---------------------------------------------------------


@pytest.mark.parametrize("change,field", [
    ("model.d_model=48", "model.d_model"),
    ("data.seq_len=16", "data.seq_len"),
    ("train.seed=3", "train.seed"),
    ("data.source=builtin:stdlib:300000", "data.source"),
])
@pytest.mark.slow  # in `make test-slow` (CI runs it): minutes on 2 cores
def test_resume_refuses_a_recipe_that_is_another_run(data_cache, run_copy, change, field):
    before = (run_copy / "metrics.jsonl").read_text()
    with pytest.raises(RecipeMismatchError, match=rf"checkpoints/4: cannot resume: {field} was "):
        train(micro(data_cache, run_copy, "train.steps=6", change), progress=False)
    assert (run_copy / "metrics.jsonl").read_text() == before  # nothing trained, nothing written
    assert saved_steps(run_copy) == [2, 4]


@pytest.mark.slow  # in `make test-slow` (CI runs it): minutes on 2 cores
def test_resume_with_a_new_schedule_records_what_changed(data_cache, run_copy, short_run):
    result = train(micro(data_cache, run_copy, "train.steps=6", "optimizer.learning_rate=5e-3",
                         "checkpoint.every_steps=3", "checkpoint.keep=3"), progress=False)
    assert result.final_step == 6 and saved_steps(run_copy) == [2, 4, 6]
    history = read_history(run_copy)
    assert [row["event"] for row in history] == ["start", "resume"]
    assert history[1]["step"] == 4
    assert history[1]["changed"] == {"optimizer.learning_rate": [0.01, 0.005], "checkpoint.every_steps": [2, 3],
                                     "train.steps": [4, 6], "checkpoint.dir": [str(short_run), str(run_copy)]}


@pytest.mark.slow  # in `make test-slow` (CI runs it): minutes on 2 cores
def test_resume_step_rewinds_and_metrics_are_replaced_not_repeated(data_cache, run_copy, short_run):
    original = losses_by_step(short_run)
    train(micro(data_cache, run_copy, "train.steps=4", "checkpoint.every_steps=2", "checkpoint.keep=3",
                "train.resume_step=2"), progress=False)
    assert metric_steps(run_copy) == [1, 2, 3, 4]
    assert losses_by_step(run_copy) == original  # exact resume from step 2
    assert (run_copy / "checkpoints" / "4.abandoned").is_dir()  # the newer step is set aside, not deleted
    assert saved_steps(run_copy) == [2, 4]


@pytest.mark.slow  # in `make test-slow` (CI runs it): minutes on 2 cores
def test_a_save_killed_midway_then_resumed_does_not_repeat_metrics(data_cache, run_copy, short_run):
    # as a kill during step 4's save leaves it: an unfinished orbax tmp folder
    (run_copy / "checkpoints" / "4").rename(run_copy / "checkpoints" / "4.orbax-checkpoint-tmp-1")
    train(micro(data_cache, run_copy, "train.steps=4", "checkpoint.every_steps=2", "checkpoint.keep=3"),
          progress=False)
    assert metric_steps(run_copy) == [1, 2, 3, 4]
    assert losses_by_step(run_copy) == losses_by_step(short_run)


# a failed tensorstore read can leave a callback for an event loop orbax already closed
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["truncate", "delete"])
@pytest.mark.slow  # in `make test-slow` (CI runs it): minutes on 2 cores
def test_a_corrupt_newest_step_falls_back_with_a_warning(data_cache, run_copy, short_run, damage):
    step_dir = run_copy / "checkpoints" / "4"
    files = [f for f in glob.glob(str(step_dir / "params" / "**" / "d" / "*"), recursive=True)]
    assert files
    for name in files:
        os.truncate(name, os.path.getsize(name) // 2) if damage == "truncate" else os.remove(name)
    said = []
    train(micro(data_cache, run_copy, "train.steps=4", "checkpoint.every_steps=2", "checkpoint.keep=3"),
          progress=False, echo=said.append)
    warnings = [line for line in said if line.startswith("warning:")]
    assert len(warnings) == 1 and "step 4 is corrupt" in warnings[0] and str(step_dir) in warnings[0]
    assert any(line.startswith(f"resumed from {run_copy / 'checkpoints' / '2'} at step 2") for line in said)
    assert (run_copy / "checkpoints" / "4.corrupt").is_dir()
    assert saved_steps(run_copy) == [2, 4]
    assert losses_by_step(run_copy) == losses_by_step(short_run)
    assert read_history(run_copy)[-1]["set_aside"] == ["4.corrupt"]


@pytest.mark.slow  # in `make test-slow` (CI runs it): minutes on 2 cores
def test_train_resume_false_into_a_directory_with_steps_is_refused(data_cache, run_copy):
    with pytest.raises(RunError, match=r"train.resume is false, but this directory holds steps \[2, 4\]"):
        train(micro(data_cache, run_copy, "train.steps=6", "train.resume=false"), progress=False)


# -- divergence --------------------------------------------------------------------------------------------


@pytest.mark.slow  # an end-to-end run of 30 s on 2 cores: `make test-slow` (CI: .venv-jax011's slow step), keeping `make test` near 12 minutes
def test_diverged_weights_are_not_saved_and_no_intact_step_is_claimed(data_cache, tmp_path):
    # the user's report: learning rate 1e30, a checkpoint every 2 steps. Step 2's weights are finite (~1e28)
    # but give a NaN loss: they must not be saved.
    run_dir = tmp_path / "run"
    with pytest.raises(NonFiniteLossError) as excinfo:
        train(micro(data_cache, run_dir, "train.steps=20", "optimizer.learning_rate=1e30",
                    "checkpoint.every_steps=2"), progress=False)
    message = str(excinfo.value)
    assert "no checkpoint was saved before it diverged" in message, message
    assert saved_steps(run_dir) == []


@pytest.mark.slow  # two runs, about 50 CPU seconds
def test_the_nan_stop_names_the_intact_step_and_a_rerun_resumes_from_it(data_cache, tmp_path):
    run_dir = tmp_path / "run"
    # warmup from 0: step 1 does not move the weights (intact, saved); step 2 diverges
    with pytest.raises(NonFiniteLossError) as excinfo:
        train(micro(data_cache, run_dir, "train.steps=6", "optimizer.learning_rate=1e30",
                    "checkpoint.every_steps=1"), progress=False)
    message = str(excinfo.value)
    assert f"step 1 is intact ({run_dir / 'checkpoints' / '1'})" in message, message
    assert saved_steps(run_dir) == [1]
    result = train(micro(data_cache, run_dir, "train.steps=6", "checkpoint.every_steps=1"), progress=False)
    assert result.final_step == 6
    assert all(loss < 10 for loss in losses_by_step(run_dir).values())
    assert read_history(run_dir)[-1]["changed"] == {"optimizer.learning_rate": [1e30, 0.01]}


# -- owning the directory, Ctrl-C -----------------------------------------------------------------------------


@pytest.mark.slow  # an end-to-end run of 34 s on 2 cores: `make test-slow` (CI: .venv-jax011's slow step), keeping `make test` near 12 minutes
def test_a_second_run_is_refused_and_ctrl_c_saves_and_exits_130(data_cache, tmp_path):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "spillway.recipes.cli", "train", "tiny"]
    for item in micro_overrides(data_cache, run_dir, "train.steps=100000", "checkpoint.every_steps=100000"):
        argv += ["--set", item]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.time() + 300
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            assert child.poll() is None, child.communicate()[1][-3000:]
            time.sleep(0.5)
        with pytest.raises(RunLockedError) as excinfo:  # a second run into the same directory
            train(micro(data_cache, run_dir, "train.steps=5"), progress=False)
        assert f"{run_dir}: another run is writing this run directory (pid {child.pid} on host" in str(excinfo.value)
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    steps = saved_steps(run_dir)
    assert len(steps) == 1 and steps[0] >= 3
    assert f"Ctrl-C: saved step {steps[0]}" in out + err
    assert not (run_dir / "run.lock").exists()  # released on the way out


# -- saves that cannot be written -------------------------------------------------------------------------------


def test_an_unwritable_checkpoint_dir_fails_before_training_in_one_line(data_cache, capsys):
    run_dir = "/sys/spillway-test-run"  # /sys refuses mkdir even to root
    assert cli.main(["train", "tiny", *[a for item in micro_overrides(data_cache, run_dir)
                                         for a in ("--set", item)]]) == 2   # a failure the user can fix
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and run_dir in err and "cannot create the run directory" in err, err


def test_a_failed_async_save_stops_the_run_at_that_save(data_cache, tmp_path, monkeypatch):
    def disk_full(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt_lib, "_write_text", disk_full)  # written in orbax's background commit
    run_dir = tmp_path / "run"
    with pytest.raises(CheckpointError) as excinfo:
        train(micro(data_cache, run_dir, "train.steps=400", "checkpoint.every_steps=200"), progress=False)
    message = str(excinfo.value)
    assert "\n" not in message
    assert f"{run_dir / 'checkpoints' / '200'}: the async save failed" in message and "No space left" in message
    # stopped soon after the failing save at step 200, not at the next one (step 400, the end)
    assert 200 <= max(metric_steps(run_dir)) < 400


# -- fine-tuning ---------------------------------------------------------------------------------------------------


@pytest.mark.slow  # in `make test-slow` (CI runs it): minutes on 2 cores
def test_finetune_from_the_run_directory_reuses_the_source_tokenizer(data_cache, short_run, tmp_path):
    tuned_dir = tmp_path / "tuned"
    said = []
    # new data, which would train another tokenizer
    result = train(micro(data_cache, tuned_dir, "train.steps=2", "data.source=builtin:stdlib:300000",
                         f"checkpoint.init_from={short_run}"), progress=False, echo=said.append)
    assert result.final_step == 2
    source = load_tokenizer(short_run / "tokenizer.model")
    assert load_tokenizer(tuned_dir / "tokenizer.model").fingerprint == source.fingerprint
    saved = json.loads((tuned_dir / "checkpoints" / "2" / "recipe" / "recipe.json").read_text())
    assert saved["data"]["tokenizer"] == str(tuned_dir / "tokenizer.model")
    # trained weights: well below the loss the source run started from (a fresh model: ln(512) = 6.24)
    assert losses_by_step(tuned_dir)[1] < losses_by_step(short_run)[1] - 0.2
    assert read_history(tuned_dir)[0]["event"] == "fine-tune"


@pytest.mark.slow  # in `make test-slow` (CI runs it): minutes on 2 cores
def test_finetune_with_a_tokenizer_of_another_size_is_refused(data_cache, short_run, tmp_path):
    documents = load_documents("builtin:stdlib:200000", cache_dir=data_cache / "datasets")
    other = train_tokenizer(documents, vocab_size=400).save(tmp_path / "other.model")
    with pytest.raises(FineTuneTokenizerError, match=r"has 400 tokens, but the weights of .* \(512 tokens\)"):
        train(micro(data_cache, tmp_path / "tuned", "train.steps=2", f"data.tokenizer={other}",
                    f"checkpoint.init_from={short_run / 'checkpoints' / '2'}"), progress=False)
