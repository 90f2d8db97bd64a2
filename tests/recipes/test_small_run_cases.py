"""Smaller things a new user meets: a deleted metrics.jsonl, a data.source a mixture ignores, a loss curve
with nothing to draw, metrics.jsonl read by a strict JSON reader, a parameter count written in prose."""

from __future__ import annotations

import json
import math
import os
import re
import warnings

import pytest

from micro_recipe import micro
from spillway.recipes import cli
from spillway.recipes.registry import get_recipe, recipe_names
from spillway.recipes.train.loop import train
from spillway.recipes.train.metrics import RunLogger, read_metrics


@pytest.mark.slow  # an end-to-end run of 35 s on 2 cores: `make test-slow` (CI: .venv-jax011's slow step), keeping `make test` near 12 minutes
def test_a_finished_run_whose_metrics_were_deleted_ends_well_and_a_mixture_names_the_source_it_ignores(tmp_path,
                                                                                                       monkeypatch):
    run_dir = tmp_path / "run"
    said = []
    echo = said.append
    log = RunLogger.log

    def log_then_delete(self, step, metrics):
        log(self, step, metrics)
        if step == 1:   # as a user cleaning up a live run's folder might, once it holds a row
            (run_dir / "metrics.jsonl").unlink()

    monkeypatch.setattr(RunLogger, "log", log_then_delete)

    result = train(micro(tmp_path / "cache", run_dir, "train.steps=2",
                         "data.mixture=a=1:builtin:stdlib:400000,b=1:builtin:stdlib:300000",
                         source="builtin:stdlib:200000"), progress=False, echo=echo)
    assert result.final_step == 2 and (run_dir / "checkpoints" / "2").is_dir()
    assert any(line.startswith(f"warning: {run_dir / 'metrics.jsonl'} was deleted while the run wrote it")
               for line in said)
    assert any("data.mixture is set, so data.source=builtin:stdlib:200000 is not read" in line for line in said)


