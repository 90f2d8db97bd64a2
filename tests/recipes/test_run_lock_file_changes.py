"""A run's lock file deleted or replaced while the run lives never lets two runs write one directory.

The holder's watcher re-creates a deleted `run.lock` (with or without flock),
so a second run is refused as before; a lock another run got first marks the
holder's lock lost, and the train loop stops without writing more.
"""

from __future__ import annotations

import errno
import time

import pytest

from micro_recipe import micro
from spillway.recipes.train import run_lock
from spillway.recipes.train.loop import train
from spillway.recipes.train.run_lock import RunLock, RunLockedError, RunLockLostError


@pytest.fixture(params=["flock", "no flock"])
def locking(request, monkeypatch):
    if request.param == "no flock":
        def refuse(fd, operation):
            raise OSError(errno.ENOLCK, "No locks available")
        monkeypatch.setattr(run_lock.fcntl, "flock", refuse)
    return request.param


def wait_for(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_deleted_lock_file_is_recreated_and_a_second_run_still_refused(locking, tmp_path):
    holder = RunLock(tmp_path / "run")
    holder.acquire()
    holder.watch(interval=0.05)
    try:
        holder.path.unlink()             # what the README's fallback advice used to invite
        wait_for(holder.path.exists)
        with pytest.raises(RunLockedError, match="another run is writing this run directory"):
            RunLock(tmp_path / "run").acquire()
        said = []
        holder.check(said.append)        # still ours: no error, and it says what happened
        assert len(said) == 1 and "was deleted while this run holds it; re-created" in said[0]
    finally:
        holder.release()
    assert not holder.path.exists()


def test_a_lock_taken_by_another_run_stops_the_holder(locking, tmp_path):
    holder = RunLock(tmp_path / "run")
    holder.acquire()
    holder.path.unlink()
    intruder = RunLock(tmp_path / "run")
    intruder.acquire()                   # got in before the holder looked
    try:
        with pytest.raises(RunLockLostError, match=rf"this run's lock is lost: {holder.path} was replaced by "
                                                   rf"another run's lock \(pid \d+"):
            holder.check()
        holder.release()
        assert holder.path.exists()       # the other run's file is left alone
    finally:
        intruder.release()


@pytest.mark.slow  # an end-to-end run of 30 s on 2 cores: `make test-slow` (CI: .venv-jax011's slow step), keeping `make test` near 12 minutes
def test_training_stops_when_another_run_takes_its_directory(tmp_path):
    run_dir = tmp_path / "run"
    intruder = RunLock(run_dir)

    def echo(line):
        if line.startswith("training steps"):   # the run is about to write: another run gets its lock
            (run_dir / "run.lock").unlink()
            intruder.acquire()

    try:
        with pytest.raises(RunLockLostError, match="stops here without writing more"):
            train(micro(tmp_path / "cache", run_dir, "train.steps=3"), progress=False, echo=echo)
        assert not (run_dir / "checkpoints" / "1").exists()
        assert not (run_dir / "metrics.jsonl").exists()   # no row written (the file is made with the first)
    finally:
        intruder.release()
