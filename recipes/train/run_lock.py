"""One run per run directory: `<run>/run.lock`, held for as long as the run writes there.

Two runs started into the same directory would overwrite each other's
checkpoints and metrics and both report success. The train loop therefore
takes this lock before it writes anything; a second writer is refused with an
error naming the directory and the owner (pid, host, start time, command).

How the lock is held, and why a crashed run does not keep it:

* Where the filesystem supports `flock` (local disks, NFSv4, most cluster
  filesystems mounted with locking), the lock is an exclusive `flock` on the
  file. The kernel (or the lock server) drops it when the owning process dies,
  however it dies, so a run killed by SIGKILL or an out-of-memory kill leaves
  a file that the next run simply takes over. The JSON inside is only there to
  say who holds it.
* Where `flock` is refused (ENOLCK, EOPNOTSUPP: some network filesystems), the
  file itself is the lock (created with O_EXCL). A leftover file is stale when
  its owner ran on this host and its pid is gone (or was reused by another
  process: the owner's start time is recorded). An owner on another host cannot
  be checked from here: the error says to delete the file if that run is gone.

While the run lives, a watcher thread looks at the lock file every second
(`watch`): a file deleted under it (by hand, or by following advice meant for
a dead run) is re-created at once, with the holder's record, so that a second
run started afterwards is refused as before; a file replaced by another run's
(a second run that got in first) marks the lock lost, and the train loop stops
at its next step or save without writing more (`check`, RunLockLostError).

A filesystem whose `flock` succeeds but only locally (NFS mounted with
`local_lock=flock`) cannot see a writer on another host; nothing here can.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import threading
from pathlib import Path

from spillway.recipes.train.errors import RunError

LOCK_FILENAME = "run.lock"
DESCRIBED_COMMAND_CHARS = 300   # of another run's command in an error line; run.lock holds all of it
_NO_FLOCK_ERRNOS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
_ATTEMPTS = 5  # a releasing owner unlinks the file between our open and our flock: try again
WATCH_SECONDS = 1.0  # how often the holder looks at its lock file


class RunLockedError(RunError):
    """Another run holds the run directory."""


class RunLockLostError(RunLockedError):
    """The lock file was replaced by another run's while this run held it."""


class RunDirectoryError(RunError):
    """The run directory cannot be created or written."""


def _process_start_ticks(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (Linux); tells a reused pid from the original."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces: count fields after the last ')'
    return int(stat[stat.rindex(")") + 2:].split()[19])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


@dataclasses.dataclass(frozen=True)
class LockOwner:
    """Who holds a run directory, as written into the lock file."""

    pid: int
    host: str
    started: str                 # ISO 8601, UTC
    command: str
    process_start_ticks: int | None = None

    @classmethod
    def this_process(cls) -> LockOwner:
        return cls(pid=os.getpid(), host=socket.gethostname(),
                   started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   command=" ".join(sys.argv), process_start_ticks=_process_start_ticks(os.getpid()))

    @classmethod
    def parse(cls, text: str) -> LockOwner | None:
        """The owner a lock file names; None for an empty or unreadable file (an owner that died mid-write)."""
        try:
            fields = json.loads(text)
            return cls(pid=int(fields["pid"]), host=str(fields["host"]), started=str(fields["started"]),
                       command=str(fields.get("command", "")),
                       process_start_ticks=fields.get("process_start_ticks"))
        except (ValueError, KeyError, TypeError):
            return None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self)) + "\n"

    def describe(self) -> str:
        command = self.command or "unknown command"
        if len(command) > DESCRIBED_COMMAND_CHARS:   # an error line stays readable; the record keeps it whole
            command = (f"{command[:DESCRIBED_COMMAND_CHARS]}... and {len(command) - DESCRIBED_COMMAND_CHARS} "
                       f"characters more, in full in {LOCK_FILENAME}")
        return f"pid {self.pid} on host {self.host}, started {self.started} ({command})"

    def is_gone(self) -> bool:
        """Whether this owner certainly no longer runs: on this host, its pid is gone or now another process."""
        if self.host != socket.gethostname():
            return False
        if not _pid_alive(self.pid):
            return True
        ticks = _process_start_ticks(self.pid)
        return self.process_start_ticks is not None and ticks is not None and ticks != self.process_start_ticks


