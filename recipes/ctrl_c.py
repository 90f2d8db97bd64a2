"""Ctrl-C that always stops a `spillway` command, even when it lands where Python swallows exceptions.

Python turns SIGINT into a KeyboardInterrupt raised in whatever Python code runs
at that moment. When that code is a garbage-collector callback (JAX registers
one, `_xla_gc_callback`), a `__del__` or a weakref callback, the interpreter
hands the exception to `sys.unraisablehook`, which prints "Exception ignored in
..." and carries on: the command ran to the end and exited 0, as if Ctrl-C had
never been pressed.

`interrupts_until_caught` keeps Python's own handling, and while it is active
the unraisable hook takes a swallowed KeyboardInterrupt as what it is: it says
nothing and delivers SIGINT again a moment later, once the callback has
returned, so it is raised in ordinary code. Only a swallowed one is delivered
again: a Ctrl-C that reached the command's code is not repeated while the
command cleans up (an asynchronous checkpoint save finishing, say). The train
loop's own handler (recipes/train/preemption.py) replaces SIGINT's while steps
run and puts it back after.

SIGTERM, while it is active, raises `Terminated` (a KeyboardInterrupt) the same
way: a scheduler's SIGTERM before the first step (data preparation, compiling)
ended the process on the spot, without a word, and left the run folder and its
lock behind, where Ctrl-C at the same moment cleaned up and said so. The train
loop's handler takes SIGTERM too while steps run (it saves first).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

REDELIVER_S = 0.02   # the callback that swallowed it returns well within this


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is: every clean-up a Ctrl-C runs, runs for it too."""


def _raise_terminated(signum, frame):
    raise Terminated


class _Swallowed:
    """The unraisable hook while a command runs: a KeyboardInterrupt swallowed is delivered again."""

    def __init__(self, previous_hook):
        self.previous_hook = previous_hook

    def __call__(self, unraisable) -> None:
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            which = signal.SIGTERM if issubclass(unraisable.exc_type, Terminated) else signal.SIGINT
            timer = threading.Timer(REDELIVER_S, self._redeliver, args=(which,))
            timer.daemon = True
            timer.start()
            return
        self.previous_hook(unraisable)

    @staticmethod
    def _redeliver(which: int) -> None:
        # Only while the raising handler is on: the train loop's handler (a flag, no exception) decides for
        # itself, and a command that has ignored SIGINT keeps ignoring it.
        raising = signal.default_int_handler if which == signal.SIGINT else _raise_terminated
        if signal.getsignal(which) is raising:
            os.kill(os.getpid(), which)


@contextlib.contextmanager
def interrupts_until_caught():
    """While the body runs, a Ctrl-C that Python swallowed in a callback is delivered again (module docstring)."""
    hook = _Swallowed(sys.unraisablehook)
    sys.unraisablehook = hook
    try:
        previous_term = signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:   # not the main thread: SIGTERM keeps its handling
        previous_term = None
    try:
        yield
    finally:
        if sys.unraisablehook is hook:
            sys.unraisablehook = hook.previous_hook
        if previous_term is not None and signal.getsignal(signal.SIGTERM) is _raise_terminated:
            signal.signal(signal.SIGTERM, previous_term)
