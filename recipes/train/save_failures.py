"""What a failed checkpoint save leaves: orbax's error log kept out of the output, and its unfinished folder.

A save that fails in orbax's background threads (a full disk, a file system
gone read-only) is logged by orbax at ERROR level, with a full traceback, from
each thread it crossed (hundreds of lines), and then raised to the caller,
where RunCheckpointer turns it into one CheckpointError naming the step, the
cause and what was cleaned up. The log adds nothing to that line, so records
at ERROR or above that orbax's own source files emit are dropped; everything
else (warnings, other libraries) passes. `--debug` still shows the chained
traceback of the error itself. Two more echoes of the same failure are dropped:
the writes orbax abandoned finish after its event loop has closed, and each
one's completion callback (`call_soon_threadsafe` on that loop) raises
"Event loop is closed" into `sys.unraisablehook` (about 20 tracebacks for the
tiny recipe on a full disk); and asyncio logs orbax's abandoned tasks as
"Task exception was never retrieved" from its own source.

The `<step>.orbax-checkpoint-tmp` folder a failed save leaves is removed at
once (`remove_unfinished`; on a full disk it holds the space a rerun needs),
and the error says so, or names it where it could not be removed.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import time
import traceback

_ORBAX_SOURCES = f"{os.sep}orbax{os.sep}"


class OrbaxErrorLogFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and _ORBAX_SOURCES in (record.pathname or ""))


class OrbaxTaskLogFilter(logging.Filter):
    """asyncio's "Task exception was never retrieved" for a task running orbax's code."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (record.levelno >= logging.ERROR and message.startswith("Task exception was never retrieved")
                    and _ORBAX_SOURCES in message)


def is_a_closed_loops_callback(unraisable) -> bool:
    """Whether an unraisable error is a completion callback scheduled on an event loop that has closed."""
    error = unraisable.exc_value
    return (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
            and any(frame.name == "call_soon_threadsafe" for frame in traceback.extract_tb(unraisable.exc_traceback)))


class QuietClosedLoopCallbacks:
    """A `sys.unraisablehook` passing everything to the hook before it but `is_a_closed_loops_callback`."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, unraisable) -> None:
        if not is_a_closed_loops_callback(unraisable):
            self.previous(unraisable)


def quiet_orbax_error_logs() -> None:
    """Installs the filters on the loggers orbax writes to (absl's, orbax's own, asyncio's for its tasks) and
    the unraisable hook (module docstring), once."""
    for name, kind in (("absl", OrbaxErrorLogFilter), ("orbax", OrbaxErrorLogFilter), ("asyncio", OrbaxTaskLogFilter)):
        logger = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())
    if not isinstance(sys.unraisablehook, QuietClosedLoopCallbacks):
        sys.unraisablehook = QuietClosedLoopCallbacks(sys.unraisablehook)


# the suffix of the folder orbax writes a step into before renaming it `<step>` (atomic finalisation)
UNFINISHED_SUFFIX = ".orbax-checkpoint-tmp"


def unfinished_saves(directory, step: int | None = None) -> list:
    """The `<step>.orbax-checkpoint-tmp*` entries in `directory`: of `step`, or of every step when None."""
    return sorted(directory.glob(f"{'*' if step is None else step}{UNFINISHED_SUFFIX}*"))


def join_threads_started_since(before: set, limit_s: float) -> list[str]:
    """Joins the Python threads started since `before` (a `set(threading.enumerate())`) that still run, at
    most `limit_s` in all: a failed save's orbax commit threads and asyncio workers go on writing into the
    step's unfinished folder (making it again once removed) until they end. Returns the names of those still
    running at the limit."""
    deadline = time.monotonic() + limit_s
    started = [t for t in threading.enumerate() if t not in before and t is not threading.current_thread()]
    for thread in started:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [thread.name for thread in started if thread.is_alive()]


# How long a removal watches for the folder to come back (see remove_unfinished), and how often it looks.
SETTLE_S, SETTLE_LIMIT_S, POLL_S = 0.5, 5.0, 0.05


def remove_unfinished(directory, step: int | None) -> str:
    """Deletes the `<step>.orbax-checkpoint-tmp*` folders a failed save of `step` left; says what happened.

    Orbax runs a save's directory coroutines on an event loop in a thread of its own, even for its
    synchronous saves, and an error raised in the caller's thread does not stop them; nothing it exposes
    joins them (`wait_until_finished` waits for async saves only). So a folder can be made just after it was
    removed (a loaded machine showed it), or a file added while it is being removed: the removal is
    repeated until none has appeared for SETTLE_S (at most SETTLE_LIMIT_S). A folder still made later is
    removed when the directory is next opened. The caller first joins what the save started
    (join_threads_started_since, checkpoint_io.settle_writes), so this watch is the last guard."""
    if step is None:
        return "nothing left behind"
    leftovers, kept = [], []
    started = quiet_since = time.monotonic()
    while True:
        found = [folder for folder in unfinished_saves(directory, step) if str(folder) not in kept]
        now = time.monotonic()
        if now - started >= SETTLE_LIMIT_S:   # bounded even while folders keep appearing
            kept += [str(folder) for folder in found]
            break
        if found:
            quiet_since = now
        elif now - quiet_since >= SETTLE_S:
            break
        for folder in found:
            leftovers.append(folder)
            try:
                shutil.rmtree(folder)
            except OSError:   # gone already, or a writer added a file meanwhile ("Directory not empty"):
                pass          # looked at again at the next poll, kept only at the limit
        time.sleep(POLL_S)
    if kept:
        return f"the unfinished save is left in {', '.join(kept)}: delete it"
    return f"its unfinished folder {leftovers[0].name} was removed" if leftovers else "nothing left behind"
