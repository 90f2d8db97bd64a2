"""Checkpoints that protect the run, end to end on the micro recipe with the real step: nothing lost.

A run owns its directory; Ctrl-C through the CLI saves and exits 130; a
checkpoint directory that cannot be made is one line; a fine-tune loads what
it names, with the source's tokenizer (its loss starts where the source's
training left it). The loop's host-side policy (saving, resuming, divergence,
a failed save) runs with a stub step in test_loop.py, which imports the
micro recipe's helpers below.

One short run (`short_run`, steps 2 and 4 saved) is trained once per module.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spillway.data import load_documents, load_tokenizer, train_tokenizer
from spillway.recipes import cli
from spillway.recipes.registry import get_recipe
from spillway.recipes.train.checkpoint import RunCheckpointer
from spillway.recipes.train.finetune import FineTuneTokenizerError
from spillway.recipes.train.loop import train
from spillway.recipes.train.metrics import read_metrics
from spillway.recipes.train.resume import read_history
from spillway.recipes.train.run_lock import RunLockedError
from child_env import child_env

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


# -- owning the directory, Ctrl-C -----------------------------------------------------------------------------


@pytest.mark.slow  # an end-to-end run of 34 s on 2 cores: `make test-slow` (CI: .venv-jax011's slow step), keeping `make test` near 12 minutes
def test_a_second_run_is_refused_and_ctrl_c_saves_and_exits_130(data_cache, tmp_path):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "spillway.recipes.cli", "train", "tiny"]
    for item in micro_overrides(data_cache, run_dir, "train.steps=100000", "checkpoint.every_steps=100000"):
        argv += ["--set", item]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=child_env())
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


def test_a_checkpoint_dir_inside_another_runs_steps_is_refused_before_anything_is_written(data_cache, tmp_path,
                                                                                          capsys):
    """checkpoint.dir=<run>/checkpoints trained a new run among that run's steps (and `generate <run>/checkpoints`
    then read the intruder's), and <run>/checkpoints/40 wrote into a finished step."""
    other = tmp_path / "other"
    for item in ("params", "opt_state", "meta"):
        (other / "checkpoints" / "40" / item).mkdir(parents=True)
    for inside in (other / "checkpoints", other / "checkpoints" / "40", other / "checkpoints" / "40" / "mine"):
        before = sorted(str(p) for p in other.rglob("*"))
        assert cli.main(["train", "tiny", *[a for item in micro_overrides(data_cache, inside)
                                             for a in ("--set", item)]]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"of the run in {other}: a run writes into a folder of its own" in err, err
        assert sorted(str(p) for p in other.rglob("*")) == before   # nothing written there
    # a run's own folder next to it, and a run folder merely named like one, are fine
    from spillway.recipes.train.checkpoint_dirs import check_not_inside_a_runs_steps
    check_not_inside_a_runs_steps(tmp_path / "next")
    check_not_inside_a_runs_steps(tmp_path / "checkpoints")


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
