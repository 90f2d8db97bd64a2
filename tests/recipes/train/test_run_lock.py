"""recipes/train/run_lock.py: one writer per run directory; a crashed owner does not keep it.

The owner in most tests is a real child process (it holds the lock, is then
killed with SIGKILL), since what matters is what the kernel does when the owner
dies. Without flock (monkeypatched, as on filesystems that refuse it) the file
is the lock and a dead local pid makes it stale.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from spillway.recipes.train import run_lock
from spillway.recipes.train.errors import RunError
from spillway.recipes.train.run_lock import LockOwner, RunDirectoryError, RunLock, RunLockedError

HOLDER = textwrap.dedent("""
    import sys, time
    from spillway.recipes.train.run_lock import RunLock
    lock = RunLock(sys.argv[1])
    lock.acquire()
    print("locked", flush=True)
    time.sleep(120)
""")


@pytest.fixture
def holder(tmp_path):
    """A child process holding tmp_path/run; killed (SIGKILL) at the end if still alive."""
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "run")], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    line = child.stdout.readline()
    assert line.strip() == "locked", child.communicate()[1][-2000:]
    yield child
    if child.poll() is None:
        child.kill()
        child.wait()


def test_a_second_writer_is_refused_naming_directory_and_owner(holder, tmp_path):
    with pytest.raises(RunLockedError) as excinfo:
        RunLock(tmp_path / "run").acquire()
    message = str(excinfo.value)
    assert "\n" not in message
    assert str(tmp_path / "run") in message
    assert f"pid {holder.pid} on host {socket.gethostname()}" in message
    assert isinstance(excinfo.value, RunError)  # the command line prints it as one line


def test_a_killed_owner_leaves_a_lock_the_next_run_takes_over(holder, tmp_path):
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (tmp_path / "run" / "run.lock").exists()  # SIGKILL runs no clean-up
    lock = RunLock(tmp_path / "run")
    previous = lock.acquire()
    assert previous is not None and previous.pid == holder.pid
    assert json.loads((tmp_path / "run" / "run.lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / "run" / "run.lock").exists()


def test_two_locks_in_one_process_conflict_and_release_frees_the_directory(tmp_path):
    with RunLock(tmp_path) as first:
        assert first.owner.pid == os.getpid()
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):
            RunLock(tmp_path).acquire()
    with RunLock(tmp_path):  # released: free again
        pass


def test_a_lock_that_cannot_be_removed_is_let_go_and_taken_over(tmp_path, monkeypatch):
    """A run folder made unwritable under a run: release raised PermissionError from the run's `finally`,
    hiding the run's own error (metrics.jsonl not writable) behind 'run.lock: Operation not permitted'."""
    lock = RunLock(tmp_path / "run")
    lock.acquire()
    real_unlink = type(lock.path).unlink

    def refuse(path, missing_ok=False):
        raise PermissionError(errno.EPERM, "Operation not permitted", str(path))

    monkeypatch.setattr(type(lock.path), "unlink", refuse)
    lock.release()   # no error: the flock is dropped, the file stays
    monkeypatch.setattr(type(lock.path), "unlink", real_unlink)
    assert lock.path.exists()
    again = RunLock(tmp_path / "run")
    assert again.acquire().pid == os.getpid()   # the file left behind names a holder that let go: taken over
    again.release()


def test_an_unwritable_run_directory_is_one_clear_error():
    # /sys refuses mkdir even to root (a chmod'ed folder would not stop root)
    with pytest.raises(RunDirectoryError, match=r"^/sys/spillway-test/run: cannot create the run directory"):
        RunLock("/sys/spillway-test/run").acquire()


@pytest.fixture
def no_flock(monkeypatch):
    """The filesystem refuses flock (as some network filesystems do)."""
    def refuse(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(run_lock.fcntl, "flock", refuse)


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def write_owner(run_dir, **fields):
    run_dir.mkdir(parents=True, exist_ok=True)
    owner = LockOwner(**{"pid": os.getpid(), "host": socket.gethostname(), "started": "2026-01-01T00:00:00+00:00",
                         "command": "spillway train tiny", "process_start_ticks": None, **fields})
    (run_dir / "run.lock").write_text(owner.to_json())
    return owner


def test_without_flock_a_dead_local_owner_is_stale(no_flock, tmp_path):
    stale = write_owner(tmp_path, pid=dead_pid())
    lock = RunLock(tmp_path)
    assert lock.acquire() == stale
    with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):  # and now it is ours
        RunLock(tmp_path).acquire()
    lock.release()
    assert not (tmp_path / "run.lock").exists()


def test_without_flock_a_reused_pid_is_stale(no_flock, tmp_path):
    # our own pid, alive, but recorded with another start time: the pid was reused
    ticks = run_lock._process_start_ticks(os.getpid())
    stale = write_owner(tmp_path, process_start_ticks=ticks + 1)
    with RunLock(tmp_path) as lock:
        assert lock.owner.pid == os.getpid()
    assert stale.is_gone()


@pytest.mark.parametrize("where", ["live pid here", "other host"])
def test_without_flock_a_live_or_unknowable_owner_is_refused(no_flock, tmp_path, where):
    if where == "live pid here":
        write_owner(tmp_path, process_start_ticks=run_lock._process_start_ticks(os.getpid()))
    else:
        write_owner(tmp_path, pid=dead_pid(), host="some-other-host")  # a pid here says nothing about there
    with pytest.raises(RunLockedError, match=rf"if that run is no longer running, delete {tmp_path}/run.lock"):
        RunLock(tmp_path).acquire()


def test_a_long_command_is_kept_whole_and_its_cut_in_an_error_line_is_said(tmp_path, monkeypatch):
    """The record cut another run's command at 300 characters without a word: a recipe's many --set flags
    were lost past it. The record keeps it whole; the error line cuts it and says where the rest is."""
    long_argv = ["spillway", "train", "tiny", *(f"--set=train.option_{i}={i}" for i in range(40))]
    monkeypatch.setattr(sys, "argv", long_argv)
    with RunLock(tmp_path):
        record = LockOwner.parse((tmp_path / run_lock.LOCK_FILENAME).read_text())
        assert record.command == " ".join(long_argv)
        described = record.describe()
    assert " ".join(long_argv)[:run_lock.DESCRIBED_COMMAND_CHARS] in described
    assert f"... and {len(' '.join(long_argv)) - run_lock.DESCRIBED_COMMAND_CHARS} characters more" in described
    assert described.endswith(f"in full in {run_lock.LOCK_FILENAME})")
