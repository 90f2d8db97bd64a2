"""The planner's split: how many block layers' optimizer state to keep in host memory (offload.optimizer_state=host:N).

When the fastest plan with the state on device does not fit and a plan with the state on host does,
the state of only some layers need leave HBM. `search` finds, by compiling, the fewest host layers
with which the device-state plan's activations fit: host:L first (every block layer's state on host,
the embedding's and head's still in HBM), then a bisection between the counts known not to fit and to
fit, then the count one above the answer, so the plan shows what one layer more or less on host costs
from compiled programs on both sides.

Nothing between compiled counts is inferred. Compiled for an H200 (Llama 3.2 1B cut to 4 layers, 1 x 1024,
save_dots, jaxlib 0.10.2, 2026-12-01) the peak HBM at 0..3 host layers was 8.00, 7.62, 7.62, 6.56 GiB:
XLA's buffer assignment makes it a step function, not a line, in the layer count, so interpolating would
misstate it; the host bytes were linear (0.68 GiB a layer). `SplitSearch.linear` says whether the compiled
HBM points lie on one line (within 2% of their range), and the plan prints it.

The block weights too (offload.params=host:N, the state split at the same layer): when even every layer's
state on host leaves the device-state plan's activations over the limit, the same search runs again with
N layers' weights and state on host (`SplitSearch.weights`), from host:L (every block weight streamed) down.

HBM is taken as non-increasing in the host-layer count and the step as non-decreasing (fewer bytes on the
link): the fewest host layers that fit is the fastest split. docs/DESIGN.md section 9.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from spillway.layers.memory import Memory
from spillway.recipes.config import AFTER_BACKWARD
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.plan.result import PlanRow

MAX_SPLIT_COMPILES = 8
LINEAR_TOLERANCE = 0.02


@dataclasses.dataclass
class SplitSearch:
    """What the search compiled: per host-layer count, the row; the pick's count (None: no split fits)."""
    activations: str
    num_layers: int
    rows: dict[int, PlanRow]
    best: int | None
    weights: bool = False   # the split is of the weights and the state (offload.params=host:N too)
    state_only: "SplitSearch | None" = None   # the state-only search that found no fit, when weights is True

    @property
    def linear(self) -> bool:
        """Whether the compiled HBM points (count, bytes) lie on one line within LINEAR_TOLERANCE of their range."""
        points = sorted((k, row.report["hbm_bytes"]) for k, row in self.rows.items() if row.report)
        if len(points) < 3:
            return False
        (k0, h0), (k1, h1) = points[0], points[-1]
        spread = max(h for _, h in points) - min(h for _, h in points)
        return all(abs(h - (h0 + (h1 - h0) * (k - k0) / (k1 - k0))) <= LINEAR_TOLERANCE * spread for k, h in points)

    def to_dict(self) -> dict:
        return {"activations": self.activations, "num_layers": self.num_layers, "best_host_layers": self.best,
                "weights_split": self.weights,
                "hbm_linear_in_layers": self.linear,
                "compiled": {str(k): {"hbm_bytes": (row.report or {}).get("hbm_bytes"), "step_s": row.step_s,
                                      "fits": row.fits} for k, row in sorted(self.rows.items())}}


def split_candidate(activations: str, host_layers: int, weights: bool = False) -> Candidate:
    """The state of the last `host_layers` block layers on host (and, with `weights`, their weights too)."""
    split = f"{Memory.HOST}:{host_layers}"
    return Candidate.of(activations, split, split if weights else Memory.DEVICE, AFTER_BACKWARD)


def base_plan(rows: list[PlanRow]) -> PlanRow | None:
    """The row whose activations to split the state for: the fastest device-state plan that does not fit, when it
    is faster than every plan that fits (else nothing a split could gain), or None."""
    fitting = [row.step_s for row in rows if row.fits and row.step_s is not None]
    device = [row for row in rows if row.report and not row.fits and row.step_s is not None
              and row.candidate == Candidate.of(row.candidate.activations)]
    device = [row for row in device if not fitting or row.step_s < min(fitting)]
    return min(device, key=lambda row: row.step_s) if device else None


def search(base: PlanRow, num_layers: int, compile_rows: Callable[[list[Candidate]], list[PlanRow]]
           ) -> SplitSearch:
    """Compile splits of the device-state plan `base` (host:0, which does not fit) and find the fewest host
    layers that fit (`compile_rows` compiles candidates and returns their judged rows, `fits` set): of the
    state alone, else of the weights and the state."""
    found = _bisect(base, num_layers, compile_rows, weights=False)
    if found.best is not None or num_layers < 2:
        return found
    with_weights = _bisect(base, num_layers, compile_rows, weights=True)
    with_weights.state_only = found
    return with_weights


def _bisect(base: PlanRow, num_layers: int, compile_rows, *, weights: bool) -> SplitSearch:
    activations = base.candidate.activations
    found = SplitSearch(activations, num_layers, {0: base}, None, weights=weights)

    def fits(k: int) -> bool:
        if k not in found.rows:
            found.rows[k] = compile_rows([split_candidate(activations, k, weights)])[0]
        return found.rows[k].fits

    if num_layers < 2 or not fits(num_layers):
        return found
    low, high = 0, num_layers            # 0 host layers is the device-state plan, which does not fit
    while high - low > 1 and len(found.rows) < MAX_SPLIT_COMPILES - 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    found.best = high
    if high - low == 1:
        fits(low)                        # one layer fewer on host: compiled, so the plan shows why not
    if high + 1 <= num_layers:
        fits(high + 1)                   # one layer more on host: what it would cost
    return found


def describe(found: SplitSearch) -> list[str]:
    """The plan's lines about the split."""
    gib = 2**30
    if found.best is None:
        return [f"  split ({found.activations}): no count of host layers fits, {found.num_layers} included"
                + (" (of the state, nor of the weights and the state)" if found.weights else "")]
    best = found.rows[found.best]
    what = "weights and opt state" if found.weights else "opt state"
    lines = [f"  split ({found.activations}): {what} host:{found.best}, the last {found.best} of "
             f"{found.num_layers} block layers' {'weights and ' if found.weights else ''}state in host memory, "
             f"the rest in HBM "
             f"({best.report['hbm_bytes'] / gib:.2f} GiB HBM, step {best.step_s * 1e3:.0f} ms)"]
    for k, words in ((found.best - 1, "one layer more in HBM"), (found.best + 1, "one layer more on host")):
        row = found.rows.get(k)
        if row is None or not row.report:
            continue
        lines.append(f"    {words} (host:{k}): HBM {(row.report['hbm_bytes'] - best.report['hbm_bytes']) / gib:+.2f} "
                     f"GiB, step {(row.step_s - best.step_s) * 1e3:+.0f} ms" + ("" if row.fits else ", does not fit"))
    compiled = ", ".join(str(k) for k in sorted(found.rows))   # 0: the device-state plan
    if found.state_only is not None:
        lines.append(f"    the state alone on host does not fit (host:{found.num_layers} of the state compiled): "
                     f"the weights are split too")
    lines.append(f"    compiled at host:{{{compiled}}}; nothing interpolated: the compiled HBM is "
                 + ("linear in the layer count" if found.linear else "not linear in the layer count (a step function of "
                    "XLA's buffer assignment)"))
    return lines
