"""The environment of a process a test starts (the `spillway` command, a training child): the CPU backend
and XLA's LLVM backend at optimisation level 0, as in the suite's own processes (tests/conftest.py: the
tests' programs are tiny, and LLVM's optimisation of them costs more compile time than it saves). One CPU
device unless told otherwise: a user's run on a laptop, not the suite's 8 fake devices."""

from __future__ import annotations

import os

CHILD_XLA_FLAGS = "--xla_backend_optimization_level=0"


def child_env(devices: int | None = None, base: dict | None = None, **extra) -> dict:
    """`base` (os.environ by default) with the CPU backend, LLVM at level 0 and `devices` fake CPU devices
    (one, the backend's own count, when None), then `extra`."""
    env = dict(os.environ if base is None else base)
    flags = CHILD_XLA_FLAGS if devices is None else f"--xla_force_host_platform_device_count={devices} {CHILD_XLA_FLAGS}"
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=flags, **extra)
    return env
