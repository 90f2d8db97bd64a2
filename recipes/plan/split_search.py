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

The other way round (`host_bound_bases`, `search_toward_hbm`): when the plan with every block layer's weights
and state streamed fits HBM but not the host's RAM (Llama 3.1 70B on one H200 with 1.5 TB: 67.5 GiB of HBM,
1432 GiB of host at 1397), the first layers' weights and state move into HBM's spare room until the host
holds the rest. The same bisection finds the fewest host layers whose HBM fits; host memory falls with every
layer moved, so if the host does not hold that count it holds none of the counts HBM does, and no split fits.

HBM is taken as non-increasing in the host-layer count, so the bisection finds the fewest host layers that fit.
The step is not taken as monotone: compiled, it is not always (8 micro-batches of the 8B, save_dots: host:21
slower than host:24, BENCHMARKS.md; XLA schedules each count's copies its own way), so the pick is the fastest
of the compiled counts that fit, the fewest host layers on a tie, and the plan says when that is not the
fewest. docs/DESIGN.md section 9.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from spillway.layers.memory import Memory
from spillway.recipes.config import AFTER_BACKWARD
from spillway.recipes.plan import host_peak
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.plan.result import PlanRow

MAX_SPLIT_COMPILES = 8   # per search: host:L, 7 halvings (an 80-layer stack to one layer), a neighbour
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
    host_bound: bool = False   # searched from a streamed plan that fits HBM but not the host's RAM
    fewest: int | None = None   # the fewest host layers that fit, when the pick (`best`) is a faster count

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
                "weights_split": self.weights, "host_bound": self.host_bound, "fewest_host_layers": self.fewest,
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
    # equal steps (save_all and save_dots often tie): the one with less HBM needs fewer layers' state moved
    return min(device, key=lambda row: (row.step_s, row.report["hbm_bytes"])) if device else None


def other_bases(rows: list[PlanRow], faster_than: float, searched: set[str]) -> list[PlanRow]:
    """Device-state plans of other activations (not in `searched`) that do not fit but are faster than
    `faster_than` (the best fitting step so far, a split's included), whose state all on host fits HBM: a
    state split of theirs could beat the pick (8 micro-batches of the 8B: save_all's split of weights and state
    against save_dots', whose state alone on host fits). Fastest first."""
    fitting_hosts = {row.candidate.activations for row in rows
                     if row.fits and row.candidate == Candidate.of(row.candidate.activations, Memory.HOST)}
    found = [row for row in rows if row.report and not row.fits and row.step_s is not None
             and row.candidate == Candidate.of(row.candidate.activations) and row.step_s < faster_than
             and row.candidate.activations in fitting_hosts and row.candidate.activations not in searched]
    return sorted(found, key=lambda row: (row.step_s, row.report["hbm_bytes"]))


def search_state(base: PlanRow, num_layers: int, compile_rows: Callable[[list[Candidate]], list[PlanRow]]
                 ) -> SplitSearch:
    """The state-only split of `base` (a device-state plan that does not fit): the fewest host layers that fit."""
    return _bisect(base, num_layers, compile_rows, weights=False)


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


def host_bound_bases(rows: list[PlanRow], hbm_limit: float, host_ram: float, devices: int) -> list[PlanRow]:
    """Streamed plans with every block layer's weights and state on host whose HBM fits but whose host memory
    does not, faster than every plan that fits, fastest first; only those whose host excess HBM's spare room
    could take (a layer moved into HBM takes its weights, state and gradient sums there: to first order the host
    sheds what HBM gains, so a larger excess cannot fit)."""
    fitting = [row.step_s for row in rows if row.fits and row.step_s is not None]
    found = []
    for row in rows:
        c = row.candidate
        if (row.fits or not row.report or row.step_s is None or c.update_on_host or c.update != AFTER_BACKWARD
                or c.optimizer_state != Memory.HOST or c.params != Memory.HOST
                or row.report["hbm_bytes"] > hbm_limit or (fitting and row.step_s >= min(fitting))):
            continue
        excess = host_peak.host_peak(row.report, devices)[1] - host_ram
        if 0 < excess <= (hbm_limit - row.report["hbm_bytes"]) * devices:
            found.append(row)
    return sorted(found, key=lambda row: row.step_s)


def search_toward_hbm(base: PlanRow, device_row: PlanRow | None, num_layers: int, hbm_limit: float,
                      compile_rows: Callable[[list[Candidate]], list[PlanRow]]) -> SplitSearch:
    """Move the first layers of `base` (every layer's weights and state on host; HBM fits, the host does not)
    into HBM: the fewest host layers whose HBM fits, by bisection between `device_row` (the same activations,
    all on device: HBM over; None when the planner refused it uncompiled, its weights and state alone over) and
    host:L; the pick only if the host holds it too (module docstring)."""
    known = {num_layers: base} if device_row is None else {0: device_row, num_layers: base}
    found = SplitSearch(base.candidate.activations, num_layers, known, None, weights=True, host_bound=True)
    _narrow(found, compile_rows, lambda row: bool(row.report) and row.report["hbm_bytes"] <= hbm_limit)
    if found.best is not None and not found.rows[found.best].fits:
        found.best = None                # the least host memory HBM allows is still more than the host has
    return found


def _bisect(base: PlanRow, num_layers: int, compile_rows, *, weights: bool) -> SplitSearch:
    found = SplitSearch(base.candidate.activations, num_layers, {0: base}, None, weights=weights)
    _narrow(found, compile_rows, lambda row: row.fits)
    return found


def _narrow(found: SplitSearch, compile_rows, good: Callable[[PlanRow], bool]) -> None:
    """Bisect between host:0 (known not good) and host:L for the fewest host layers whose row is `good`; set
    `found.best` (None when host:L is not good) and compile the pick's two neighbours."""
    num_layers, compiled = found.num_layers, []

    def fits(k: int) -> bool:
        if k not in found.rows:
            found.rows[k] = compile_rows([split_candidate(found.activations, k, found.weights)])[0]
            compiled.append(k)
        return good(found.rows[k])

    if num_layers < 2 or not fits(num_layers):
        return
    low, high = 0, num_layers            # 0 host layers is the device-state plan, which does not fit
    while high - low > 1 and len(compiled) < MAX_SPLIT_COMPILES - 1:   # one kept for the neighbour above
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    found.best = high
    if high - low == 1:
        fits(low)                        # one layer fewer on host: compiled already, so the plan shows why not
    if high + 1 <= num_layers and len(compiled) < MAX_SPLIT_COMPILES:
        fits(high + 1)                   # one layer more on host: what it would cost
    _fastest_of_the_compiled(found, good)


def _fastest_of_the_compiled(found: SplitSearch, good: Callable[[PlanRow], bool]) -> None:
    """Make `found.best` the fastest compiled count that is good and fits (fewest host layers on a tie),
    keeping the bisection's answer in `found.fewest` when they differ. The rows that fit are priced from
    their own compiled programs, so a count with more host layers can be the faster one (module docstring)."""
    fitting = [k for k, row in found.rows.items()
               if k and good(row) and row.fits and row.step_s is not None]
    if not fitting:
        return
    fastest = min(fitting, key=lambda k: (found.rows[k].step_s, k))
    if fastest != found.best:
        found.fewest, found.best = found.best, fastest


def describe(found: SplitSearch) -> list[str]:
    """The plan's lines about the split."""
    gib = 2**30
    if found.best is None and found.host_bound:
        return [f"  split ({found.activations}): every layer's weights and state on host fits HBM but not the host's "
                f"RAM, and no count of layers moved into HBM makes the host hold the rest"]
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
    if found.fewest is not None:
        fewest = found.rows[found.fewest]
        lines.append(f"    host:{found.fewest}, the fewest host layers that fit, compiled slower "
                     f"({fewest.step_s * 1e3:.0f} ms): the step is not monotone in the layer count, so the "
                     f"fastest compiled count that fits is the pick")
    compiled = ", ".join(str(k) for k in sorted(found.rows))   # 0: the device-state plan
    if found.host_bound:
        lines.append(f"    every layer's weights and state on host fits HBM but not the host's RAM: the first "
                     f"{found.num_layers - found.best} layers' moved into HBM")
    if found.state_only is not None:
        lines.append(f"    the state alone on host does not fit (host:{found.num_layers} of the state compiled): "
                     f"the weights are split too")
    lines.append(f"    compiled at host:{{{compiled}}}; nothing interpolated: the compiled HBM is "
                 + ("linear in the layer count" if found.linear else "not linear in the layer count (a step function of "
                    "XLA's buffer assignment)"))
    return lines
