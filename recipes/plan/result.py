"""The planner's result: a `PlanRow` per compiled candidate, the `Plan` that judges them and picks one.

A row fits when its HBM is under the limit (headroom x the GPU's HBM, or
`--hbm-budget` when lower), the host's peak over a run's phases (state
creation, step, checkpoint save, restore) for all its GPUs and the process's
footprint fits the host's RAM (recipes/plan/host_peak.py) and, for a plan that offloads activations, the compiled step keeps some in
host memory; the pick is the fastest estimated step among the rows that fit.
`Plan.to_dict` is `spillway plan --json`.
"""

from __future__ import annotations

import dataclasses
import shlex

from spillway.recipes.config import Recipe
from spillway.recipes.plan import host_peak
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.targets import GpuTarget

GiB = 2**30


def dropped_offload(candidate: Candidate, report: dict | None) -> bool:
    """An offloading plan whose compiled step keeps no activation in host memory: XLA ignored it.

    Offloaded activations live in host memory from the forward to the
    backward pass: host *temp* buffers (S(5) in the HLO). Host-resident
    optimizer state is a host *argument*, so it cannot mask a dropped offload.
    """
    return (report is not None and candidate.offloads_activations
            and (report["host_buffer_count"] == 0 or report["host_temp_bytes"] == 0))


def refusals(candidate: Candidate, report: dict, hbm_limit: float, devices: int, host_ram: float) -> list[str]:
    """Why a compiled candidate does not fit ([] when it does): HBM over the limit, the host's peak over its
    RAM (the peak over the run's phases, recipes/plan/host_peak.py, not the step's arguments), a dropped
    offload."""
    reasons = []
    if report["hbm_bytes"] > hbm_limit:
        reasons.append(f"HBM {host_peak.over(report['hbm_bytes'], hbm_limit)}")
    host_refusal = host_peak.describe_refusal(report, devices, host_ram)
    if host_refusal:
        reasons.append(host_refusal)
    if dropped_offload(candidate, report):
        reasons.append("offload dropped: no activation in host memory in the compiled step")
    return reasons


@dataclasses.dataclass
class PlanRow:
    """One candidate: its compile report (or error), FLOPs, times and verdict."""

    candidate: Candidate
    attention_impl: str
    report: dict | None            # CompileReport.to_dict(); None when the compile failed
    error: str | None
    flops: dict
    compute_s: float
    compile_s: float
    transfer_s: float | None = None  # host link time for the step's transfers; None when not compiled
    forward_s: float | None = None   # the three phases of the step estimate (recipes/plan/cost_model.py)
    backward_s: float | None = None
    update_s: float | None = None
    fits: bool = False
    why_not: str = ""              # "" when it fits
    pick: bool = False

    @property
    def step_s(self) -> float | None:
        """Forward + backward + update estimate (recipes/plan/cost_model.py); None when not compiled."""
        if self.forward_s is None:
            return None
        return self.forward_s + self.backward_s + self.update_s

    @property
    def dropped_offload(self) -> bool:
        """An offloading plan whose compiled step keeps no activation in host memory: XLA ignored it."""
        return dropped_offload(self.candidate, self.report)

    def to_dict(self, devices: int = 1, recipe: Recipe | None = None) -> dict:
        """JSON-ready; with `recipe` (the planned one) also "set": the --set arguments that train this row."""
        r = self.report or {}
        return {
            "label": self.candidate.label,
            "set": None if recipe is None else self.candidate.set_arguments(recipe),
            "plan": self.candidate.activations, "optimizer_state": self.candidate.optimizer_state,
            "params": self.candidate.params, "update": self.candidate.update,
            "update_on_host": self.candidate.update_on_host,
            "attention_impl": self.attention_impl, "pick": self.pick, "fits": self.fits,
            "why_not": self.why_not, "error": self.error,
            "hbm_bytes": r.get("hbm_bytes"), "host_bytes": r.get("host_bytes"),
            "host_peak": None if not r else dict(zip(("phase", "bytes"), host_peak.host_peak(r, devices))),
            "host_temp_bytes": r.get("host_temp_bytes"), "host_buffer_count": r.get("host_buffer_count"),
            "device_to_host_bytes": r.get("device_to_host_bytes"),
            "host_to_device_bytes": r.get("host_to_device_bytes"),
            "transfer_s": self.transfer_s, "compute_s": self.compute_s, "step_s": self.step_s,
            "forward_s": self.forward_s, "backward_s": self.backward_s, "update_s": self.update_s,
            "flops": self.flops, "compile_s": self.compile_s, "report": self.report,
        }


