"""Pinned host memory: whether the platform has it, what the host's RAM holds, where a host array's sharding is.

Pinned memory cannot be swapped, so the train loop checks what a run will pin
against the host's RAM before anything is allocated (`check_host_memory`,
docs/DESIGN.md section 6).
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding

from spillway.layers.errors import SpillwayError
from spillway.layers.memory import PINNED_HOST


def host_memory_available(device: jax.Device | None = None) -> bool:
    """Whether `device` (default: the first runtime device) has a pinned_host memory space."""
    device = device or jax.local_devices()[0]
    try:
        return any(m.kind == PINNED_HOST for m in device.addressable_memories())
    except Exception:  # platforms without the memories API
        return False


def host_ram_bytes() -> int | None:
    """This host's RAM from /proc/meminfo, or None where there is none (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        return None
    return None


def _meminfo_total_bytes() -> int:
    ram = host_ram_bytes()
    if ram is None:
        raise RuntimeError("MemTotal not found in /proc/meminfo")
    return ram


class HostMemoryError(SpillwayError, MemoryError):
    """The run's pinned host memory (optimizer state, host weights, their gradients) would not fit in RAM."""


def check_host_memory(bytes_needed: int, host_ram_bytes: int | None = None, breakdown: str = "") -> None:
    """Raise HostMemoryError if `bytes_needed` of pinned host memory exceed the host's RAM.

    Pinned memory cannot be swapped, so overcommitting it kills the process (or
    the machine) mid-run instead of failing early. Call this before anything
    is allocated, with the per-process host bytes (recipes/train/step.py
    `pinned_host_bytes`); `breakdown` says what they are made of.
    """
    if bytes_needed < 0:
        raise ValueError(f"bytes_needed must be >= 0, got {bytes_needed}")
    if host_ram_bytes is None:
        host_ram_bytes = _meminfo_total_bytes()
    if bytes_needed > host_ram_bytes:
        raise HostMemoryError(
            f"this run needs {bytes_needed / 2**30:.2f} GiB of pinned host memory"
            f"{f' ({breakdown})' if breakdown else ''}, but this host has {host_ram_bytes / 2**30:.2f} GiB "
            f"of RAM: keep more on device (offload.params=device, offload.optimizer_state=device, or "
            f"optimizer_memory='device' metadata on some parameters) or shard it over more hosts")



def host_sharding(sharding):
    """The same mesh and spec in pinned_host memory.

    Compile-only devices (a deviceless GPU compile) report no memories, and a
    NamedSharding over them silently drops the memory kind; one over the
    mesh's abstract mesh keeps it (docs/DESIGN.md section 5), so fall back to that
    rather than lose the host placement.
    """
    host = sharding.with_memory_kind(PINNED_HOST)
    if host.memory_kind != PINNED_HOST and isinstance(sharding, NamedSharding):
        host = NamedSharding(sharding.mesh.abstract_mesh, sharding.spec, memory_kind=PINNED_HOST)
    return host
