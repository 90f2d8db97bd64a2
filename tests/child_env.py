"""The environment of a process a test starts (the `spillway` command, a training child): the CPU backend
and the suite's own cheap code generation (tests/fast_compile_flags.py: the tests' programs are tiny, and
XLA's optimisation of their CPU code costs more compile time than it saves). One CPU
device unless told otherwise: a user's run on a laptop, not the suite's 8 fake devices."""

from __future__ import annotations

import os

from fast_compile_flags import fast_compile_flags

CHILD_XLA_FLAGS = " ".join(fast_compile_flags())


def child_env(devices: int | None = None, base: dict | None = None, **extra) -> dict:
    """`base` (os.environ by default) with the CPU backend, LLVM at level 0 and `devices` fake CPU devices
    (one, the backend's own count, when None), then `extra`."""
    env = dict(os.environ if base is None else base)
    flags = CHILD_XLA_FLAGS if devices is None else f"--xla_force_host_platform_device_count={devices} {CHILD_XLA_FLAGS}"
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=flags, **extra)
    return env
