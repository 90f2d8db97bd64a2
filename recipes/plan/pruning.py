"""Pruning: the order the planner compiles candidates in, and which it need not compile at all.

A candidate with more in host memory than one that already fits, the
activation plan the same, cannot be faster (same compute, no less link
traffic in any phase), so it is skipped and listed as such. A candidate
whose bounds (recipes/plan/child.candidate_bounds: the weights and optimizer
state it keeps in HBM, the host memory of the run's phases besides the step)
already exceed a limit cannot fit, so it is not compiled either
(`refusal_before_compile`). `--all-plans` compiles everything.
"""

from __future__ import annotations

from spillway.layers.memory import EXPERTS, Memory
from spillway.layers.residency import is_split
from spillway.recipes.config import NEXT_FORWARD, PENDING_DEVICE, PENDING_HOST
from spillway.recipes.plan import host_peak
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.plan.result import PlanRow


def refusal_before_compile(bounds: dict, hbm_limit: float, devices: int, host_ram: float) -> str | None:
    """Why a candidate cannot fit whatever its compile gives ("cannot fit: ..."), or None.

    The HBM figure (argument + output - alias + temp) is at least the device-resident arguments; the host's
    peak over a run's phases is at least the peak of its phases with the step's own host bytes at 0 (the
    step phase only grows with them, the others do not depend on them: recipes/train/host_memory.py)."""
    if bounds["device_argument_bytes"] > hbm_limit:   # as many decimals as tell the two apart
        held, limit, unit = host_peak.apart(bounds["device_argument_bytes"], hbm_limit)
        return f"cannot fit: its weights and optimizer state in HBM alone are {held} {unit} > {limit} {unit}"
    host = host_peak.describe_refusal({"host_phases": bounds["host_phases"], "host_bytes": 0}, devices, host_ram)
    return None if host is None else f"cannot fit: {host}, whatever the step holds"


def _less_in_host_memory(candidate: Candidate, todo: list[Candidate]) -> list[Candidate]:
    """The plans of the same activations with less in host memory, which `candidate` cannot beat: the
    state on device; the weights on device; with every block weight on host, only the experts' there;
    with the update in the next forward pass, its pending gradients in HBM (the same compute, and the
    gradients never cross the link), and with the whole state on host the split host:L of `todo` (the
    non-stacked leaves' state in HBM: the same compute, and their state never crosses the link)."""
    found = []
    if candidate.update == NEXT_FORWARD and candidate.pending_gradients == PENDING_HOST:
        found.append(Candidate.of(candidate.activations, candidate.optimizer_state, candidate.params, NEXT_FORWARD,
                                  pending_gradients=PENDING_DEVICE))
    if candidate.update == NEXT_FORWARD and candidate.optimizer_state == Memory.HOST:
        # host:L is the only split the update in the next forward pass takes, so any split twin in todo is it
        found += [other for other in todo if other.update == NEXT_FORWARD and is_split(other.optimizer_state)
                  and (other.activations, other.params, other.pending_gradients)
                  == (candidate.activations, candidate.params, candidate.pending_gradients)]
    if candidate.optimizer_state != Memory.DEVICE:
        found.append(Candidate.of(candidate.activations, Memory.DEVICE, Memory.DEVICE))
    if candidate.params != Memory.DEVICE:
        found.append(Candidate.of(candidate.activations, candidate.optimizer_state, Memory.DEVICE,
                                  update_on_host=candidate.update_on_host))
    if candidate.params == Memory.HOST:
        found.append(Candidate.of(candidate.activations, candidate.optimizer_state, EXPERTS,
                                  update_on_host=candidate.update_on_host))
    return found


def _streamed_twin(candidate: Candidate) -> Candidate | None:
    """A host-CPU-update plan's streamed counterpart (same activations and weights), else None."""
    if not candidate.update_on_host:
        return None
    return Candidate.of(candidate.activations, Memory.HOST, candidate.params)


def stages(todo: list[Candidate]) -> list[list[int]]:
    """Indices of `todo` in the order they are compiled when plans are pruned: a plan comes one stage after
    the latest of the plans in `todo` that `faster_plan_that_fits` compares it with. For a dense model:
    everything on device; the optimizer state on host, streamed; then updated by the host CPU, beside the
    streamed plans with the block weights on host too; last the host CPU's update with the weights on host.
    With MoE blocks the experts-on-host plans come before the whole stack's.

    Each stage needs only the rows of the stages before it (`faster_plan_that_fits`); fewer stages keep
    more compile processes busy at once.
    """
    present = set(todo)
    depth: dict[Candidate, int] = {}

    def stage(candidate: Candidate) -> int:
        if candidate not in depth:
            before = [c for c in [*_less_in_host_memory(candidate, todo), _streamed_twin(candidate)] if c in present]
            depth[candidate] = 1 + max(map(stage, before)) if before else 0
        return depth[candidate]

    levels = [stage(c) for c in todo]
    return [[i for i, level in enumerate(levels) if level == k] for k in range(max(levels, default=-1) + 1)]


def faster_plan_that_fits(candidate: Candidate, todo: list[Candidate], rows: dict[int, PlanRow],
                           skipped: list[dict], host_update_floor_s: float | None = None) -> str | None:
    """The label of a plan that fits and that `candidate` cannot beat, or None.

    Same activation plan, less in host memory: the same compute and no more
    link traffic in any phase (the step-time model of recipes/plan/cost_model.py), so with the
    optimizer state on device a plan is never slower than with it on host or
    updated by the host CPU, nor with the weights on device slower than with
    them on host, nor with only the experts' weights on host slower than with
    every block weight there. An ancestor that was itself skipped was skipped
    for a plan that fits: that one is named.

    A host-CPU update plan (host_compute) also cannot beat the streamed plan
    of the same activations and weights when that one fits and is already as
    fast as host_compute's least possible step: the same compute plus the
    host CPU's update alone (`host_update_floor_s`, the GPU's share of the
    parameters over the host update rate), as if no byte crossed the link.
    """
    ancestors = _less_in_host_memory(candidate, todo)

    def fitting_row(wanted: Candidate) -> PlanRow | None:
        return next((rows[index] for index, other in enumerate(todo)
                     if other == wanted and index in rows and rows[index].fits), None)

    # Skipped for a plan that fits (a plan skipped because it cannot fit proves nothing about the others).
    skipped_for = {entry["label"]: entry["because"] for entry in skipped if not entry.get("cannot_fit")}
    for ancestor in ancestors:
        if ancestor.label in skipped_for:
            return skipped_for[ancestor.label]
        if fitting_row(ancestor) is not None:
            return ancestor.label
    streamed = _streamed_twin(candidate)
    if streamed is not None and host_update_floor_s is not None:
        row = fitting_row(streamed)
        if row is not None and row.step_s is not None and row.step_s <= row.compute_s + host_update_floor_s:
            return streamed.label
    return None