@dataclasses.dataclass
class Plan:
    recipe: Recipe                 # as compiled (attention possibly switched to flash)
    target: GpuTarget
    devices: int
    mesh: dict
    headroom: float
    host_ram_bytes: float
    rows: list[PlanRow]
    warnings: list[str]
    search: dict | None
    timing: dict
    full_codegen_check: list[dict] = dataclasses.field(default_factory=list)
    hbm_budget_bytes: float | None = None   # --hbm-budget: a user's own HBM limit per GPU
    host_update: dict | None = None   # host-compute pricing: params_per_s_per_core, cores_per_gpu, source
    host_ram_given: bool = False   # host_ram_bytes came from --host-ram-gb (else: the GPU's default host share)
    # What the compute column is: counted FLOPs at which fraction of peak (recipes/plan/compute_model.py).
    compute_basis: str = ""
    # Candidates not compiled because a plan with less in host memory fits (planner.plan(prune=True)):
    # the candidate's fields, its "label" and "because" (the label of the plan that fits).
    skipped: list[dict] = dataclasses.field(default_factory=list)
    # The per-layer split of the optimizer state the planner searched (recipes/plan/split_search.py), or None.
    split: object | None = None
    # The pick's streamed weights kept across the turn, as compiled (recipes/plan/turn_search.py), or None.
    turn: object | None = None
    # How the user named the recipe and the --set overrides it was planned with (spillway plan's arguments),
    # for the command that trains the pick; None: the recipe's registered name.
    recipe_ref: str | None = None
    user_sets: list[str] = dataclasses.field(default_factory=list)

    def pick_set_arguments(self) -> list[str]:
        """The `--set` arguments that make the planned recipe train the pick ([] when it already does, or
        when nothing fits)."""
        picked = self.picked
        return [] if picked is None else picked.candidate.set_arguments(self.recipe)

    def train_command(self) -> str | None:
        """`spillway train RECIPE --set ...` that trains the pick: the user's own --set overrides (those
        of a field the pick sets left out) then the pick's; None when nothing fits."""
        if self.picked is None:
            return None
        picked = self.pick_set_arguments()
        fields = {argument.split("=", 1)[0] for argument in picked}
        kept = [argument for argument in self.user_sets if argument.split("=", 1)[0].strip() not in fields]
        words = ["spillway", "train", self.recipe_ref or self.recipe.name]
        for argument in [*kept, *picked]:
            words += ["--set", argument]
        return shlex.join(words)

    @property
    def hbm_limit_bytes(self) -> float:
        """HBM a plan may use per GPU: headroom x the GPU's memory, or the budget when lower."""
        limit = self.headroom * self.target.hbm_bytes
        return limit if self.hbm_budget_bytes is None else min(limit, self.hbm_budget_bytes)

    @property
    def picked(self) -> PlanRow | None:
        return next((row for row in self.rows if row.pick), None)

    def judge(self) -> "Plan":
        """Set every row's verdict against the limits, and the pick (in place; returns self)."""
        for row in self.rows:
            row.pick = False
            if row.report is None:
                row.fits, row.why_not = False, "compile failed"
                continue
            reasons = refusals(row.candidate, row.report, self.hbm_limit_bytes, self.devices, self.host_ram_bytes)
            row.fits, row.why_not = not reasons, "; ".join(reasons)
        fitting = [row for row in self.rows if row.fits]
        if fitting:
            min(fitting, key=lambda row: (row.step_s, row.report["hbm_bytes"])).pick = True
        return self

    def rejudged(self, *, headroom: float | None = None, host_ram_bytes: float | None = None,
                 hbm_budget_bytes: float | None = None) -> "Plan":
        """The same compiles judged against other limits (nothing is compiled again)."""
        other = dataclasses.replace(
            self, headroom=self.headroom if headroom is None else headroom,
            host_ram_bytes=self.host_ram_bytes if host_ram_bytes is None else host_ram_bytes,
            host_ram_given=self.host_ram_given or host_ram_bytes is not None,
            hbm_budget_bytes=self.hbm_budget_bytes if hbm_budget_bytes is None else hbm_budget_bytes,
            rows=[dataclasses.replace(row) for row in self.rows])
        return other.judge()

    def summary(self) -> dict:
        r, t = self.recipe, self.target
        return {
            "recipe": r.name, "family": r.family, "params": r.num_params(), "layers": r.model.num_layers,
            "seq_len": r.data.seq_len, "global_batch": r.train.global_batch, "grad_accum": r.train.grad_accum,
            "tokens_per_step": r.data.seq_len * r.train.global_batch,
            "dtype": r.execution.dtype, "param_dtype": r.execution.param_dtype,
            "attention_impl": r.execution.attention_impl,
            "target": t.name, "target_display_name": t.display_name, "devices": self.devices,
            "mesh": self.mesh, "hbm_bytes_per_gpu": t.hbm_bytes, "headroom": self.headroom,
            "hbm_limit_bytes": self.hbm_limit_bytes, "hbm_budget_bytes": self.hbm_budget_bytes,
            "host_ram_bytes": self.host_ram_bytes,
            "host_link": t.host_link, "host_link_bytes_per_s": t.host_link_bytes_per_s,
            "peak_bf16_flops": t.peak_bf16_flops, "host_update": self.host_update,
            "compute_basis": self.compute_basis,
        }

    def to_dict(self) -> dict:
        picked = self.picked
        return {"summary": self.summary(), "warnings": self.warnings,
                "plans": [row.to_dict(self.devices, self.recipe) for row in self.rows],
                "pick": None if picked is None else {**picked.candidate.to_dict(), "label": picked.candidate.label,
                                                     "set": self.pick_set_arguments(),
                                                     "train_command": self.train_command()},
                "search": self.search, "timing": self.timing, "skipped": self.skipped,
                "split": None if self.split is None else self.split.to_dict(),
                "turn": None if self.turn is None else self.turn.to_dict(),
                "full_codegen_check": self.full_codegen_check, "assumptions": ASSUMPTIONS}


