"""Quiets what a failed checkpoint read leaves behind: tensorstore reads that finish after orbax's event loop closed.

Orbax reads a checkpoint's arrays through tensorstore inside an asyncio event
loop of its own (`asyncio.run`). When one read fails (a truncated or missing
array file: a corrupt step), the loop ends with that exception while the
other reads are still in flight, and two kinds of noise follow, dozens of
lines for one corrupt step, interleaved, some before and some after the
command's own one-line message:

- each read finishing later hands its result to the closed loop from
  tensorstore's thread, which raises RuntimeError("Event loop is closed")
  where no Python code can catch it: Python prints it as an unraisable error;
- each read that failed too ends a task nobody awaited any more: asyncio
  logs "Task exception was never retrieved" with its traceback.

Nothing is lost by dropping them: the read had already failed and is
reported, once, by the caller. `quiet_failed_reads()` around a read drops
exactly those: the closed-loop errors from then on (they can arrive any time
later), the never-retrieved tasks while it is open (collected before it
closes). Every other unraisable error and asyncio log record still goes
where it went.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
from collections.abc import Iterator

_hook_installed = False


def _is_closed_loop_callback(unraisable) -> bool:
    return (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"
            and unraisable.object is None)


def _install_closed_loop_hook() -> None:
    global _hook_installed
    if _hook_installed:
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        if not _is_closed_loop_callback(unraisable):
            previous(unraisable)

    sys.unraisablehook = hook
    _hook_installed = True


class _NeverRetrievedTasks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Task exception was never retrieved")


@contextlib.contextmanager
def quiet_failed_reads() -> Iterator[None]:
    """Around a checkpoint read: if it fails, its stray reads print nothing (the module docstring says what)."""
    _install_closed_loop_hook()
    asyncio_log, quiet = logging.getLogger("asyncio"), _NeverRetrievedTasks()
    asyncio_log.addFilter(quiet)
    try:
        yield
    except BaseException:
        gc.collect()   # the failed tasks' reports are made when they are collected: here, inside the filter
        raise
    finally:
        asyncio_log.removeFilter(quiet)
