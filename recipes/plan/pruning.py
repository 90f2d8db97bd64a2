"""Pruning: the order the planner compiles candidates in, and which it need not compile at all.

A candidate with more in host memory than one that already fits, the
activation plan the same, cannot be faster (same compute, no less link
traffic in any phase), so it is skipped and listed as such; `--all-plans`
compiles everything.
"""

from __future__ import annotations

from spillway.layers.memory import Memory
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.plan.result import PlanRow


def stages(todo: list[Candidate]) -> list[list[int]]:
    """Indices of `todo` in the order they are compiled when plans are pruned: everything on device; the
    optimizer state on host, streamed; then updated by the host CPU, beside the streamed plans with the
    block weights on host too; last the host CPU's update with the weights on host.

    Each stage needs only the rows of the stages before it (`faster_plan_that_fits`); fewer stages keep
    more compile processes busy at once.
    """
    def stage(candidate: Candidate) -> int:
        on_host_cpu = candidate.update_on_host
        if candidate.optimizer_state == Memory.DEVICE:
            return 0
        if candidate.params == Memory.DEVICE:
            return 2 if on_host_cpu else 1
        return 3 if on_host_cpu else 2
    return [[i for i, c in enumerate(todo) if stage(c) == k] for k in range(4)]


def faster_plan_that_fits(candidate: Candidate, todo: list[Candidate], rows: dict[int, PlanRow],
                           skipped: list[dict], host_update_floor_s: float | None = None) -> str | None:
    """The label of a plan that fits and that `candidate` cannot beat, or None.

    Same activation plan, less in host memory: the same compute and no more
    link traffic in any phase (the step-time model of recipes/plan/cost_model.py), so with the
    optimizer state on device a plan is never slower than with it on host or
    updated by the host CPU, nor with the weights on device slower than with
    them on host. An ancestor that was itself skipped was skipped for a plan
    that fits: that one is named.

    A host-CPU update plan (host_compute) also cannot beat the streamed plan
    of the same activations and weights when that one fits and is already as
    fast as host_compute's least possible step: the same compute plus the
    host CPU's update alone (`host_update_floor_s`, the GPU's share of the
    parameters over the host update rate), as if no byte crossed the link.
    """
    ancestors = []
    if candidate.optimizer_state != Memory.DEVICE:
        ancestors.append(Candidate.of(candidate.activations, Memory.DEVICE, Memory.DEVICE))
    if candidate.params == Memory.HOST:
        ancestors.append(Candidate.of(candidate.activations, candidate.optimizer_state, Memory.DEVICE,
                                      update_on_host=candidate.update_on_host))
    def fitting_row(wanted: Candidate) -> PlanRow | None:
        return next((rows[index] for index, other in enumerate(todo)
                     if other == wanted and index in rows and rows[index].fits), None)

    skipped_for = {entry["label"]: entry["because"] for entry in skipped}
    for ancestor in ancestors:
        if ancestor.label in skipped_for:
            return skipped_for[ancestor.label]
        if fitting_row(ancestor) is not None:
            return ancestor.label
    if candidate.update_on_host and host_update_floor_s is not None:
        streamed = Candidate.of(candidate.activations, Memory.HOST, candidate.params)
        row = fitting_row(streamed)
        if row is not None and row.step_s is not None and row.step_s <= row.compute_s + host_update_floor_s:
            return streamed.label
    return None