ASSUMPTIONS = ("HBM and host bytes are per GPU, from XLA's buffer assignment of the compiled step. "
               "Transfer time: both directions added, at the host link's per-direction rate (the directions take "
               "turns, as measured on an H200; on a target marked duplex, less the bytes the compiled schedule "
               "moves while the other direction is busy too). Compute time: "
               "models/flops.py's count (a LoRA recipe: models/lora_flops.py's, the frozen base's input gradients "
               "and the adapters' products, no weight gradient of the base) at the fraction of the GPU's peak dense "
               "bf16 rate (TF32's, half of it, for float32 compute) measured for the run's attention kernel (recipes/plan/compute_model.py; the summary's compute_basis says which). Step time = "
               "forward + backward + update: offloaded activations go to host during the forward and come "
               "back during the backward, each hidden under that phase's compute if it is shorter; "
               "host-resident optimizer state crosses the link both ways during the update with no compute to "
               "hide behind (with offload.update=next_forward, in the next forward pass: the copies the compiled "
               "schedule runs across a matmul hide under it, except those the GPU moves with kernels rather than "
               "memcpys, which hide under nothing); where the compiled schedule has the two directions in flight together (the "
               "streamed stacked layers; the running gradient sums of host weights), the overlapped bytes count "
               "once only on a duplex link, in the phase where they move. Block weights in host memory "
               "(params host) come in during the forward, again during the backward, with their gradients going "
               "out (with grad_accum > 1, the float32 running sums come in and go out instead, a layer at a "
               "time), once per micro-batch, added to that phase's transfers; the update moves only the state, "
               "the gradients and the new weights. A LoRA run's frozen base in host memory comes in during both "
               "passes and sends nothing back: no gradients, no update.")


