"""The train loop's host-side policy (recipes/train/loop.py, loop_parts.py, run_state.py), with a stub step.

Saving (the last step whatever the period, a step the run stops at), resuming
(the recipe held against the saved one, what changed recorded, a rewind, a
save killed midway, a corrupt newest step set aside), divergence (never saved,
the NaN stop names the intact step), a failed async save, a profile range.
Every run here trains the micro recipe with tests/recipes/train/stub_step.py
in place of the model's forward and backward pass: the real optimizer,
loader, checkpoints and loop, a step compiled in about a second. The
end-to-end runs with the real step (exact resume bit for bit, the loss
falling, Ctrl-C and SIGTERM through the CLI, fine-tuning) are in test_train.py
and test_run_safety.py.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest

from spillway.recipes import cli
from spillway.recipes.train import checkpoint_items
from spillway.recipes.train.checkpoint import CheckpointError
from spillway.recipes.train.errors import RunError
from spillway.recipes.train.loop import train
from spillway.recipes.train.metrics import NonFiniteLossError
from spillway.recipes.train.resume import RecipeMismatchError, read_history
from tests.recipes.train.stub_step import stub_programs
from tests.recipes.train.test_run_safety import losses_by_step, metric_steps, micro, saved_steps


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("spillway-cache")


def stub_train(recipe, **options):
    return train(recipe, progress=False, programs=stub_programs, **options)


@pytest.fixture(scope="module")
def short_run(data_cache, tmp_path_factory):
    """Steps 1..4 trained with the stub step, steps 2 and 4 saved (every_steps=2, keep=3)."""
    run_dir = tmp_path_factory.mktemp("short") / "run"
    stub_train(micro(data_cache, run_dir, "train.steps=4", "checkpoint.every_steps=2", "checkpoint.keep=3"))
    return run_dir


@pytest.fixture
def run_copy(short_run, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(short_run, target)
    return target


@pytest.mark.slow  # with the stub step about 30 s a run on 2 busy cores (the real step: 70-100 s): `make test-slow`
def test_the_stub_run_trains_saves_and_logs_every_step(short_run):
    assert saved_steps(short_run) == [2, 4]
    losses = losses_by_step(short_run)
    assert sorted(losses) == [1, 2, 3, 4] and len(set(losses.values())) == 4   # the loss reads the batch


# -- saving ----------------------------------------------------------------------------------------------


@pytest.mark.slow  # with the stub step about 30 s a run on 2 busy cores (the real step: 70-100 s): `make test-slow`
def test_the_last_step_is_saved_whatever_the_period(data_cache, tmp_path, capsys):
    run_dir = tmp_path / "run"
    stub_train(micro(data_cache, run_dir, "train.steps=3", "checkpoint.every_steps=1000"))
    assert saved_steps(run_dir) == [3]
    capsys.readouterr()
    # and `spillway generate` takes the run directory, its checkpoints directory or the step folder
    for path in (run_dir, run_dir / "checkpoints", run_dir / "checkpoints" / "3"):
        assert cli.main(["generate", str(path), "--prompt", "def ", "--tokens", "4", "--temperature", "0"]) == 0
        assert capsys.readouterr().out.startswith("def ")


@pytest.mark.slow  # with the stub step about 30 s a run on 2 busy cores (the real step: 70-100 s): `make test-slow`
def test_stop_after_saves_the_step_it_stops_at_and_the_next_call_resumes(data_cache, tmp_path):
    run_dir = tmp_path / "run"
    said = []
    first = stub_train(micro(data_cache, run_dir, "train.steps=6", "checkpoint.every_steps=100"), stop_after=3,
                       echo=said.append)
    assert first.final_step == 3 and saved_steps(run_dir) == [3]
    assert "stopping after 3 steps at step 3 of 6 (checkpoint saved; the same command resumes from it)" in said
    second = stub_train(micro(data_cache, run_dir, "train.steps=6", "checkpoint.every_steps=100"))
    assert second.final_step == 6 and saved_steps(run_dir) == [3, 6]
    assert metric_steps(run_dir) == [1, 2, 3, 4, 5, 6]


def test_a_sigterm_during_a_save_stops_the_run_at_the_step_saved(data_cache, tmp_path, monkeypatch):
    """A scheduler's SIGTERM that came while step 2 was being saved trained step 3 and saved it too before
    leaving: one step and one save more inside the grace period. The run now leaves at the step it saved."""
    import os
    import signal

    from spillway.recipes.train.checkpoint import RunCheckpointer

    saving = RunCheckpointer.save

    def save_then_terminated(self, step, **items):
        saving(self, step, **items)
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)   # delivered before the save returns to the loop
    monkeypatch.setattr(RunCheckpointer, "save", save_then_terminated)
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as stop:
        stub_train(micro(data_cache, run_dir, "train.steps=6", "checkpoint.every_steps=2"))
    assert stop.value.code == 143
    assert saved_steps(run_dir) == [2] and metric_steps(run_dir) == [1, 2]


def test_a_failed_async_save_stops_the_run_at_that_save(data_cache, tmp_path, monkeypatch):
    def disk_full(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_items, "_write_text", disk_full)  # written in orbax's background commit
    run_dir = tmp_path / "run"
    with pytest.raises(CheckpointError) as excinfo:
        stub_train(micro(data_cache, run_dir, "train.steps=400", "checkpoint.every_steps=200"))
    message = str(excinfo.value)
    assert "\n" not in message
    assert f"{run_dir / 'checkpoints' / '200'}: the async save failed" in message and "No space left" in message
    # stopped soon after the failing save at step 200, not at the next one (step 400, the end)
    assert 200 <= max(metric_steps(run_dir)) < 400


# -- resuming: the recipe, the history, the step ---------------------------------------------------------


@pytest.mark.parametrize("change,field", [
    ("model.d_model=48", "model.d_model"),
    ("data.seq_len=16", "data.seq_len"),
    ("train.seed=3", "train.seed"),
    ("data.source=builtin:stdlib:300000", "data.source"),
])
@pytest.mark.slow  # with the stub step about 30 s a run on 2 busy cores (the real step: 70-100 s): `make test-slow`
def test_resume_refuses_a_recipe_that_is_another_run(data_cache, run_copy, change, field):
    before = (run_copy / "metrics.jsonl").read_text()
    with pytest.raises(RecipeMismatchError, match=rf"checkpoints/4: cannot resume: {field} was "):
        stub_train(micro(data_cache, run_copy, "train.steps=6", change))
    assert (run_copy / "metrics.jsonl").read_text() == before  # nothing trained, nothing written
    assert saved_steps(run_copy) == [2, 4]


@pytest.mark.slow  # with the stub step about 30 s a run on 2 busy cores (the real step: 70-100 s): `make test-slow`
def test_resume_with_a_new_schedule_records_what_changed(data_cache, run_copy, short_run):
    result = stub_train(micro(data_cache, run_copy, "train.steps=6", "optimizer.learning_rate=5e-3",
                              "checkpoint.every_steps=3", "checkpoint.keep=3"))
    assert result.final_step == 6 and saved_steps(run_copy) == [2, 4, 6]
    history = read_history(run_copy)
    assert [row["event"] for row in history] == ["start", "resume"]
    assert history[1]["step"] == 4
    assert history[1]["changed"] == {"optimizer.learning_rate": [0.01, 0.005], "checkpoint.every_steps": [2, 3],
                                     "train.steps": [4, 6], "checkpoint.dir": [str(short_run), str(run_copy)]}


@pytest.mark.slow  # with the stub step about 30 s a run on 2 busy cores (the real step: 70-100 s): `make test-slow`
def test_a_run_past_its_train_steps_says_there_is_nothing_to_train(data_cache, run_copy):
    """Rerun with fewer steps than it has trained: one plain line, not "training steps 4..2"."""
    said = []
    result = stub_train(micro(data_cache, run_copy, "train.steps=2", "checkpoint.every_steps=2", "checkpoint.keep=3"),
                        echo=said.append)
    assert result.final_step == 4 and saved_steps(run_copy) == [2, 4]
    assert "nothing to train: the run is at step 4 and train.steps is 2 (raise train.steps to train on)" in said
    assert not any(line.startswith("training steps") for line in said)


@pytest.mark.slow  # with the stub step about 30 s a run on 2 busy cores (the real step: 70-100 s): `make test-slow`
def test_resume_step_rewinds_and_metrics_are_replaced_not_repeated(data_cache, run_copy, short_run):
    original = losses_by_step(short_run)
    stub_train(micro(data_cache, run_copy, "train.steps=4", "checkpoint.every_steps=2", "checkpoint.keep=3",
                     "train.resume_step=2"))
    assert metric_steps(run_copy) == [1, 2, 3, 4]
    assert losses_by_step(run_copy) == original  # exact resume from step 2
    assert (run_copy / "checkpoints" / "4.abandoned").is_dir()  # the newer step is set aside, not deleted
    assert saved_steps(run_copy) == [2, 4]


@pytest.mark.slow  # with the stub step about 30 s a run on 2 busy cores (the real step: 70-100 s): `make test-slow`
def test_a_save_killed_midway_then_resumed_does_not_repeat_metrics(data_cache, run_copy, short_run):
    # as a kill during step 4's save leaves it: an unfinished orbax tmp folder
    (run_copy / "checkpoints" / "4").rename(run_copy / "checkpoints" / "4.orbax-checkpoint-tmp-1")
    stub_train(micro(data_cache, run_copy, "train.steps=4", "checkpoint.every_steps=2", "checkpoint.keep=3"))
    assert metric_steps(run_copy) == [1, 2, 3, 4]
    assert losses_by_step(run_copy) == losses_by_step(short_run)


# a failed tensorstore read can leave a callback for an event loop orbax already closed
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["truncate", "delete", "recipe", "loader_state", "meta_step"])
@pytest.mark.slow  # with the stub step about 30 s a run on 2 busy cores (the real step: 70-100 s): `make test-slow`
def test_a_corrupt_newest_step_falls_back_with_a_warning(data_cache, run_copy, short_run, damage):
    step_dir = run_copy / "checkpoints" / "4"
    files = [f for f in glob.glob(str(step_dir / "params" / "**" / "d" / "*"), recursive=True)]
    assert files
    if damage == "recipe":   # a step without its saved recipe stopped the run, with no fallback
        files = [str(step_dir / "recipe" / "recipe.json")]
    if damage in ("loader_state", "meta_step"):
        # records that parse but are damaged: a loader state without its position was an internal error
        # (KeyError); a meta record naming step 1 in folder 4 trained step 4's weights on step 1's schedule
        record = step_dir / ("loader_state" if damage == "loader_state" else "meta") / "metadata"
        saved = json.loads(record.read_text())
        record.write_text(json.dumps({"nonsense": 1} if damage == "loader_state" else {**saved, "step": 1}))
        files = []
    for name in files:
        os.truncate(name, os.path.getsize(name) // 2) if damage == "truncate" else os.remove(name)
    said = []
    stub_train(micro(data_cache, run_copy, "train.steps=4", "checkpoint.every_steps=2", "checkpoint.keep=3"),
               echo=said.append)
    warnings = [line for line in said if line.startswith("warning:")]
    assert len(warnings) == 1 and "step 4 is corrupt" in warnings[0] and str(step_dir) in warnings[0]
    assert any(line.startswith(f"resumed from {run_copy / 'checkpoints' / '2'} at step 2") for line in said)
    assert (run_copy / "checkpoints" / "4.corrupt").is_dir()
    assert saved_steps(run_copy) == [2, 4]
    assert losses_by_step(run_copy) == losses_by_step(short_run)
    assert read_history(run_copy)[-1]["set_aside"] == ["4.corrupt"]


@pytest.mark.slow  # with the stub step about 30 s a run on 2 busy cores (the real step: 70-100 s): `make test-slow`
def test_train_resume_false_into_a_directory_with_steps_is_refused(data_cache, run_copy):
    with pytest.raises(RunError, match=r"train.resume is false, but this directory holds steps \[2, 4\]"):
        stub_train(micro(data_cache, run_copy, "train.steps=6", "train.resume=false"))


# -- divergence --------------------------------------------------------------------------------------------


@pytest.mark.slow  # with the stub step about 30 s a run on 2 busy cores (the real step: 70-100 s): `make test-slow`
def test_diverged_weights_are_not_saved_and_no_intact_step_is_claimed(data_cache, tmp_path):
    # the user's report: learning rate 1e30, a checkpoint every 2 steps. Step 2's weights are finite (~1e29)
    # but give an infinite loss: they must not be saved.
    run_dir = tmp_path / "run"
    with pytest.raises(NonFiniteLossError) as excinfo:
        stub_train(micro(data_cache, run_dir, "train.steps=20", "optimizer.learning_rate=1e30",
                         "checkpoint.every_steps=2"))
    message = str(excinfo.value)
    assert "no checkpoint was saved before it diverged" in message, message
    assert saved_steps(run_dir) == []


@pytest.mark.slow  # with the stub step about 30 s a run on 2 busy cores (the real step: 70-100 s): `make test-slow`
def test_the_nan_stop_names_the_intact_step_and_a_rerun_resumes_from_it(data_cache, tmp_path):
    run_dir = tmp_path / "run"
    # warmup from 0: step 1 does not move the weights (intact, saved); step 2 diverges
    with pytest.raises(NonFiniteLossError) as excinfo:
        stub_train(micro(data_cache, run_dir, "train.steps=6", "optimizer.learning_rate=1e30",
                         "checkpoint.every_steps=1"))
    message = str(excinfo.value)
    assert f"step 1 is intact ({run_dir / 'checkpoints' / '1'})" in message, message
    assert saved_steps(run_dir) == [1]
    result = stub_train(micro(data_cache, run_dir, "train.steps=6", "checkpoint.every_steps=1"))
    assert result.final_step == 6
    assert all(loss < 10 for loss in losses_by_step(run_dir).values())
    assert read_history(run_dir)[-1]["changed"] == {"optimizer.learning_rate": [1e30, 0.01]}


def test_non_finite_loss_stops_the_run_naming_the_step(data_cache, tmp_path):
    with pytest.raises(NonFiniteLossError, match=r"loss is (nan|inf) at step \d+"):
        stub_train(micro(data_cache, tmp_path / "nan", "train.steps=6", "optimizer.learning_rate=1e30",
                         "optimizer.clip_norm=null", "optimizer.warmup_steps=0"))


# -- validation, profile --------------------------------------------------------------------------------------


@pytest.mark.slow  # with the stub step about 30 s a run on 2 busy cores (the real step: 70-100 s): `make test-slow`
def test_validation_runs_every_eval_every_steps_and_at_the_last(data_cache, tmp_path):
    result = stub_train(micro(data_cache, tmp_path / "run", "train.steps=5", "train.eval_every=2",
                              "train.eval_batches=1"))
    assert [row["step"] for row in result.history if "val_loss" in row] == [2, 4, 5]


@pytest.mark.slow  # with the stub step about 30 s a run on 2 busy cores (the real step: 70-100 s): `make test-slow`
def test_profile_trace_for_a_step_range(data_cache, tmp_path):
    result = stub_train(micro(data_cache, tmp_path / "prof", "train.steps=3", "train.profile_steps=1:2"))
    assert list((result.run_dir / "profile").rglob("*.xplane.pb"))