def live_owner(run_dir: str | os.PathLike) -> LockOwner | None:
    """Who holds `run_dir` now, read from its lock file without taking it (no flock, which a run starting at that
    moment would find held): its owner unless that process is certainly gone; None where there is no lock file or
    its record cannot be read (commands that only look, such as `spillway prepare`)."""
    try:
        owner = LockOwner.parse((Path(run_dir) / LOCK_FILENAME).read_text())
    except OSError:
        return None
    return owner if owner is not None and not owner.is_gone() else None


class RunLock:
    """Exclusive ownership of a run directory (`with RunLock(run_dir): ...`).

    `acquire()` returns the owner of a stale lock it took over (None if the
    directory was free), so the caller can say so; it raises RunLockedError if
    a live run holds the directory and RunDirectoryError if the directory
    cannot be written.
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(os.path.abspath(os.fspath(run_dir)))
        self.path = self.run_dir / LOCK_FILENAME
        self.owner: LockOwner | None = None
        self._fd: int | None = None
        self._uses_flock = True
        self._guard = threading.Lock()        # the watcher and release() both touch _fd
        self._stop_watching = threading.Event()
        self._watcher: threading.Thread | None = None
        self.lost: str | None = None           # why the lock is no longer ours (another run's file is there)
        self.retaken = 0                       # times the file was found deleted and re-created
        self._retaken_said = 0

    # -- taking it

    def acquire(self) -> LockOwner | None:
        if self.owner is not None:
            raise RuntimeError(f"{self.path}: already held by this RunLock")
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunDirectoryError(f"{self.run_dir}: cannot create the run directory "
                                    f"({type(e).__name__}: {e.strerror or e})") from e
        for _ in range(_ATTEMPTS):
            fd, created = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = LockOwner.parse(self._read(fd))
                os.close(fd)
                raise self._locked_error(owner) from None
            except OSError as e:
                if created and self._still_the_file_at_path(fd):
                    self.path.unlink(missing_ok=True)   # the empty file this probe made is no one's lock
                os.close(fd)
                if e.errno not in _NO_FLOCK_ERRNOS:
                    raise RunDirectoryError(f"{self.path}: cannot lock the run directory "
                                            f"({type(e).__name__}: {e.strerror or e})") from e
                self._uses_flock = False
                return self._acquire_exclusive_file()
            if not self._still_the_file_at_path(fd):
                os.close(fd)  # its owner released it (unlinked) between our open and flock
                continue
            previous = LockOwner.parse(self._read(fd))  # a crashed owner's record: flock says it is gone
            self._write_owner(fd)
            self._fd = fd
            return previous
        raise RunLockedError(f"{self.run_dir}: the run lock {self.path} keeps changing hands; "
                             f"another run is starting and stopping in this directory")

    def _open(self) -> tuple[int, bool]:
        """(a descriptor of the lock file, whether this call created it)."""
        try:
            try:
                return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644), False
        except OSError as e:
            raise RunDirectoryError(f"{self.run_dir}: cannot write to the run directory "
                                    f"({type(e).__name__}: {e.strerror or e})") from e

    def _still_the_file_at_path(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    @staticmethod
    def _read(fd: int) -> str:
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks).decode("utf-8", "replace")

    def _write_owner(self, fd: int) -> None:
        owner = LockOwner.this_process()
        try:
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, owner.to_json().encode())
            os.fsync(fd)
        except OSError as e:
            os.close(fd)
            raise RunDirectoryError(f"{self.run_dir}: cannot write to the run directory "
                                    f"({type(e).__name__}: {e.strerror or e})") from e
        self.owner = owner

    def _acquire_exclusive_file(self) -> LockOwner | None:
        """The lock without flock: the file's existence is the lock; a dead local owner's file is replaced."""
        replaced = None
        for _ in range(_ATTEMPTS):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                try:
                    text = self.path.read_text()
                except FileNotFoundError:
                    continue  # released meanwhile
                owner = LockOwner.parse(text)
                if owner is None or not owner.is_gone():
                    # an unparsable file may be an owner still writing it: not provably stale
                    raise self._locked_error(owner) from None
                if self.path.read_text() == text:  # narrow the window in which another run replaced it
                    self.path.unlink(missing_ok=True)
                replaced = owner
                continue
            except OSError as e:
                raise RunDirectoryError(f"{self.run_dir}: cannot write to the run directory "
                                        f"({type(e).__name__}: {e.strerror or e})") from e
            self._write_owner(fd)
            self._fd = fd
            return replaced
        raise RunLockedError(f"{self.run_dir}: the run lock {self.path} keeps changing hands; "
                             f"another run is starting and stopping in this directory")

    def _locked_error(self, owner: LockOwner | None) -> RunLockedError:
        who = owner.describe() if owner is not None else "an owner whose record is unreadable"
        how = ("wait for it to finish or stop it, or use another checkpoint.dir" if self._uses_flock else
               f"if that run is no longer running, delete {self.path}")
        return RunLockedError(f"{self.run_dir}: another run is writing this run directory ({who}); {how}")

    # -- holding it

    def watch(self, interval: float = WATCH_SECONDS) -> None:
        """Starts the thread that keeps the lock file in place (module docstring); release() stops it."""
        if self._fd is None or self._watcher is not None:
            return
        self._stop_watching.clear()

        def loop():
            while not self._stop_watching.wait(interval):
                self.inspect()

        self._watcher = threading.Thread(target=loop, name="spillway-run-lock", daemon=True)
        self._watcher.start()

    def inspect(self) -> None:
        """Looks at the lock file once: re-creates it if deleted, marks the lock lost if another run's is there."""
        with self._guard:
            if self._fd is None or self.lost is not None or self._still_the_file_at_path(self._fd):
                return
            if self.path.exists():
                self.lost = self._foreign_owner()
                return
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self.lost = self._foreign_owner()   # another run created it between our look and our open
                return
            except OSError as e:
                self.lost = f"the lock file was deleted and cannot be re-created ({e.strerror or e})"
                return
            if self._uses_flock:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    self.lost = self._foreign_owner()
                    return
            owner = self.owner
            try:
                self._write_owner(fd)   # closes fd if it fails
            except RunDirectoryError as e:
                self.lost = f"the lock file was deleted and cannot be re-written ({e})"
                return
            self.owner = owner          # the same holder as before: keep its original record's start
            os.close(self._fd)
            self._fd = fd
            self.retaken += 1

    def _foreign_owner(self) -> str:
        try:
            owner = LockOwner.parse(self.path.read_text())
        except OSError:
            owner = None
        who = owner.describe() if owner is not None else "an owner whose record is unreadable"
        return f"{self.path} was replaced by another run's lock ({who})"

    def check(self, say=None) -> None:
        """Raises RunLockLostError once another run holds the directory; says when the file was re-created."""
        if self._fd is None:
            return
        self.inspect()
        if self.lost is not None:
            raise RunLockLostError(f"{self.run_dir}: this run's lock is lost: {self.lost}; two runs must not "
                                   f"write one run directory, so this one stops here without writing more "
                                   f"(stop the other run, or let it continue alone)")
        if say is not None and self.retaken > self._retaken_said:
            self._retaken_said = self.retaken
            say(f"warning: {self.path} was deleted while this run holds it; re-created, so a second run into "
                f"this directory is still refused (never delete the lock of a run that is running)")

    # -- letting go

    def release(self) -> None:
        """Deletes the lock file (if it is still ours) and lets go; safe to call twice."""
        self._stop_watching.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None
        with self._guard:
            if self._fd is None:
                return
            fd, self._fd = self._fd, None
            try:
                if self._still_the_file_at_path(fd):
                    self.path.unlink(missing_ok=True)
            except OSError:
                # A folder made unwritable under the run: the lock file stays, with no holder once the flock
                # drops below, and the next run takes it over (`acquire`). Raised here, in the `finally` of a run
                # that failed for the same reason, it hid that run's own error behind "run.lock: not permitted".
                pass
            finally:
                os.close(fd)  # drops the flock, after the unlink: a waiting run then finds no file or a new one
                self.owner = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()
