"""When a test may skip: never under CI, so that a CI run cannot pass by skipping what it was meant to run.

Locally, tests that compile for a GPU without one (marked `needs_toolchain`)
skip where the CUDA toolkit's ptxas/libdevice is missing (a machine without
it cannot run them, and says so in the `-ra` summary), and fail where only the
compiler plugin is missing (`make test` installs it). Under CI (the `CI`
environment variable set to anything but "", "0", "false" or "no"; `.ci/run`
sets it) a test that would skip fails instead, with the reason: CI machines
must have what the suite needs.

One declared exception: the Python 3.12/3.13 environments of the JAX version
matrix install no torch (its pinned CPU wheel exists here only for 3.11;
elsewhere pip would fetch a multi-GB CUDA build), and their make targets say so
with SPILLWAY_ENV_WITHOUT_TORCH=1. There, and only for a skip whose reason is
the missing torch/transformers, the Hugging Face parity tests may skip; the
3.11 environment runs them.
"""

from __future__ import annotations

import os

CI_ENV = "CI"


def under_ci(environ=os.environ) -> bool:
    return environ.get(CI_ENV, "").strip().lower() not in ("", "0", "false", "no")


WITHOUT_TORCH_ENV = "SPILLWAY_ENV_WITHOUT_TORCH"


def skip_allowed_under_ci(reason: str, environ=os.environ) -> bool:
    """Whether CI may let this skip stand: only a torch-less matrix environment's parity tests."""
    declared = environ.get(WITHOUT_TORCH_ENV, "").strip() == "1"
    return declared and ("torch" in reason or "transformers" in reason)


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
