"""The planner's weights across the turn: how many streamed layers keep their weights in HBM from the forward
pass to the backward pass (offload.params_keep=K).

When the plan that fits fastest streams block weights from host memory (offload.params host, experts or a
split) and keeps none, the HBM it leaves under the limit may hold some of the last streamed layers' weights,
which the backward pass then does not bring in again (layers/host_weights.py). `search` compiles the pick
with K = the HBM left / one streamed layer's weights (at most every streamed layer), then, if that fits,
with every streamed layer kept (the HBM peak may lie elsewhere than the turn), else with half of it: two
compiles at most. The HBM the kept layers take is the compile's, not
that estimate's (XLA places them where the peak may or may not be). `describe` prints what was compiled:
the bytes not moved per step, the HBM and the step against the pick without them, or why none was tried.

docs/DESIGN.md section 9.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from spillway.layers.errors import ConfigError
from spillway.layers.memory import Memory
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.plan.cost_model import param_traffic
from spillway.recipes.plan.result import PlanRow

GiB = 2**30
GB = 10**9
MAX_TURN_COMPILES = 2


@dataclasses.dataclass
class TurnSearch:
    """The pick it started from, the rows it compiled (by K), the largest K that fit (None: none), and why
    nothing was compiled when nothing was."""
    base: PlanRow
    streamed: int
    layer_bytes: int
    rows: dict[int, PlanRow]
    best: int | None = None
    why_not: str = ""
    moved_in: dict = dataclasses.field(default_factory=dict)   # host->device bytes per step, by K (None: the pick)

    def not_moved(self, keep: int) -> int:
        """Bytes per step (per GPU) the pick with `keep` kept layers brings into HBM less than the pick: from
        the two compiles, the kept one's untaken fetches taken out (cost_model.plan_row)."""
        return self.moved_in[None] - self.moved_in[keep]

    def to_dict(self) -> dict:
        return {"base": self.base.candidate.to_dict(), "streamed_layers": self.streamed,
                "layer_weight_bytes": self.layer_bytes, "best_params_keep": self.best, "why_not": self.why_not,
                "compiled": {str(k): {"hbm_bytes": (row.report or {}).get("hbm_bytes"), "step_s": row.step_s,
                                      "fits": row.fits, "bytes_not_moved": self.not_moved(k) if row.report else None}
                             for k, row in sorted(self.rows.items())}}


def streams_weights(candidate: Candidate) -> bool:
    return candidate.params != Memory.DEVICE and not candidate.params_keep


def search(pick: PlanRow | None, recipe, mesh: dict, hbm_limit: float,
           compile_rows: Callable[[list[Candidate]], list[PlanRow]]) -> TurnSearch | None:
    """Compile the pick with some of its streamed layers' weights kept across the turn (None when the pick
    streams no weights, or keeps some already)."""
    if pick is None or pick.report is None or not streams_weights(pick.candidate):
        return None
    accum = recipe.train.grad_accum
    # One streamed layer's weights on one GPU: what the backward pass brings in per kept layer and micro-batch.
    probe = param_traffic(dataclasses.replace(pick.candidate, offload=dataclasses.replace(
        pick.candidate.offload, params_keep=1)), recipe, mesh)
    layer_bytes = probe.kept_weights // accum
    streamed = round(1 / probe.kept_fraction) if probe.kept_fraction else 0
    found = TurnSearch(pick, streamed, layer_bytes, {})
    left = hbm_limit - pick.report["hbm_bytes"]
    guess = min(streamed, int(left // layer_bytes)) if layer_bytes else 0
    try:   # what the recipe refuses (LoRA's frozen base is streamed whole) is said, not compiled
        _kept(pick.candidate, max(guess, 1)).applied_to(recipe)
    except ConfigError as refused:
        found.why_not = str(refused)
        return found
    if guess < 1:
        found.why_not = (f"the pick leaves {left / GiB:.2f} GiB of HBM under the limit, less than one streamed "
                         f"layer's weights ({layer_bytes / GiB:.2f} GiB)")
        return found
    found.moved_in[None] = pick.report["host_to_device_bytes"]   # plan_row's count: what the step moves
    keep = guess
    while keep >= 1 and keep not in found.rows:
        candidate = _kept(pick.candidate, keep)
        found.rows[keep] = row = compile_rows([candidate])[0]
        if row.report:
            found.moved_in[keep] = row.report["host_to_device_bytes"]
        if row.fits:
            found.best = max(keep, found.best or 0)
        # Fits: every streamed layer, once (the HBM peak may lie elsewhere than the turn); else half of it, once.
        keep = (streamed if row.fits else keep // 2) if len(found.rows) < MAX_TURN_COMPILES else 0
    return found


def _kept(candidate: Candidate, keep: int) -> Candidate:
    return dataclasses.replace(candidate, offload=dataclasses.replace(candidate.offload, params_keep=keep))


def describe(found: TurnSearch) -> list[str]:
    """The plan's lines about the weights across the turn."""
    head = f"  turn ({found.base.candidate.placement_label}): "
    if not found.rows:
        return [head + f"no streamed layer kept: {found.why_not}"]
    lines = []
    for keep, row in sorted(found.rows.items(), reverse=True):
        if not row.report:
            lines.append(head + f"params_keep={keep}: compile failed")
            continue
        hbm = (row.report["hbm_bytes"] - found.base.report["hbm_bytes"]) / GiB
        step = (row.step_s - found.base.step_s) * 1e3
        lines.append(head + f"params_keep={keep}, the last {keep} of {found.streamed} streamed layers' weights "
                     f"kept in HBM from the forward pass to the backward pass: {found.not_moved(keep) / GB:.1f} GB "
                     f"not moved per step, HBM {hbm:+.2f} GiB, step {step:+.0f} ms"
                     + ("" if row.fits else ", does not fit")
                     + (" (the backward pass is not link-bound: no faster)" if row.fits and step > -0.5 else ""))
        head = "    "
    return lines
