"""Test-session setup: 8 fake CPU devices, one JAX compilation cache per run, and no skipping under CI.

XLA reads XLA_FLAGS once, when the backend starts, so the device count must be
set before anything imports jax; pytest imports conftest.py first.

Compiling is most of the suite's time, and many tests compile the same
program: every train of the micro recipe (tests/micro_recipe.py), each CLI
process, each planner compile process. JAX's persistent compilation cache,
in a folder made for this run of the suite (set through the environment, so
that the processes the tests start use it too) and removed at its end,
compiles each of them once per run (README, "Tests and benchmarks", has the
figures). JAX_COMPILATION_CACHE_DIR set beforehand is used and kept instead.

`@pytest.mark.needs_toolchain` marks tests that compile for a GPU without one;
tests/ci_gate.py decides whether a machine without the toolchain skips them or
fails them. Under CI any skip at all is turned into a failure with its reason.

The planner's compile cache (recipes/plan/compile_cache.py) is off for the session
(SPILLWAY_PLAN_CACHE=0): tests count their compiles, and must not read or fill
the user's ~/.cache/spillway; the cache's own tests turn it on in a tmp folder.

SIGINT ignored by the shell that started the suite is made Ctrl-C again (below).

SPILLWAY_TEST_COMPILE_LOG=<prefix> logs each test's wall time beside its JAX tracing, lowering and
XLA compiling (tests/compile_time_log.py), to find where the suite's time goes.

`needs_torch` marks the tests whose reference is torch + transformers (those
that take the `transformers` fixture, and modules marked so): they run only in
the Python 3.11 environment, and CI selects them there by this marker.
"""

import os
import shutil
import signal
import tempfile

from fast_compile_flags import with_fast_compile_flags

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Ctrl-C as a terminal gives it, however the suite was started: a suite started in the background by a shell
# without job control (`nohup make test &`, a script's `&`) inherits SIGINT ignored, and its processes, as the
# runs they start, rightly keep it ignored (recipes/train/preemption.py), so a test that sends a child Ctrl-C
# waited for an answer that never came (a run of the default suite hung there for good).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# A program is written to the cache only if it took this long to compile: below it, writing costs more than a
# later compile would.
_COMPILE_CACHE_FROM_S = "0.2"
_RUN_COMPILE_CACHE = None
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _RUN_COMPILE_CACHE = tempfile.mkdtemp(prefix="spillway-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _RUN_COMPILE_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", _COMPILE_CACHE_FROM_S)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("SPILLWAY_PLAN_CACHE", "0")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# The tests' programs are tiny: XLA's CPU code generation is cheapened for them (tests/fast_compile_flags.py says
# which flags, per jaxlib, and what they save). XLA's HLO passes, which decide what a program computes, where
# its arrays live and what the planner reads, run as before.
os.environ["XLA_FLAGS"] = with_fast_compile_flags(os.environ["XLA_FLAGS"])

import pytest  # noqa: E402

import ci_gate  # noqa: E402
import compile_time_log  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_toolchain: compiles for a GPU without one (CUDA toolkit + plugin)")
    config.addinivalue_line("markers", "needs_torch: its reference is torch + transformers (the `parity` extra)")
    config.addinivalue_line("markers", "recipe_picks: the planner's pick for a stored GPU recipe (slow; CI runs "
                                       "them in a step of their own, last: .ci/run)")
    compile_time_log.install(config)


def pytest_unconfigure(config):
    if _RUN_COMPILE_CACHE is not None:
        shutil.rmtree(_RUN_COMPILE_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def micro_data_cache(tmp_path_factory):
    """A data cache the micro recipe's runs share (tests/micro_recipe.py): the embedded corpus tokenized once."""
    return tmp_path_factory.mktemp("micro-data-cache")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "transformers" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.needs_torch)


def pytest_runtest_setup(item):
    if item.get_closest_marker("needs_toolchain") is None:
        return
    from spillway.recipes.plan import plugin
    verdict = ci_gate.toolchain_verdict(plugin.cuda_toolkit_missing_reason(), plugin.plugin_missing_reason(),
                                        ci_gate.under_ci())
    if verdict is not None:
        action, reason = verdict
        (pytest.fail if action == "fail" else pytest.skip)(reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail") and ci_gate.under_ci():
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        if ci_gate.skip_allowed_under_ci(reason):
            return
        report.outcome = "failed"
        report.longrepr = f"CI does not pass by skipping: {reason}"
