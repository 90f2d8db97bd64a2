"""When a test may skip: never under CI, so that a CI run cannot pass by skipping what it was meant to run.

Locally, tests that compile for a GPU without one (marked `needs_toolchain`)
skip where the CUDA toolkit's ptxas/libdevice is missing (a machine without
it cannot run them, and says so in the `-ra` summary), and fail where only the
compiler plugin is missing (`make test` installs it). Under CI (the `CI`
environment variable set to anything but "", "0", "false" or "no"; `.ci/run`
sets it) a test that would skip fails instead, with the reason: CI machines
must have what the suite needs.
"""

from __future__ import annotations

import os

CI_ENV = "CI"


def under_ci(environ=os.environ) -> bool:
    return environ.get(CI_ENV, "").strip().lower() not in ("", "0", "false", "no")


def toolchain_verdict(toolkit_missing: str | None, plugin_missing: str | None, ci: bool
                      ) -> tuple[str, str] | None:
    """("fail" | "skip", reason) for a test that needs the deviceless GPU compiler; None: run it."""
    if plugin_missing is not None:
        return "fail", f"deviceless GPU compile tests need the compiler plugin: {plugin_missing}"
    if toolkit_missing is not None:
        if ci:
            return "fail", f"CI must run the deviceless GPU compile tests, but: {toolkit_missing}"
        return "skip", f"no CUDA toolkit: {toolkit_missing}"
    return None
