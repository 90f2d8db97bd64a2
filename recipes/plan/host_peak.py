"""The planner's host memory figure: the peak over a run's phases, not the step's arguments.

A compiled step's host bytes (argument + output - alias + temp over pinned
host memory, per GPU) are one phase of a run. The others (state creation, a
checkpoint save, a restore) and the process's own footprint come from the
model of recipes/train/host_memory.py, fed with the candidate's per-GPU
shapes (`phases_of_candidate`, run in the compile process beside the
compile). Per host: the per-GPU figures times the GPUs on it, the process's
footprint once (one process drives the host's GPUs). `judge` compares that
peak with the host's RAM and names the phase that does not fit.
"""

from __future__ import annotations

import dataclasses

from spillway.recipes.train.host_memory import ASSUMED_GPU_FOOTPRINT_BYTES, HostPhases

GiB = 2**30


def phases_of_candidate(recipe, mesh, step_host_bytes: int) -> dict:
    """HostPhases (as a dict) of one GPU's share of `recipe` on `mesh` (compile-only GPUs), the step's host
    bytes from its compile; no footprint (the host adds it once)."""
    from spillway.recipes.train.host_memory import phases_of
    from spillway.recipes.train.step import abstract_setup

    s = abstract_setup(recipe, mesh, platform="cuda")
    return phases_of(s, step_host=step_host_bytes, footprint=0, gpu=True, per_device=True).to_dict()


def with_step_host(phases: dict, step_host: int) -> dict:
    """Host phases (HostPhases.to_dict) with the step's own host bytes set: a candidate's bounds
    (recipes/plan/child.candidate_bounds, the step at 0) completed by its compile."""
    return dataclasses.replace(HostPhases.from_dict(phases), step_host=step_host).to_dict()


def host_phases(report: dict, devices: int, footprint: int = ASSUMED_GPU_FOOTPRINT_BYTES) -> HostPhases | None:
    """The host's phases for a compiled candidate (its report carries "host_phases"); None for reports
    written before the phases existed."""
    data = report.get("host_phases")
    if not data:
        return None
    return dataclasses.replace(HostPhases.from_dict(data).scaled(devices), footprint=footprint)


def host_peak(report: dict, devices: int) -> tuple[str, float]:
    """(phase, bytes) of the host's peak; older reports: the step's host bytes x GPUs."""
    phases = host_phases(report, devices)
    if phases is None:
        return "step", report["host_bytes"] * devices
    return phases.peak()


def apart(value: float, limit: float, *, mib: bool = True, decimals: int = 2) -> tuple[str, str, str]:
    """(value, limit, unit) as text with `decimals`, as the plan table shows the column (HBM: two, the host
    peak: one), or as many more as it takes for the two to read apart (0.1003 and 0.1000 GiB, where three
    decimals said 0.100 and 0.100); bytes where six do not tell them apart. MiB below a hundredth of a GiB
    (unless not `mib`)."""
    unit, scale = ("GiB", GiB) if limit >= 0.01 * GiB or not mib else ("MiB", 2**20)
    for decimals in range(decimals, 7):
        a, b = f"{value / scale:.{decimals}f}", f"{limit / scale:.{decimals}f}"
        if a != b:
            return a, b, unit
    return f"{value:.0f}", f"{limit:.0f}", "bytes"


def over(value: float, limit: float) -> str:
    """"value > limit GiB", the two told apart (`apart`)."""
    a, b, unit = apart(value, limit)
    return f"{a} > {b} {unit}"


def describe_refusal(report: dict, devices: int, host_ram_bytes: float) -> str | None:
    """Why the host's RAM does not hold this candidate ("host 292.1 GiB at checkpoint save > 128.0 GiB"),
    or None when it does."""
    phase, peak = host_peak(report, devices)
    if peak <= host_ram_bytes:
        return None
    a, b, unit = apart(peak, host_ram_bytes, mib=False, decimals=1)
    return f"host {a} {unit} at {phase} > {b} {unit}"
