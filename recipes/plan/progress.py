"""`spillway plan`'s line per finished compile, on stderr whether or not it is a terminal.

A plan compiles for minutes; a user whose output goes to a file (or a pipe, or CI's log) must see it work:
which candidate finished, in how many seconds, and whether it fits (the same verdict as the table's,
recipes/plan/result.refusals), or that it came from the compile cache (recipes/plan/compile_cache.py) or
was skipped without compiling (recipes/plan/pruning.py). The searches after the candidates (a split, the
weights across the turn) compile in rounds whose size is known only when each starts: each round is
announced and counted on its own ("[search 2/3]"), so a count never grows under the reader.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.plan.result import GiB, refusals


def write_to_stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class CompileProgress:
    """Counts the candidates done (of `total`) and writes one line for each, through `write`; thread-safe (the
    threads that read the compile processes call it)."""

    def __init__(self, total: int, hbm_limit: float, devices: int, host_ram: float,
                 write: Callable[[str], None] | None = write_to_stderr):
        self.total, self.hbm_limit, self.devices, self.host_ram = total, hbm_limit, devices, host_ram
        self.write = write
        self.done = 0
        self.rounds = 0   # the searches' rounds started; lines of a round read "[search done/total]"
        self._lock = threading.Lock()

    def start_round(self, count: int) -> None:
        """A search's `count` further compiles, counted from 1 in their own lines after one announcing them."""
        with self._lock:
            self.rounds += 1
            self.done, self.total = 0, count
        if self.write is not None:
            self.write(f"spillway plan: search round {self.rounds}: {count} more "
                       f"{'compile' if count == 1 else 'compiles'}")

    def _line(self, candidate: Candidate, what: str) -> None:
        if self.write is None:
            return
        with self._lock:
            self.done += 1
            counted = f"search {self.done}/{self.total}" if self.rounds else f"{self.done}/{self.total}"
            self.write(f"spillway plan: [{counted}] {candidate.label}: {what}")

    def finished(self, candidate: Candidate, result: dict, *, cached: bool = False) -> None:
        """A compile's result (the compile process's dict: "report" or "error", "seconds")."""
        how = "from the compile cache" if cached else f"compiled in {result.get('seconds', 0.0):.1f} s"
        report = result.get("report")
        if report is None:
            first = (result.get("error") or "unknown error").splitlines()[0][:200]
            self._line(candidate, f"{how}, compile failed: {first}")
            return
        reasons = refusals(candidate, report, self.hbm_limit, self.devices, self.host_ram)
        verdict = "fits" if not reasons else "does not fit (" + "; ".join(reasons) + ")"
        self._line(candidate, f"{how}, {verdict}; HBM {report['hbm_bytes'] / GiB:.2f} GiB, "
                              f"host {report['host_bytes'] / GiB:.2f} GiB")

    def skipped(self, candidate: Candidate, because: str) -> None:
        self._line(candidate, f"not compiled: {because}")