def test_no_loss_to_draw_draws_nothing_and_warns_nothing(tmp_path):
    logger = RunLogger(tmp_path / "run", start_step=0, tensorboard=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # matplotlib's "No artists with labels found to put in legend"
        assert logger.plot_loss() is None   # a run stopped before its first log interval
        logger.log(3, {"loss": 2.5})
        assert logger.plot_loss() == tmp_path / "run" / "loss.png"
    logger.close()


def test_metrics_jsonl_is_strict_json_and_reads_a_value_that_was_not_finite_back_as_nan(tmp_path):
    """NaN and Infinity are not JSON: Python wrote them, and jq or JSON.parse refused the whole line."""
    logger = RunLogger(tmp_path / "run", start_step=0, tensorboard=False)
    logger.log(1, {"loss": 2.5, "grad_norm": math.inf, "mfu": math.nan, "load": [0.5, math.nan]})
    logger.close()
    line = (tmp_path / "run" / "metrics.jsonl").read_text().strip()

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    strict = json.loads(line, parse_constant=refuse)
    assert strict == {"step": 1, "loss": 2.5, "grad_norm": None, "mfu": None, "load": [0.5, None]}
    (row,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert row["loss"] == 2.5 and math.isnan(row["grad_norm"]) and math.isnan(row["mfu"])
    assert row["load"][0] == 0.5 and math.isnan(row["load"][1])
    resumed = RunLogger(tmp_path / "run", start_step=1, tensorboard=False)   # the rewrite keeps it strict
    resumed.log(2, {"loss": 2.0})
    resumed.close()
    assert (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0] == line


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_a_full_disk_under_metrics_jsonl_is_one_line_naming_the_file(tmp_path):
    """A disk that filled while a row was written was "No space left on device" naming no file (a text
    file's write has none): the run's line now names metrics.jsonl."""
    logger = RunLogger(tmp_path / "run", start_step=0, tensorboard=False)
    logger.log(1, {"loss": 2.5})
    logger._jsonl.close()
    logger._jsonl = open("/dev/full", "a", buffering=1)   # every write: ENOSPC, as a full disk answers
    with pytest.raises(OSError) as full:
        logger.log(2, {"loss": 2.0})
    message, status = cli.describe_error(full.value)
    assert status == cli.EXIT_USER_ERROR and "\n" not in message
    assert message.startswith(f"{tmp_path / 'run' / 'metrics.jsonl'}: No space left on device")


def test_rows_after_the_resumed_step_are_dropped_only_once_a_step_replaces_them(tmp_path):
    """A resume dropped the rows after its step at start-up: a run that then stopped before training (a
    refusal, a crash) lost the rows of steps it never trained again."""
    logger = RunLogger(tmp_path, start_step=0, tensorboard=False)
    for step in range(1, 5):
        logger.log(step, {"loss": float(step)})
    logger.close()
    before = (tmp_path / "metrics.jsonl").read_text()
    RunLogger(tmp_path, start_step=2, tensorboard=False).close()   # stopped before its first step
    assert (tmp_path / "metrics.jsonl").read_text() == before
    resumed = RunLogger(tmp_path, start_step=2, tensorboard=False)
    resumed.log(3, {"loss": 30.0})
    resumed.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_a_retry_with_no_step_replaces_the_earlier_attempts_tensorboard_events(tmp_path):
    """An attempt killed before its first save, retried from step 0 with another train.eval_every: TensorBoard's
    data server (its default loader) kept the earlier attempt's val_loss at steps the retry never validates at,
    on the retry's curve, since it purges a tag only where the same tag is logged again."""
    import time

    attempt = RunLogger(tmp_path, start_step=0)
    for step in (1, 2, 3, 4):
        attempt.log(step, {"loss": 5.0, **({"val_loss": 6.0} if step % 2 == 0 else {})})
    attempt.close()
    earlier = set((tmp_path / "tb").iterdir())
    RunLogger(tmp_path, start_step=0).close()   # stopped before its first step: nothing removed
    assert set((tmp_path / "tb").iterdir()) == earlier
    time.sleep(1.1)   # an event file is named by the second its writer opened it
    resumed = RunLogger(tmp_path, start_step=2)   # a resume keeps the events of the steps it resumes after
    resumed.log(3, {"loss": 4.0})
    resumed.close()
    assert earlier < set((tmp_path / "tb").iterdir())
    time.sleep(1.1)
    retry = RunLogger(tmp_path, start_step=0)
    retry.log(1, {"loss": 4.0})
    retry.close()
    assert len(list((tmp_path / "tb").iterdir())) == 1 and not earlier & set((tmp_path / "tb").iterdir())


def test_parameter_counts_are_computed_not_written_in_descriptions(capsys):
    for name in recipe_names():
        assert not re.search(r"\d[\d.]*\s*[MB] param", get_recipe(name).description), name
    assert cli.main(["recipes", "tiny"]) == 0
    count = get_recipe("tiny").num_params() / 1e6
    assert capsys.readouterr().out.startswith(f"tiny ({count:,.2f}M parameters): 4-layer Llama")


def test_a_run_that_fails_before_training_leaves_no_run_folder_it_made(tmp_path, micro_data_cache):
    """A corpus too short for a validation row stopped the run after it had made its folder: checkpoints/
    empty and a corpus.json, which looked like a run. A folder that was there before is left as it was."""
    too_short = ("train.steps=2", "data.max_tokens=200")
    with pytest.raises(ValueError, match="is too short|cannot be split into training and validation"):
        train(micro(micro_data_cache, tmp_path / "run", *too_short), progress=False)
    assert not (tmp_path / "run").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("the user's")
    with pytest.raises(ValueError, match="is too short|cannot be split into training and validation"):
        train(micro(micro_data_cache, tmp_path / "mine", *too_short), progress=False)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "the user's"


def test_tensorboard_events_reach_the_disk_while_the_run_goes_on(tmp_path):
    """tensorboardX flushed its events every two minutes: a run killed (the OOM killer, SIGKILL) lost the scalars
    of up to two minutes of steps, saved ones too, which the resumed run never logs again (a gap for good). The
    logger stays open here, as a killed run's does."""
    import time

    from tensorboardX.proto import event_pb2

    def logged_steps(folder):
        steps = set()
        for events in folder.glob("events.out.tfevents.*"):
            data, at = events.read_bytes(), 0
            while at + 12 <= len(data):   # TFRecord: length (8 bytes), its CRC (4), the event, its CRC (4)
                length = int.from_bytes(data[at:at + 8], "little")
                event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
                at += 12 + length + 4
                steps |= {event.step for value in event.summary.value if value.tag == "loss"}
        return steps

    logger = RunLogger(tmp_path / "run", start_step=0)
    for step in (1, 2, 3):
        logger.log(step, {"loss": 3.0 - step / 10})
    deadline = time.monotonic() + 10
    while logged_steps(tmp_path / "run" / "tb") != {1, 2, 3} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert logged_steps(tmp_path / "run" / "tb") == {1, 2, 3}
    logger.close()
