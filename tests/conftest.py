"""Test-session setup: 8 fake CPU devices, and no skipping under CI.

XLA reads XLA_FLAGS once, when the backend starts, so the device count must be
set before anything imports jax; pytest imports conftest.py first.

`@pytest.mark.needs_toolchain` marks tests that compile for a GPU without one;
tests/ci_gate.py decides whether a machine without the toolchain skips them or
fails them. Under CI any skip at all is turned into a failure with its reason.

`needs_torch` marks the tests whose reference is torch + transformers (those
that take the `transformers` fixture, and modules marked so): they run only in
the Python 3.11 environment, and CI selects them there by this marker.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import pytest  # noqa: E402

import ci_gate  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_toolchain: compiles for a GPU without one (CUDA toolkit + plugin)")
    config.addinivalue_line("markers", "needs_torch: its reference is torch + transformers (the `parity` extra)")


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
