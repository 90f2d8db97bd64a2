"""Stopping a run on a signal without losing steps: SIGTERM and Ctrl-C save at a step boundary and exit.

SIGTERM (a scheduler's preemption notice) and SIGINT (Ctrl-C) both set a flag;
the train loop finishes the step in progress, saves it, and exits with the
status a shell reports for that signal (143, 130). The handler never saves
itself: a save in the middle of a step or of another save would write a state
that is half one step and half the next.

A second Ctrl-C quits at once, without saving: the first one puts SIGINT back
to the operating system's default action, so the second ends the process even
while it waits inside JAX (where a Python handler would only run afterwards).

With several processes a signal may reach only some of them, and a save that
only some processes enter hangs (orbax's save is collective). `GroupStop`
makes every process stop after the same step: each casts its own exit status
into a `distributed.StopVote` every step and acts on the vote of the step
before, which all processes read identically.
"""

from __future__ import annotations

import signal
import sys

import jax

from spillway.recipes.train import distributed

SIGTERM_EXIT_STATUS = 128 + signal.SIGTERM  # 143, what a shell reports for a SIGTERM'd process
SIGINT_EXIT_STATUS = 128 + signal.SIGINT    # 130, for Ctrl-C
_NAMES = {SIGTERM_EXIT_STATUS: "SIGTERM", SIGINT_EXIT_STATUS: "Ctrl-C"}


def signal_name(exit_status: int) -> str:
    return _NAMES.get(exit_status, f"exit status {exit_status}")


class StopSignals:
    """While active, SIGTERM and SIGINT set `exit_status` (0: no stop asked) instead of ending the process."""

    def __init__(self, echo=None):
        self.exit_status = 0
        self._echo = echo or (lambda text: print(text, file=sys.stderr, flush=True))
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # the next Ctrl-C ends the process at once
            self._echo("\nCtrl-C: saving at the end of this step and stopping (Ctrl-C again quits at once, "
                       "without saving)")
        self.exit_status = max(self.exit_status, 128 + signum)

    def __enter__(self) -> StopSignals:
        for signum in (signal.SIGTERM, signal.SIGINT):
            if signum == signal.SIGINT and signal.getsignal(signum) == signal.SIG_IGN:
                # inherited ignored (a background job of a script, nohup): a terminal's Ctrl-C is not meant for
                # it, and it ignored one while it prepared its data too (Python's own convention; SIGTERM stops it)
                continue
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: signals keep their previous handling
                pass
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()


class GroupStop:
    """Whether every process stops now; `poll()` once per step, after dispatching it.

    One process: the signal flag itself. Several: the vote cast one step
    earlier, so all processes answer the same at the same step.
    """

    def __init__(self, signals: StopSignals, mesh: jax.sharding.Mesh):
        self._signals = signals
        self._vote = distributed.StopVote(mesh) if jax.process_count() > 1 else None
        self._cast: jax.Array | None = None

    def poll(self) -> int:
        """The exit status to stop with after the step just dispatched, or 0 to go on."""
        if self._vote is None:
            return self._signals.exit_status
        agreed = int(self._cast) if self._cast is not None else 0
        self._cast = self._vote.cast(self._signals.exit_status)
        return agreed

    def poll_now(self) -> int:
        """As poll(), but answering for a signal that came up to now, not a step earlier: every process waits
        for the vote (and the one still pending). Called where all processes already wait together, after a
        save's blocking part: a signal during that save stops the run at the step just saved, where poll()
        would train one more step and save again."""
        if self._vote is None:
            return self._signals.exit_status
        pending = int(self._cast) if self._cast is not None else 0
        self._cast = None
        return max(pending, int(self._vote.cast(self._signals.exit_status)))
