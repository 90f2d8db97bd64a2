"""Where a test's time goes: its wall time beside the JAX tracing, lowering and XLA compiling inside it.

Opt-in, for finding what to make cheaper (README, "Tests and benchmarks"):

    SPILLWAY_TEST_COMPILE_LOG=/tmp/compile-log .venv/bin/python -m pytest -q -m "not slow"
    .venv/bin/python tests/compile_time_log.py /tmp/compile-log     # the summary by file and by test

Each pytest process (each xdist worker) writes its own `<prefix>.<worker>.tsv`: one row per test phase
(setup, call, teardown) with the wall seconds, the seconds JAX reported for tracing to a jaxpr, lowering
to StableHLO and compiling with XLA (the `/jax/core/compile/*` duration events, which a persistent-cache
hit reports as its retrieval instead of a compile), and how many XLA compiles there were. Only what runs
in the test's own process is counted: the CLI and planner processes a test starts are in its wall time.
"""

from __future__ import annotations

import collections
import os
import sys
import time

import pytest

TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
COMPILE = "/jax/core/compile/backend_compile_duration"
COLUMNS = ("nodeid", "phase", "wall_s", "trace_s", "lower_s", "compile_s", "compiles")


class CompileTimeLog:
    """A pytest plugin: one row per test phase, appended as the phase ends."""

    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)
        self._seconds = collections.Counter()
        self._compiles = 0
        import jax.monitoring
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)

    def _on_duration(self, event: str, seconds: float, **_):
        if event in (TRACE, LOWER, COMPILE):
            self._seconds[event] += seconds
            self._compiles += event == COMPILE

    def _phase(self, item, phase: str):
        self._seconds.clear()
        self._compiles = 0
        started = time.perf_counter()
        yield
        s = self._seconds
        self._file.write("\t".join([item.nodeid, phase, f"{time.perf_counter() - started:.3f}", f"{s[TRACE]:.3f}",
                                    f"{s[LOWER]:.3f}", f"{s[COMPILE]:.3f}", str(self._compiles)]) + "\n")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        yield from self._phase(item, "setup")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        yield from self._phase(item, "call")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item):
        yield from self._phase(item, "teardown")


def install(config) -> None:
    """Registers the plugin when SPILLWAY_TEST_COMPILE_LOG names a path prefix (called by tests/conftest.py)."""
    prefix = os.environ.get("SPILLWAY_TEST_COMPILE_LOG")
    if prefix:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        config.pluginmanager.register(CompileTimeLog(f"{prefix}.{worker}.tsv"), "spillway-compile-time-log")


def summary(prefix: str, top: int = 40) -> str:
    """The logged rows summed by test file and listed by test, largest wall time first."""
    folder, stem = os.path.split(os.path.abspath(prefix))
    rows = []
    for name in sorted(os.listdir(folder)):
        if name.startswith(stem + ".") and name.endswith(".tsv"):
            with open(os.path.join(folder, name)) as f:
                rows += [line.rstrip("\n").split("\t") for line in f if line.strip()]
    by_file, by_test = collections.defaultdict(lambda: [0.0] * 5), collections.defaultdict(lambda: [0.0] * 5)
    for nodeid, _phase, *numbers in rows:
        for table, key in ((by_file, nodeid.split("::")[0]), (by_test, nodeid)):
            table[key] = [a + float(b) for a, b in zip(table[key], numbers)]
    total = [sum(column) for column in zip(*by_file.values())] or [0.0] * 5
    header = f"{'wall s':>8} {'trace':>7} {'lower':>7} {'compile':>8} {'XLA n':>6}  "
    lines = [f"{len(by_test)} tests; wall {total[0]:.0f} s, of it tracing {total[1]:.0f} s, lowering "
             f"{total[2]:.0f} s, XLA compiling {total[3]:.0f} s ({int(total[4])} compiles)", "", header + "file"]
    for table, title in ((by_file, "file"), (by_test, "test")):
        if title == "test":
            lines += ["", header + "test"]
        for key, (wall, trace, lower, comp, n) in sorted(table.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"{wall:8.1f} {trace:7.1f} {lower:7.1f} {comp:8.1f} {int(n):6d}  {key}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(sys.argv[1], *(int(a) for a in sys.argv[2:3])))