def choose(result: Plan) -> PlanRow:
    """The picked row, or ValueError with the numbers when no candidate fits."""
    picked = result.picked
    if picked is None:
        raise ValueError(f"no offload plan fits {result.recipe.name} on {result.devices} x "
                         f"{result.target.display_name}: " + nothing_fits_numbers(result))
    return picked


def hbm_limit_words(p: Plan) -> str:
    """How the HBM limit came about: "0.9 x 139.0 GiB = 125.1 GiB", or the budget that lowered it."""
    words = f"{p.headroom:g} x {p.target.hbm_bytes / GiB:.1f} GiB"
    if p.hbm_budget_bytes is not None and p.hbm_budget_bytes < p.headroom * p.target.hbm_bytes:
        return f"budget {p.hbm_limit_bytes / GiB:.2f} GiB (below {words})"
    return f"{words} = {p.hbm_limit_bytes / GiB:.1f} GiB"


def nothing_fits_numbers(p: Plan) -> str:
    compiled = [row for row in p.rows if row.report is not None]
    refused = [entry for entry in p.skipped if entry.get("cannot_fit")]
    if not compiled and refused and not p.rows:   # nothing compiled: every plan ruled out by its bounds
        return f"every plan was refused before compiling (e.g. {refused[0]['label']}: {refused[0]['because']})"
    if not compiled:
        return "every compile failed (see the warnings)"
    smallest = min(compiled, key=lambda row: row.report["hbm_bytes"])
    if smallest.report["hbm_bytes"] <= p.hbm_limit_bytes:   # HBM holds some plan: the host's RAM holds none
        in_hbm = [row for row in compiled if row.report["hbm_bytes"] <= p.hbm_limit_bytes]
        least = min(in_hbm, key=lambda row: host_peak.host_peak(row.report, p.devices)[1])
        phase, peak = host_peak.host_peak(least.report, p.devices)
        advice = ("plan for a host with more" if p.host_ram_given else
                  "give the machine's RAM with --host-ram-gb, or plan for a host with more")
        return (f"{len(in_hbm)} plan(s) fit HBM, but none the host's RAM: the least host memory is "
                f"{peak / GiB:.2f} GiB at {phase} ({least.candidate.label}) against {p.host_ram_bytes / GiB:.2f} GiB "
                f"of host RAM{' (--host-ram-gb)' if p.host_ram_given else ''}; {advice}")
    # Plans refused before compiling for the host's RAM (pruning.refusal_before_compile) may need far less HBM
    # than the smallest compiled: without them the line blamed HBM alone, and a smaller batch helps neither.
    over_ram = [entry for entry in refused if "in HBM alone" not in entry["because"]]
    ram_note = "" if not over_ram else (
        f"; {len(over_ram)} other plan(s) were not compiled, as the host's RAM cannot hold them (e.g. "
        f"{over_ram[0]['label']}: "
        f"{over_ram[0]['because'].removeprefix('cannot fit: ').removesuffix(', whatever the step holds')})")
    return (f"the smallest HBM is {smallest.report['hbm_bytes'] / GiB:.2f} GiB ({smallest.candidate.label}, "
            f"host {smallest.report['host_bytes'] * p.devices / GiB:.2f} GiB) against a limit of "
            f"{p.hbm_limit_bytes / GiB:.2f} GiB HBM per GPU ({hbm_limit_words(p)}, "
            f"{p.target.display_name}) and {p.host_ram_bytes / GiB:.2f} GiB host RAM{ram_note}; reduce data.seq_len "
            f"or train.global_batch (or raise train.grad_accum), or use more GPUs"
            + (", or plan for a host with more RAM" if over_ram else ""))
