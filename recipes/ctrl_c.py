"""Ctrl-C that always stops a `spillway` command, even when it lands where Python swallows exceptions.

Python turns SIGINT into a KeyboardInterrupt raised in whatever Python code runs
at that moment. When that code is a garbage-collector callback (JAX registers
one, `_xla_gc_callback`), a `__del__` or a weakref callback, the interpreter
prints "Exception ignored in ..." and carries on: the command ran to the end
and exited 0, as if Ctrl-C had never been pressed.

`interrupts_until_caught` raises the KeyboardInterrupt as Python does (but
not inside a gc callback: there it only asks for the signal again a moment
later), and then, until the command's own `except KeyboardInterrupt` says it
arrived (`caught`), delivers SIGINT again every half second: a swallowed one
is raised anew at a later point, in ordinary code. The train loop's own handler
(recipes/train/preemption.py) replaces this one while steps run and puts it
back after.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading

REDELIVER_S = 0.5
GC_DELAY_S = 0.02   # a gc callback returns in well under this: the signal comes again after it


def _inside_gc_callback(frame) -> bool:
    """Whether `frame` (where the signal landed) runs inside one of the garbage collector's callbacks."""
    callbacks = {getattr(callback, "__code__", None) for callback in gc.callbacks}
    while frame is not None:
        if frame.f_code in callbacks:
            return True
        frame = frame.f_back
    return False


class _Pending:
    """Whether a KeyboardInterrupt was raised and not yet seen by the command."""

    def __init__(self):
        self.raised = False
        self.timer: threading.Timer | None = None

    def handle(self, signum, frame) -> None:
        self.raised = True
        if _inside_gc_callback(frame):   # raised there, it would print "Exception ignored" and be lost
            self._schedule(GC_DELAY_S)
            return
        self._schedule(REDELIVER_S)
        raise KeyboardInterrupt

    def _schedule(self, delay_s: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = threading.Timer(delay_s, self._redeliver)
        self.timer.daemon = True
        self.timer.start()

    def _redeliver(self) -> None:
        # Only while this handler is still the one installed: another (the train loop's) decides for itself.
        if self.raised and signal.getsignal(signal.SIGINT) == self.handle:
            os.kill(os.getpid(), signal.SIGINT)

    def caught(self) -> None:
        self.raised = False
        if self.timer is not None:
            self.timer.cancel()


@contextlib.contextmanager
def interrupts_until_caught():
    """SIGINT raises KeyboardInterrupt, again and again until the body lets one out (or has none raised)."""
    pending = _Pending()
    try:
        # A command started with SIGINT ignored (`cmd &` in a script) keeps ignoring it, as Python would.
        previous = (signal.getsignal(signal.SIGINT) if signal.getsignal(signal.SIGINT) == signal.SIG_IGN
                    else signal.signal(signal.SIGINT, pending.handle))
    except ValueError:   # not the main thread: SIGINT keeps its handling
        yield
        return
    try:
        yield
    except KeyboardInterrupt:
        pending.caught()
        raise
    finally:
        pending.caught()
        signal.signal(signal.SIGINT, previous)
