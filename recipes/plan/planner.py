"""`spillway plan`: what a recipe's train step needs on a GPU, measured by compiling it there without the GPU.

For a recipe and a target GPU the planner compiles the real train step
(recipes/train/step.py make_train_step, through abstract_setup: the same
shardings and donation as training) once per candidate plan, in one child
process that has the GPU compiler plugin (recipes/plan/child.py, docs/DESIGN.md
section 5). A candidate is an activation plan (an offload preset or a
per-segment mix, layers/offload.py) with the optimizer state on device or in
pinned host memory, or (for the two plans with the least HBM) in host memory
and updated by the host CPU (`host_compute`, priced at the host's measured
update rate, recipes/plan/host_update.py); with one batch per step also the
single-policy plans with the host state's update run in the next step's
forward pass (`host_in_fwd`, offload.update=next_forward,
recipes/train/update_in_forward.py), whose phases are read straight from what
the compiled step moves in each autodiff pass (`_phases_by_pass`). Per
candidate it reports, per GPU:

    HBM          argument + output - alias + temp bytes of device memory (XLA's
                 buffer assignment), compared with headroom x the GPU's memory;
    host         the same over pinned host memory (the step's); the host's
                 RAM is compared with the peak over a run's phases (state
                 creation, step, checkpoint save, restore) for all its GPUs
                 and the process's footprint (recipes/plan/host_peak.py);
    transfer     bytes the step moves host->device and device->host (read from
                 the compiled HLO) and the time the host link needs for them:
                 both directions added, less the bytes the compiled schedule
                 moves in one direction while the other is busy too
                 (hlo.overlapping_host_copies: async copy windows of opposite
                 directions in flight together);
    compute      FLOPs (recipes/plan/flops.py: forward, backward, the plan's remat
                 recompute) at the fraction of the GPU's peak dense bf16 rate
                 measured on an H200 for the run's attention kernel
                 (recipes/plan/compute_model.py: cuDNN 47%, blockwise 14%);
    step         three phases added up. Forward: max(forward compute,
                 (activations going to host + block weights coming in) / link);
                 backward: max(backward + recompute compute, (activations
                 coming back + block weights coming in again + their gradients
                 going out) / link); update: host-resident optimizer state
                 copied in and out of HBM (with host weights also their
                 gradients in and the new weights out), which overlaps no
                 compute: in + out bytes / link, less the overlapped bytes the
                 compiled schedule shows (recipes/train/host_optimizer.py keeps
                 a stacked leaf's state in two buffers so that the write-back of
                 one layer runs while the next is prefetched; up to the
                 update's smaller direction is credited, so a schedule without
                 overlap gets none). Within forward and backward, transfers
                 are assumed to overlap compute fully, the two link directions
                 added, less what the compiled schedule moves with both in
                 flight in that pass (overlap is credited per autodiff
                 pass, hlo.overlapping_host_copies). The weight terms are
                 zero unless the block weights live in host memory (params
                 host); `ParamTraffic` says how
                 they are counted and how they compare with the compiled step.

The pick is the fastest estimated step among the candidates that fit under
headroom x the GPU's HBM, or under `--hbm-budget` GiB when that is lower.
Candidates compile in stages (everything on device; optimizer state on host,
streamed; then updated by the host CPU, or streamed with the block weights on
host too; last the host CPU's update with the weights on host), and one is skipped when the same activation plan with less in host
memory already fits: by the model above it cannot be faster. A host-CPU
update plan is also skipped when the streamed plan of the same activations
fits and is no slower than the compute plus the host CPU's update time alone
(`_faster_plan_that_fits`; `--all-plans` compiles everything).
`apply_plan` (`spillway train --plan auto`) applies it to the recipe, or
refuses with the numbers when nothing fits, so a run that would run out of
memory never starts.

Attention: plans are made with the blockwise "flash" implementation (memory
linear in the sequence). A recipe with "cudnn" attention (which cannot be
compiled without cuDNN) is planned with flash instead and the output says so;
"xla" attention is planned as is, with a warning that it materialises scores.

Search (`--search seq_len` / `--search batch`): per candidate, the longest
sequence (a multiple of 1024, or of a smaller power of two for recipes shorter
than that, up to model.max_seq_len: raise it with --set to search further) or the largest global batch that fits. See planner_child for
how the compiles are bounded.

Compile speed. The plan only needs XLA's buffer assignment and the optimised
HLO, both settled before machine code is generated. So by default the compile
process runs LLVM without optimisations and hands PTX to a stand-in for ptxas
that writes no machine code (recipes/plan/child.py would otherwise spend
about half of every compile assembling ~200 kernels it never runs). Set
SPILLWAY_PLAN_FULL_CODEGEN=1 to compile exactly as for a run; the memory
figures are the same (tests/recipes/test_planner.py checks that).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from spillway.layers.offload import RematPlan
from spillway.recipes.plan import flops as flop_count
from spillway.recipes.plan import compute_model, host_peak
from spillway.recipes.config import Recipe

GiB = 2**30
GB = 10**9
OPTIMIZER_STATES = ("device", "host")
# Optimizer state in host memory, updated by the host CPU (OptimizerConfig.update_on_host):
# no state in HBM at all, priced at the host's update rate (recipes/plan/host_update.py).
# Tried with the activation plans that need the least HBM, where it can matter.
HOST_COMPUTE = "host_compute"
HOST_COMPUTE_PLANS = ("recompute_all", "offload_dots")
# offload.update=next_forward: the streamed update of host state deferred into the next forward pass
# (recipes/train/update_in_forward.py); single-policy plans only.
NEXT_FORWARD = "next_forward"
AFTER_BACKWARD = "after_backward"
# Block weights (and their gradients) in pinned host memory too (offload.params=host), for
# models this large only, with the state on host (the only combination the step supports)
# and the activation plans that need the least HBM: the last resort of a small GPU.
HOST_PARAMS_MIN_PARAMS = 3e9
HOST_PARAMS_STATES = ("host", HOST_COMPUTE)
# Single-policy plans, in the order the table shows them.
PRESET_PLANS = ("save_all", "recompute_all", "offload_inputs", "save_dots", "offload_dots",
                "save_qkv_offload_mlp")
FULL_CODEGEN_ENV = "SPILLWAY_PLAN_FULL_CODEGEN"
SEQ_SEARCH_STEP = 1024
BATCH_SEARCH_CAP = 4096
MAX_COMPILES_PER_SEARCH = 10


# --- candidates -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Candidate:
    activations: str        # a RematPlan spec
    optimizer_state: str    # "device" | "host" | "host_compute" (host state, updated by the host CPU)
    params: str = "device"  # "device" | "host": where the stacked block weights live (offload.params)
    update: str = AFTER_BACKWARD   # offload.update: when the streamed update of host state runs

    @property
    def label(self) -> str:
        return f"{self.activations} / opt state {self.optimizer_state}" + (
            " / params host" if self.params == "host" else "") + (
            " / update in next forward" if self.update == NEXT_FORWARD else "")

    @property
    def placement(self) -> str:
        """The optimizer state's placement, with "+params" when the block weights live on host too and
        "_in_fwd" when its update runs in the next forward pass."""
        return self.optimizer_state + ("+params" if self.params == "host" else "") + (
            "_in_fwd" if self.update == NEXT_FORWARD else "")

    @property
    def offloads_activations(self) -> bool:
        return any(segment.policy.offloads for segment in RematPlan.parse(self.activations).segments)

    @property
    def no_offload(self) -> bool:
        """Nothing in host memory: the baseline a GPU without offload support would run."""
        return self.optimizer_state == "device" and self.params == "device" and not self.offloads_activations

    def to_dict(self) -> dict:
        return {"activations": self.activations, "optimizer_state": self.optimizer_state, "params": self.params,
                "update": self.update}

    @classmethod
    def from_dict(cls, data: dict) -> Candidate:
        return cls(data["activations"], data["optimizer_state"], data.get("params", "device"),
                   data.get("update", AFTER_BACKWARD))

    def applied_to(self, recipe: Recipe) -> Recipe:
        """The recipe with this plan's offload settings (host_compute: state on host, update_on_host)."""
        from spillway.recipes.config import OffloadConfig
        on_host_cpu = self.optimizer_state == HOST_COMPUTE
        return dataclasses.replace(
            recipe, offload=OffloadConfig(activations=self.activations,
                                          optimizer_state="host" if on_host_cpu else self.optimizer_state,
                                          params=self.params, update=self.update),
            optimizer=dataclasses.replace(recipe.optimizer, update_on_host=on_host_cpu))


def activation_plans(num_layers: int) -> list[str]:
    """The presets, and per-segment mixes over the first half of the layers."""
    plans = list(PRESET_PLANS)
    half = num_layers // 2
    if 0 < half < num_layers:
        plans += [f"offload_dots:{half},recompute_all", f"save_dots:{half},recompute_all"]
    return plans


def candidates(recipe: Recipe) -> list[Candidate]:
    found = [Candidate(plan, state) for state in OPTIMIZER_STATES
             for plan in activation_plans(recipe.model.num_layers)] + [
        Candidate(plan, HOST_COMPUTE) for plan in HOST_COMPUTE_PLANS]
    if recipe.train.grad_accum == 1:   # the update in the next forward pass takes one batch per step
        found += [Candidate(plan, "host", "device", NEXT_FORWARD) for plan in PRESET_PLANS]
    if recipe.num_params() >= HOST_PARAMS_MIN_PARAMS:
        found += [Candidate(plan, state, "host") for state in HOST_PARAMS_STATES for plan in HOST_COMPUTE_PLANS]
    return found


# --- inputs: target, mesh, attention --------------------------------------------

def resolve_mesh(recipe: Recipe, devices: int) -> dict[str, int]:
    """The recipe's mesh axes for `devices` GPUs on one host; ValueError when they cannot match.

    The same rule as layers.sharding.make_mesh (one axis may be -1 and is filled
    from the device count), checked here so a mismatch fails before any compile.
    """
    if devices < 1:
        raise ValueError(f"--devices must be at least 1, got {devices}")
    sizes = {"data": recipe.mesh.data, "fsdp": recipe.mesh.fsdp, "tensor": recipe.mesh.tensor}
    described = " x ".join(f"{k}={v}" for k, v in sizes.items())
    if list(sizes.values()).count(-1) > 1 or any(v == 0 or v < -1 for v in sizes.values()):
        raise ValueError(f"recipe mesh {described}: sizes must be positive, with at most one -1")
    known = math.prod(v for v in sizes.values() if v != -1)
    for axis, size in sizes.items():
        if size == -1:
            if devices % known:
                raise ValueError(f"recipe mesh {described} does not fit {devices} GPUs: "
                                 f"{devices} is not a multiple of {known}")
            sizes[axis] = devices // known
    if math.prod(sizes.values()) != devices:
        raise ValueError(f"recipe mesh {described} needs {math.prod(sizes.values())} GPUs, "
                         f"but --devices is {devices}: change --devices or --set mesh.<axis>=...")
    batch_ways = sizes["data"] * sizes["fsdp"]
    if devices > 1 and recipe.train.global_batch % batch_ways:
        raise ValueError(f"train.global_batch ({recipe.train.global_batch}) must be divisible by the "
                         f"data x fsdp mesh size ({batch_ways}) on {devices} GPUs: "
                         f"--set train.global_batch=...")
    micro_batch = recipe.train.global_batch // recipe.train.grad_accum
    if devices > 1 and micro_batch % batch_ways:
        # A micro-batch the batch axes do not divide is replicated over them (layers/sharding.py):
        # every GPU would compute the same rows.
        raise ValueError(f"a micro-batch of {micro_batch} sequences (train.global_batch {recipe.train.global_batch}"
                         f" / train.grad_accum {recipe.train.grad_accum}) cannot be split over the data x fsdp "
                         f"mesh size ({batch_ways}): raise train.global_batch or lower train.grad_accum")
    return sizes


def check_sharding(recipe: Recipe, mesh: dict[str, int]) -> None:
    """ValueError when a mesh axis does not divide a parameter dimension it shards.

    layers/sharding.py replicates such a dimension: every GPU of that axis
    would hold the whole weight (the per-GPU HBM stays near the one-GPU
    figure) and, on the tensor axis, compute all of it, while the plan's
    compute estimate divides the FLOPs by the GPU count. Refused here, before
    any compile, with the dimensions that do not divide.
    """
    from spillway.layers.sharding import undivided_dims
    from spillway.recipes.train.step import abstract_model

    undivided = undivided_dims(abstract_model(recipe)[1], mesh)
    if not undivided:
        return
    by_axis: dict[tuple[str, ...], dict[str, int]] = {}
    for dim in undivided:
        by_axis.setdefault(dim.mesh_axes, {})[dim.logical_axis] = dim.size
    problems = "; ".join(
        f"{' x '.join(f'mesh.{a}={mesh[a]}' for a in axes)} does not divide "
        + ", ".join(f"{name} ({size})" for name, size in sorted(dims.items()))
        for axes, dims in sorted(by_axis.items()))
    replicated = sum({dim.path: dim.nbytes for dim in undivided}.values())
    raise ValueError(f"the mesh cannot split this model: {problems}. {len({d.path for d in undivided})} weights "
                     f"({replicated / GiB:.1f} GiB) would be replicated instead of sharded, and their compute not "
                     f"divided; choose --devices / --set mesh.<axis>=... so that each axis divides what it shards")


def compute_ways(mesh: dict[str, int]) -> int:
    """GPUs the step's FLOPs are divided over: data x fsdp split the batch, tensor splits the heads, the
    MLP and the vocabulary. Exact only because resolve_mesh and check_sharding refuse a mesh that would
    replicate a micro-batch or a weight dimension instead."""
    return mesh["data"] * mesh["fsdp"] * mesh["tensor"]


def planned_recipe(recipe: Recipe) -> tuple[Recipe, list[str]]:
    """The recipe as it is compiled (attention cudnn -> flash), and warnings to show."""
    impl = recipe.execution.attention_impl
    if impl == "cudnn":
        return (dataclasses.replace(recipe, execution=dataclasses.replace(recipe.execution, attention_impl="flash")),
                ["attention: the recipe uses cuDNN attention, which cannot be compiled without cuDNN; "
                 "planned with 'flash' (layers/flash_attention.py, also memory-linear in the sequence). "
                 "On an H200 the two measured within 0.5% of each other in HBM, cuDNN 3.6x faster "
                 "(Llama 3.2 1B, BENCHMARKS.md)."])
    if impl == "xla":
        return recipe, ["attention: 'xla' materialises the [seq, seq] scores per head (memory quadratic "
                        "in the sequence); --set execution.attention_impl=flash for long sequences."]
    return recipe, []


def _check_toolchain() -> None:
    from spillway.recipes.plan import plugin
    reason = plugin.missing_reason()
    if reason is not None:
        raise ValueError("planning compiles the train step for the GPU without one, which needs the GPU "
                         f"compiler plugin and the CUDA toolkit's ptxas:\n{reason}\n"
                         f"plugin install command: {plugin.install_command_text()}")


# --- the result -------------------------------------------------------------------

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
    forward_s: float | None = None   # the three phases of the step estimate (module docstring)
    backward_s: float | None = None
    update_s: float | None = None
    fits: bool = False
    why_not: str = ""              # "" when it fits
    pick: bool = False

    @property
    def step_s(self) -> float | None:
        """Forward + backward + update estimate (module docstring); None when not compiled."""
        if self.forward_s is None:
            return None
        return self.forward_s + self.backward_s + self.update_s

    @property
    def dropped_offload(self) -> bool:
        """An offloading plan whose compiled step keeps no activation in host memory: XLA ignored it.

        Offloaded activations live in host memory from the forward to the
        backward pass: host *temp* buffers (S(5) in the HLO). Host-resident
        optimizer state is a host *argument*, so it cannot mask a dropped offload.
        """
        return (self.report is not None and self.candidate.offloads_activations
                and (self.report["host_buffer_count"] == 0 or self.report["host_temp_bytes"] == 0))

    def to_dict(self, devices: int = 1) -> dict:
        r = self.report or {}
        return {
            "plan": self.candidate.activations, "optimizer_state": self.candidate.optimizer_state,
            "params": self.candidate.params,
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
    target: Any                    # spillway.spillway.recipes.plan.targets.GpuTarget
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
    # What the compute column is: counted FLOPs at which fraction of peak (recipes/plan/compute_model.py).
    compute_basis: str = ""
    # Candidates not compiled because a plan with less in host memory fits (plan(prune=True)):
    # the candidate's fields, its "label" and "because" (the label of the plan that fits).
    skipped: list[dict] = dataclasses.field(default_factory=list)

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
            reasons = []
            if row.report["hbm_bytes"] > self.hbm_limit_bytes:
                reasons.append(f"HBM {row.report['hbm_bytes'] / GiB:.1f} > {self.hbm_limit_bytes / GiB:.1f} GiB")
            # The peak over the run's phases (recipes/plan/host_peak.py), not the step's arguments.
            host_refusal = host_peak.describe_refusal(row.report, self.devices, self.host_ram_bytes)
            if host_refusal:
                reasons.append(host_refusal)
            if row.dropped_offload:
                reasons.append("offload dropped: no activation in host memory in the compiled step")
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
                "plans": [row.to_dict(self.devices) for row in self.rows],
                "pick": None if picked is None else picked.candidate.to_dict(),
                "search": self.search, "timing": self.timing, "skipped": self.skipped,
                "full_codegen_check": self.full_codegen_check, "assumptions": ASSUMPTIONS}


ASSUMPTIONS = ("HBM and host bytes are per GPU, from XLA's buffer assignment of the compiled step. "
               "Transfer time: both directions added, at the host link's per-direction rate, less the bytes the "
               "compiled schedule moves while the other direction is busy too. Compute time: "
               "recipes/plan/flops.py's count at the fraction of the GPU's peak dense bf16 rate measured for the run's "
               "attention kernel (recipes/plan/compute_model.py; the summary's compute_basis says which). Step time = "
               "forward + backward + update: offloaded activations go to host during the forward and come "
               "back during the backward, each hidden under that phase's compute if it is shorter; "
               "host-resident optimizer state crosses the link both ways during the update with no compute to "
               "hide behind; where the compiled schedule has the two directions in flight together (the "
               "streamed stacked layers; the running gradient sums of host weights), the overlapped bytes are not "
               "counted twice, in the phase where they move. Block weights in host memory "
               "(params host) come in during the forward, again during the backward, with their gradients going "
               "out (with grad_accum > 1, the float32 running sums come in and go out instead, a layer at a "
               "time), once per micro-batch, added to that phase's transfers; the update moves only the state, "
               "the gradients and the new weights.")


# --- planning ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ParamTraffic:
    """Bytes per GPU and per step that the parameters and their gradients move over the host link.

    Everything here is besides the optimizer state (the step's host argument
    less `host_weights`) and the offloaded activations. From the recipe and the
    mesh (`param_traffic`), by what lives where (recipes/train/param_placement.py)
    and how it streams (layers/host_weights.py, recipes/train/host_optimizer.py).

    Block weights in host memory (offload.params=host), A = train.grad_accum
    micro-batches, W = their bytes on one GPU (each leaf's shard: fsdp x tensor
    split what the sharding rules split; norm scales stay whole), F = the same
    elements as float32:

        forward    A x W in: the scan brings each layer's weights into HBM;
        backward   A x W in again (the device copy is never saved for the
                   backward pass, so it is copied again) and A x W of
                   gradients out (the transpose of the copy; gradients have
                   the parameter's dtype);
        sums       A > 1 only: the float32 running sums of the host
                   gradients are accumulated inside each backward pass, a
                   layer at a time (layers/host_weights.AccumulatingWeight):
                   per micro-batch A x F in and A x F out, the new sums
                   leaving in place of the gradients; before the loop the
                   zeroed sums go out once (F, one buffer per distinct
                   shape, which the first micro-batch reads), counted in the
                   update;
        update     streamed through HBM (optimizer state "host"): gradients in
                   (W, or the summed F), the weights of
                   leaves without an fp32 master copy in (the others are
                   recomputed from the master), new weights out (W). Updated
                   by the host CPU (host_compute): nothing of the host
                   weights crosses; the parameters left in HBM send their
                   gradients (float32 once summed) and, without a master
                   copy, themselves out, and come back updated.

    Per leaf, not from DecoderSpec.num_params x the param dtype: norm scales
    are float32 whatever the param dtype, have no master copy, and are not
    split by the mesh (each GPU streams them whole).

    Checked against what the compiled step moves per autodiff pass
    (recipes/plan/hlo.py traffic_by_pass; tests/recipes/test_host_params_aot.py),
    jaxlib 0.10.2, H200 target, bf16 and fp32 weights, grad_accum 1 to 3, meshes
    1x1x1, 1x2x1, 1x1x2, 1x2x2: equal to the byte in the forward and backward
    passes and in the update, except that the compiled update moves a few
    bytes more host->device (a float32 per host leaf: the host CPU's sums of
    squared gradients for the clipping norm), which the residual counts as
    activations. Where the compile first disagreed with this model, the
    compile was right: the update of a leaf with a master copy never reads its
    weights; the gradient sums of grad_accum > 1 cross as float32; and hlo.py
    counted every host computation twice (fixed there).
    """

    host_weights: int = 0          # W: the step's host argument holds these besides the optimizer state
    weights_in_forward: int = 0
    weights_in_backward: int = 0
    gradients_out: int = 0
    sums_in: int = 0               # grad_accum > 1: the running sums into each backward pass
    update_in: int = 0             # besides optimizer state; includes the sums outside the loop
    update_out: int = 0

    @property
    def forward_in(self) -> int:
        return self.weights_in_forward

    @property
    def backward_in(self) -> int:
        return self.weights_in_backward + self.sums_in

    @property
    def backward_out(self) -> int:
        return self.gradients_out


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One parameter on one GPU: its shape, its shard's elements and bytes, where it lives, whether it has a
    master copy."""
    shape: tuple[int, ...]
    elements: int
    nbytes: int
    on_host: bool
    master: bool


def _parameter_shards(recipe: Recipe, mesh: dict[str, int], params: str) -> list[_Leaf]:
    """Every parameter's shard on one GPU, placed as offload.params=`params` places it."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from spillway.layers.sharding import logical_to_spec, variable_axes
    from spillway.recipes.train.optimizer import keeps_master_copy
    from spillway.recipes.train.param_placement import HOST, param_memories
    from spillway.recipes.train.step import abstract_model

    _, state = abstract_model(recipe)
    variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    memories = jax.tree.leaves(param_memories(state, params))   # "host" | "device", in the same order
    leaves = []
    for var, memory in zip(variables, memories, strict=True):
        value = var.get_value()
        spec = logical_to_spec(variable_axes(var), value.shape, mesh)
        ways = math.prod(math.prod(mesh[a] for a in ((axes,) if isinstance(axes, str) else axes))
                         for axes in spec if axes is not None)
        elements = int(np.prod(value.shape)) // ways
        leaves.append(_Leaf(tuple(value.shape), elements, elements * jnp.dtype(value.dtype).itemsize,
                            on_host=memory == HOST, master=keeps_master_copy(recipe.optimizer, value.dtype)))
    return leaves


def param_traffic(candidate: Candidate, recipe: Recipe, mesh: dict[str, int]) -> ParamTraffic:
    """`ParamTraffic` of a candidate (per GPU, per step); ValueError for an unknown placement."""
    if candidate.params not in ("device", "host"):
        raise ValueError(f"a plan's params placement must be 'device' or 'host', got {candidate.params!r}")
    host_cpu = candidate.optimizer_state == HOST_COMPUTE
    if candidate.params == "device" and not host_cpu:
        return ParamTraffic()   # nothing of the parameters crosses: the state is all the update moves
    accum = recipe.train.grad_accum
    leaves = _parameter_shards(recipe, mesh, candidate.params)

    def grad_bytes(leaf: _Leaf) -> int:   # micro-batch sums are float32
        return leaf.nbytes if accum == 1 else 4 * leaf.elements

    on_host = [leaf for leaf in leaves if leaf.on_host]
    in_hbm = [leaf for leaf in leaves if not leaf.on_host]
    weights = sum(leaf.nbytes for leaf in on_host)
    summed = accum > 1 and bool(on_host)
    host_grads = sum(grad_bytes(leaf) for leaf in on_host)
    # The zeroed sums: one buffer per distinct shape (recipes/train/step.py), a GPU's shard of it.
    zeros = sum(4 * leaf.elements for leaf in {leaf.shape: leaf for leaf in on_host}.values()) if summed else 0
    if host_cpu:
        update_out = sum(grad_bytes(leaf) + (0 if leaf.master else leaf.nbytes) for leaf in in_hbm)
        update_in = sum(leaf.nbytes for leaf in in_hbm)
    else:
        update_in = sum(grad_bytes(leaf) + (0 if leaf.master else leaf.nbytes) for leaf in on_host)
        update_out = weights
    return ParamTraffic(
        host_weights=weights, weights_in_forward=accum * weights, weights_in_backward=accum * weights,
        gradients_out=accum * host_grads, sums_in=accum * host_grads if summed else 0,
        update_in=update_in, update_out=update_out + zeros)


def _row(candidate: Candidate, result: dict, recipe: Recipe, target, mesh: dict[str, int],
         host_update_params_per_s: float | None = None, run_attention_impl: str | None = None) -> PlanRow:
    """One candidate's row. host_update_params_per_s: the host CPU's update rate per GPU (host_compute).

    The compiled step's host traffic (report device_to_host / host_to_device
    bytes) is split into what `param_traffic` says the parameters move, the
    optimizer state (the host argument less the host-resident weights, in and
    out during the update) and, the rest, offloaded activations: out during
    the forward pass, back during the backward pass. Within each phase the
    two link directions are added, less the bytes the compiled schedule moves
    with both directions in flight (hlo.overlapping_host_copies, by autodiff
    pass): with grad_accum 1 and host weights the backward scan's weight
    prefetch and gradient write-back are not in flight together; with
    grad_accum > 1 most of the running sums' two directions are.
    """
    impl = recipe.execution.attention_impl
    counted = flop_count.train_step_flops(recipe.decoder_spec(), recipe.train.global_batch, recipe.data.seq_len,
                                          remat=candidate.activations, attention_impl=impl)
    # Compute at the efficiency measured for the kernel the run uses (cuDNN plans compile as flash).
    rate = compute_model.effective_flops_per_s(compute_ways(mesh) * target.peak_bf16_flops, run_attention_impl or impl)
    row = PlanRow(candidate, impl, result.get("report"), result.get("error"), counted.to_dict(),
                  compute_s=counted.total / rate, compile_s=result.get("seconds", 0.0))
    if row.report is None:
        return row
    host_cpu = candidate.optimizer_state == HOST_COMPUTE
    if host_cpu and host_update_params_per_s is None:
        raise ValueError("host-compute plans need the host update rate (recipes/plan/host_update.py)")
    link = target.host_link_bytes_per_s
    to_host, from_host = row.report["device_to_host_bytes"], row.report["host_to_device_bytes"]
    row.transfer_s = (to_host + from_host - row.report.get("overlapped_transfer_bytes", 0)) / link
    if candidate.update == NEXT_FORWARD:
        _phases_by_pass(row, counted, rate, link)
        return row
    params = param_traffic(candidate, recipe, mesh)
    # Host-resident optimizer state is the rest of the step's host *argument*;
    # the streamed update brings all of it in and writes it back. The host CPU
    # updates it where it is.
    state = 0 if host_cpu else max(0, min(row.report["host_argument_bytes"] - params.host_weights,
                                          to_host, from_host))
    update_in, update_out = state + params.update_in, state + params.update_out
    activations_out = max(0, to_host - params.backward_out - update_out)
    activations_back = max(0, from_host - params.forward_in - params.backward_in - update_in)
    # Bytes the compiled schedule moves in both directions at once (the
    # streamed update's write-back beside the next prefetch; in the backward
    # pass with grad_accum > 1, a layer's gradient sum going out beside the
    # next layer's coming in), credited to the phase whose copies they are,
    # never more than that phase's smaller direction. Reports older than the
    # split credit everything to the update.
    overlapped = row.report.get("overlapped_transfer_bytes", 0)
    by_pass = row.report.get("overlapped_bytes_by_pass") or {"other": overlapped}
    forward_out, forward_in = activations_out, params.forward_in
    backward_in, backward_out = activations_back + params.backward_in, params.backward_out
    row.forward_s = max(counted.forward / rate,
                        _link_seconds(forward_out, forward_in, by_pass.get("forward", 0), link))
    row.backward_s = max((counted.backward + counted.recompute) / rate,
                         _link_seconds(backward_out, backward_in, by_pass.get("backward", 0), link))
    if host_cpu:
        # Per leaf the copies and the host CPU's update follow one another: added.
        row.update_s = (update_in + update_out) / link + _params_per_gpu(recipe, mesh) / host_update_params_per_s
    else:
        row.update_s = _link_seconds(update_out, update_in, by_pass.get("other", 0), link)
    return row


def _link_seconds(out: int, back: int, overlapped: int, link: float) -> float:
    """Link time of one phase: both directions added, less the bytes moved with both in flight (at most
    the smaller direction)."""
    return (out + back - min(overlapped, out, back)) / link


def _phases_by_pass(row: PlanRow, counted, rate: float, link: float) -> None:
    """The three phases from what the compiled step moves in each autodiff pass (CompileReport
    transfer_bytes_by_pass), for a plan whose update runs in the next forward pass: the stacked state
    crosses in the forward pass, beside its compute; what the update moves before it (the leaves outside
    the stack) is the update phase. Within a pass the two directions add, less the bytes the schedule
    moves with both in flight. A report without the split counts every byte in the update phase."""
    report = row.report
    moved = report.get("transfer_bytes_by_pass") or {
        "other": {"device_to_host_bytes": report["device_to_host_bytes"],
                  "host_to_device_bytes": report["host_to_device_bytes"]}}
    overlapped = report.get("overlapped_bytes_by_pass") or {}

    def link_s(kind: str) -> float:
        return _link_seconds(moved.get(kind, {}).get("device_to_host_bytes", 0),
                             moved.get(kind, {}).get("host_to_device_bytes", 0), overlapped.get(kind, 0), link)

    row.forward_s = max(counted.forward / rate, link_s("forward"))
    row.backward_s = max((counted.backward + counted.recompute) / rate, link_s("backward"))
    row.update_s = link_s("other")


def _params_per_gpu(recipe: Recipe, mesh: dict[str, int]) -> float:
    """A GPU's share of the parameters, which the host CPU updates: the parameters are split over
    fsdp x tensor; data-parallel replicas each update their own copy."""
    return recipe.num_params() / (mesh["fsdp"] * mesh["tensor"])


def compiler_options() -> dict | None:
    """XLA options for the planner's compiles: fast code generation, unless SPILLWAY_PLAN_FULL_CODEGEN=1.

    Memory figures come from buffer assignment and the optimised HLO, which
    precede code generation; these options only make LLVM skip optimisations
    and replace ptxas by a stand-in that writes no machine code, and keep the
    autotuner off (it has no GPU to time kernels on anyway).

    xla_gpu_autotune_level=0: jaxlib 0.12's autotuner pass (renamed
    config-assigner) works through candidate kernel configs even deviceless,
    where it cannot time them: 40 of the 56 s of HLO passes of one Llama 3.1
    8B candidate (0.10.2's autotuner: 0.3 s of 8.5 s). At level 0 it does not
    autotune: 6.5 s there, the same memory figures (BENCHMARKS.md).
    """
    if os.environ.get(FULL_CODEGEN_ENV, "") not in ("", "0"):
        return None
    from spillway.recipes.plan import plugin
    options = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
               "xla_gpu_disable_gpuasm_optimizations": True, "xla_gpu_autotune_level": 0}
    stand_in = _ptxas_stand_in(plugin.find_ptxas(), plugin.find_cuda_root())
    if stand_in is not None:
        options["xla_gpu_cuda_data_dir"] = str(stand_in)
    return options


def _ptxas_stand_in(real_ptxas: Path | None, cuda_root: Path | None) -> Path | None:
    """A CUDA folder whose bin/ptxas answers version queries with the real one and writes no code.

    XLA looks for ptxas and libdevice under --xla_gpu_cuda_data_dir first. The
    folder links the real toolkit's nvvm/ (libdevice) and holds a script that
    passes `--version` through (XLA picks PTX features by it) and otherwise
    writes a placeholder to the `-o` file: a deviceless compile never loads it.
    """
    if real_ptxas is None or cuda_root is None:
        return None
    folder = Path(tempfile.gettempdir()) / f"spillway-ptxas-stand-in-{os.getuid()}"
    script = folder / "bin" / "ptxas"
    text = f"""#!/bin/sh
# spillway plan: placeholder ptxas (see recipes/plan/planner.py). Version queries go to the real one.
for arg in "$@"; do
  case "$arg" in --version|-V|--help) exec "{real_ptxas}" "$@";; esac
done
out=""; previous=""
for arg in "$@"; do
  [ "$previous" = "-o" ] && out="$arg"
  case "$arg" in --output-file=*) out="${{arg#--output-file=}}";; esac
  previous="$arg"
done
[ -n "$out" ] && printf 'spillway-plan: no machine code' > "$out"
exit 0
"""
    try:
        (folder / "bin").mkdir(parents=True, exist_ok=True)
        if not script.exists() or script.read_text() != text:
            temporary = script.with_suffix(f".{os.getpid()}")
            temporary.write_text(text)
            temporary.chmod(0o755)
            temporary.replace(script)
        nvvm = folder / "nvvm"
        if not nvvm.exists():
            try:
                nvvm.symlink_to(cuda_root / "nvvm")
            except FileExistsError:
                pass
    except OSError:
        return None   # fall back to the real toolchain
    return folder


def _run_child(request: dict) -> dict:
    from spillway.recipes.plan.subprocess_runner import run_in_compile_process

    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="spillway-plan-", delete=False) as f:
        json.dump(request, f)
        path = f.name
    started = time.perf_counter()
    try:
        answer = run_in_compile_process("spillway.recipes.plan.child", [path], timeout_s=3600)
    finally:
        os.unlink(path)
    if "error" in answer:
        raise ValueError(answer["error"])
    # Python, JAX and the plugin starting, before the child's main() ran.
    answer["startup_seconds"] = time.perf_counter() - started - answer["seconds"] + answer["setup_seconds"]
    return answer


def default_workers(num_candidates: int) -> int:
    """Compile processes to run at once: one per core, at most 4, at most one per candidate.

    XLA's GPU compile of one candidate keeps more than one core busy only part
    of the time, so two processes on two cores finish sooner than one
    (BENCHMARKS.md, `spillway plan llama3_8b`). More than 4 mostly adds memory
    (each process holds its own traced model).
    """
    return max(1, min(4, os.cpu_count() or 1, num_candidates))


def _run_children(request: dict, workers: int) -> dict:
    """`_run_child` over `workers` processes, candidates dealt round-robin; one merged answer.

    Round-robin spreads both optimizer-state placements (which compile at
    different speeds) over the processes. Each candidate's search runs in
    the process that compiled it.
    """
    from concurrent.futures import ThreadPoolExecutor

    count = len(request["candidates"])
    workers = max(1, min(workers, count))
    if workers == 1:
        return _run_child(request)
    groups = [list(range(w, count, workers)) for w in range(workers)]
    verify = set(request.get("verify_full_codegen", []))
    requests = [{**request, "candidates": [request["candidates"][i] for i in group],
                 "verify_full_codegen": [j for j, i in enumerate(group) if i in verify]} for group in groups]
    with ThreadPoolExecutor(workers) as pool:   # threads only wait on the child processes
        answers = list(pool.map(_run_child, requests))
    return _merge_answers(answers, groups, count, combine_seconds=max)   # the processes ran side by side


def _merge_answers(answers: list[dict], groups: list[list[int]], count: int, combine_seconds) -> dict:
    """Compile-process answers as one: answers[k] holds the candidates at indices groups[k] of a list of
    `count`; its results, searches and full-codegen checks go to those indices. combine_seconds: `max`
    for processes that ran at once, `sum` for ones that ran one after another."""
    merged = {**answers[0], "results": [None] * count, "full_codegen": {},
              "searches": None if answers[0]["searches"] is None else [None] * count,
              "seconds": combine_seconds(a["seconds"] for a in answers),
              "startup_seconds": combine_seconds(a["startup_seconds"] for a in answers)}
    for group, answer in zip(groups, answers):
        for j, i in enumerate(group):
            merged["results"][i] = answer["results"][j]
            if merged["searches"] is not None:
                merged["searches"][i] = answer["searches"][j]
        for j, full in answer["full_codegen"].items():
            merged["full_codegen"][str(group[int(j)])] = full
    return merged


def _search_request(recipe: Recipe, axis: str, mesh: dict, hbm_limit: float, host_ram: float,
                    devices: int) -> dict:
    if axis == "seq_len":
        cap = recipe.model.max_seq_len
        step = SEQ_SEARCH_STEP
        # Small models (short caps, short recipes): a finer step, so the recipe's
        # own length is on the grid and "none fits" means none.
        while step > 16 and (cap < 4 * step or recipe.data.seq_len < step):
            step //= 2
    elif axis == "batch":
        step = math.lcm(mesh["data"] * mesh["fsdp"], recipe.train.grad_accum)
        cap = max(step, BATCH_SEARCH_CAP - BATCH_SEARCH_CAP % step)
    else:
        raise ValueError(f"--search must be seq_len or batch, got {axis!r}")
    return {"axis": axis, "step": step, "cap": cap, "max_compiles_per_plan": MAX_COMPILES_PER_SEARCH,
            "limits": {"hbm_bytes": hbm_limit, "host_bytes_per_device": host_ram / devices}}


def plan(recipe: Recipe, gpu: str = "h200", devices: int = 1, *, headroom: float = 0.9,
         host_ram_gb: float | None = None, hbm_budget_gib: float | None = None,
         host_update_rate: float | None = None, host_cores_per_gpu: float | None = None, search: str | None = None,
         plans: list[Candidate] | None = None, verify_full_codegen: int = 0,
         workers: int | None = None, prune: bool = True) -> Plan:
    """Compile the recipe's train step for every candidate on `devices` x `gpu`; rows and the pick.

    host_ram_gb: RAM of the host for pinned memory, in GB (10^9 bytes); default
    the target's per-GPU share times `devices`. hbm_budget_gib: HBM per GPU a
    plan may use, in GiB (2^30 bytes), when lower than headroom x the GPU's.
    host_update_rate (parameters/s per core) and host_cores_per_gpu price the
    host-compute plans (recipes/plan/host_update.py: measured file or default). plans: candidates to compile
    (default `candidates(recipe)`). verify_full_codegen: also compile the first
    N candidates exactly as for a run and record both figures
    (Plan.full_codegen_check). workers: compile processes at once (default
    `default_workers`). prune: compile in three stages (everything on device;
    optimizer state on host; weights on host too) and skip a candidate when
    the same activation plan with less in host memory already fits, as it
    cannot be faster (`_faster_plan_that_fits`; the skipped ones are listed in
    Plan.skipped); not with `plans` or `search`. ValueError for bad inputs
    (unknown GPU, mesh not matching, toolchain missing), saying what to do.
    """
    from spillway.recipes.blocks import import_root
    from spillway.recipes.plan.targets import get_target

    started = time.perf_counter()
    target = get_target(gpu)
    if not 0 < headroom <= 1:
        raise ValueError(f"--headroom must be in (0, 1], got {headroom}")
    if host_ram_gb is not None and host_ram_gb <= 0:
        raise ValueError(f"--host-ram-gb must be positive, got {host_ram_gb}")
    if hbm_budget_gib is not None and hbm_budget_gib <= 0:
        raise ValueError(f"--hbm-budget must be positive (GiB), got {hbm_budget_gib}")
    hbm_budget = None if hbm_budget_gib is None else hbm_budget_gib * GiB
    from spillway.recipes.plan import host_update
    per_core, rate_source = host_update.host_update_rate(host_update_rate)
    cores = host_update.DEFAULT_HOST_CORES_PER_GPU if host_cores_per_gpu is None else host_cores_per_gpu
    if not cores > 0:
        raise ValueError(f"--host-cores must be positive, got {host_cores_per_gpu}")
    host_pricing = {"params_per_s_per_core": per_core, "cores_per_gpu": cores, "source": rate_source}
    mesh = resolve_mesh(recipe, devices)
    compiled_recipe, warnings = planned_recipe(recipe)
    check_sharding(compiled_recipe, mesh)
    host_ram = host_ram_gb * GB if host_ram_gb is not None else target.default_host_ram_bytes * devices
    hbm_limit = headroom * target.hbm_bytes if hbm_budget is None else min(headroom * target.hbm_bytes, hbm_budget)
    search_request = None if search is None else _search_request(
        compiled_recipe, search, mesh, hbm_limit, host_ram, devices)
    todo = plans if plans is not None else candidates(compiled_recipe)
    for candidate in todo:   # a bad spec is an error here, before any compile
        RematPlan.parse(candidate.activations).resolve(compiled_recipe.model.num_layers)
    _check_toolchain()
    options = compiler_options()
    if workers is not None and workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    # The compile processes inherit PYTHONPATH and the working directory, not this process's sys.path:
    # tell them where the recipe's own block class was found.
    import_paths = [root for root in [import_root(recipe.block) if recipe.block else None] if root]
    request = {"recipe": compiled_recipe.to_dict(), "import_paths": import_paths, "target": target.name,
               "devices": devices, "compiler_options": options, "search": search_request}
    staged = prune and plans is None and search_request is None
    host_update_floor_s = _params_per_gpu(compiled_recipe, mesh) / (per_core * cores)
    stages = _stages(todo) if staged else [list(range(len(todo)))]
    rows_by_index: dict[int, PlanRow] = {}
    skipped: list[dict] = []
    answers, compiled_groups, used_workers = [], [], 0

    def judged(rows: list[PlanRow], mesh_answer: dict) -> Plan:
        return Plan(compiled_recipe, target, devices, mesh_answer, headroom, host_ram, rows, warnings, None, {},
                    hbm_budget_bytes=hbm_budget, host_update=host_pricing).judge()

    for stage in stages:
        run = []
        for index in stage:
            faster = _faster_plan_that_fits(todo[index], todo, rows_by_index, skipped, host_update_floor_s)
            if faster is None:
                run.append(index)
            else:
                skipped.append({**todo[index].to_dict(), "label": todo[index].label, "because": faster})
        if not run:
            continue
        stage_workers = default_workers(len(run)) if workers is None else min(workers, len(run))
        used_workers = max(used_workers, stage_workers)
        verify = list(range(min(verify_full_codegen, len(run)))) if not answers else []
        answer = _run_children({**request, "candidates": [todo[i].to_dict() for i in run],
                                "verify_full_codegen": verify}, stage_workers)
        answers.append(answer)
        compiled_groups.append(run)
        for index, found in zip(run, answer["results"]):
            rows_by_index[index] = _row(todo[index], found, compiled_recipe, target, mesh, per_core * cores,
                                        run_attention_impl=recipe.execution.attention_impl)
        judged([rows_by_index[i] for i in sorted(rows_by_index)], answer["mesh"])   # sets fits for the next stage
    order = sorted(rows_by_index)
    rows = [rows_by_index[i] for i in order]
    answer = _merge_answers(answers, compiled_groups, len(todo), combine_seconds=sum)   # stages run in turn
    result = judged(rows, answer["mesh"])
    result.skipped = skipped
    result.compute_basis = compute_model.efficiency(recipe.execution.attention_impl).describe(
        recipe.execution.attention_impl)
    for row in rows:
        if row.dropped_offload:
            warnings.append(f"{row.candidate.label}: the plan offloads activations but the compiled step keeps "
                            f"none in host memory (XLA dropped the offload)")
        if row.error:
            warnings.append(f"{row.candidate.label}: compile failed: {row.error.splitlines()[0][:300]}")
    for index, full in answer["full_codegen"].items():
        fast = answer["results"][int(index)]
        keys = ("hbm_bytes", "host_bytes", "temp_bytes", "host_temp_bytes", "host_buffer_count",
                "device_to_host_bytes", "host_to_device_bytes")
        result.full_codegen_check.append({
            **todo[int(index)].to_dict(),
            "fast": {k: fast["report"][k] for k in keys} if "report" in fast else fast.get("error"),
            "full": {k: full["report"][k] for k in keys} if "report" in full else full.get("error"),
            "fast_compile_s": fast.get("seconds"), "full_compile_s": full.get("seconds")})
    if search_request is not None:
        result.search = {**{k: v for k, v in search_request.items() if k != "limits"},
                         "results": [{**c.to_dict(), **found} for c, found in zip(todo, answer["searches"])]}
    result.timing = {
        "total_s": time.perf_counter() - started, "child_s": answer["seconds"],
        "child_startup_s": answer["startup_seconds"],
        "compiles": len(rows) + len(answer["full_codegen"]) + sum(
            found["compiles"] for found in (answer["searches"] or [])),
        "jax_version": answer["jax_version"], "fast_codegen": options is not None,
        "workers": used_workers}
    return result


def _stages(todo: list[Candidate]) -> list[list[int]]:
    """Indices of `todo` in the order they are compiled when plans are pruned: everything on device; the
    optimizer state on host, streamed; then updated by the host CPU, beside the streamed plans with the
    block weights on host too; last the host CPU's update with the weights on host.

    Each stage needs only the rows of the stages before it (`_faster_plan_that_fits`); fewer stages keep
    more compile processes busy at once.
    """
    def stage(candidate: Candidate) -> int:
        on_host_cpu = candidate.optimizer_state == HOST_COMPUTE
        if candidate.optimizer_state == "device":
            return 0
        if candidate.params == "device":
            return 2 if on_host_cpu else 1
        return 3 if on_host_cpu else 2
    return [[i for i, c in enumerate(todo) if stage(c) == k] for k in range(4)]


def _faster_plan_that_fits(candidate: Candidate, todo: list[Candidate], rows: dict[int, PlanRow],
                           skipped: list[dict], host_update_floor_s: float | None = None) -> str | None:
    """The label of a plan that fits and that `candidate` cannot beat, or None.

    Same activation plan, less in host memory: the same compute and no more
    link traffic in any phase (the step-time model in `_row`), so with the
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
    if candidate.optimizer_state != "device":
        ancestors.append(Candidate(candidate.activations, "device", "device"))
    if candidate.params == "host":
        ancestors.append(Candidate(candidate.activations, candidate.optimizer_state, "device"))
    def fitting_row(wanted: Candidate) -> PlanRow | None:
        return next((rows[index] for index, other in enumerate(todo)
                     if other == wanted and index in rows and rows[index].fits), None)

    skipped_for = {entry["label"]: entry["because"] for entry in skipped}
    for ancestor in ancestors:
        if ancestor.label in skipped_for:
            return skipped_for[ancestor.label]
        if fitting_row(ancestor) is not None:
            return ancestor.label
    if candidate.optimizer_state == HOST_COMPUTE and host_update_floor_s is not None:
        streamed = Candidate(candidate.activations, "host", candidate.params)
        row = fitting_row(streamed)
        if row is not None and row.step_s is not None and row.step_s <= row.compute_s + host_update_floor_s:
            return streamed.label
    return None


def choose(result: Plan) -> PlanRow:
    """The picked row, or ValueError with the numbers when no candidate fits."""
    picked = result.picked
    if picked is None:
        raise ValueError(f"no offload plan fits {result.recipe.name} on {result.devices} x "
                         f"{result.target.display_name}: " + _nothing_fits_numbers(result))
    return picked


# --- output -------------------------------------------------------------------------

def _host_peak_cell(report: dict, devices: int) -> str:
    """The host's peak over a run's phases and the phase (recipes/plan/host_peak.py): "183.4 save"."""
    if not report:
        return "-"
    phase, peak = host_peak.host_peak(report, devices)
    return f"{peak / GiB:.1f} {phase.removeprefix('checkpoint ')}"


def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    return f"{ms:.1f}" if ms >= 10 or ms == 0 else f"{ms:.3f}"


def _phases(row: PlanRow) -> str:
    if row.forward_s is None:
        return "-"
    return "/".join(f"{seconds * 1e3:.0f}" for seconds in (row.forward_s, row.backward_s, row.update_s))


def render(p: Plan) -> str:
    s = p.summary()
    t = p.target
    lines = [
        f"spillway plan: {s['recipe']} on {p.devices} x {t.display_name} (deviceless compile, "
        f"jax {p.timing['jax_version']})",
        f"  model      {s['params'] / 1e9:.3f}B params, {s['layers']} layers, {s['param_dtype']} weights, "
        f"{s['dtype']} compute; attention {s['attention_impl']}",
        f"  step       {s['global_batch']} x {s['seq_len']} = {s['tokens_per_step']} tokens/step "
        f"(grad_accum {s['grad_accum']}); mesh " + " ".join(f"{k}={v}" for k, v in p.mesh.items()),
        f"  limits     HBM {_hbm_limit_words(p)} per GPU; "
        f"host RAM {p.host_ram_bytes / GiB:.1f} GiB for {p.devices} GPU(s)",
        f"  rates      {t.host_link} {t.host_link_bytes_per_s / GB:.0f} GB/s per direction; "
        f"{t.peak_bf16_flops / 1e12:.0f} TFLOP/s dense bf16",
    ]
    if p.compute_basis:
        lines.append(f"  compute    counted FLOPs at {p.compute_basis}")
    if p.host_update is not None and any(row.candidate.optimizer_state == HOST_COMPUTE for row in p.rows):
        h = p.host_update
        lines.append(f"  host CPU   update {h['params_per_s_per_core'] / 1e6:.0f} M params/s per core x "
                     f"{h['cores_per_gpu']:g} cores per GPU for host_compute plans ({h['source']})")
    lines += [f"  warning    {w}" for w in p.warnings]
    header = (f"  {'plan':36s} {'opt':12s} {'attn':5s} {'HBM GiB':>8s} {'host GiB':>8s} {'peak GiB':>17s} "
              f"{'xfer GB':>8s} "
              f"{'xfer ms':>8s} {'comp ms':>8s} {'step ms':>8s} {'fwd/bwd/update ms':>18s}  fits")
    lines += ["", header, "  " + "-" * (len(header) - 2)]
    for row in p.rows:
        r = row.report or {}
        moved = None if not r else (r["device_to_host_bytes"] + r["host_to_device_bytes"]) / GB
        fits = "yes" if row.fits else f"no ({row.why_not})"
        lines.append(
            f"{'*' if row.pick else ' '} {row.candidate.activations:36s} {row.candidate.placement:12s} "
            f"{row.attention_impl:5s} {_gib(r.get('hbm_bytes')):>8s} {_gib(r.get('host_bytes')):>8s} "
            f"{_host_peak_cell(r, p.devices):>17s} "
            f"{'-' if moved is None else f'{moved:.2f}':>8s} "
            f"{_ms(row.transfer_s):>8s} "
            f"{_ms(row.compute_s):>8s} {_ms(row.step_s):>8s} {_phases(row):>18s}  {fits}")
    picked = p.picked
    lines.append("")
    if picked is None:
        lines.append("  no plan fits: " + _nothing_fits_numbers(p))
    else:
        lines.append(f"  * pick: {picked.candidate.label} (fastest estimated step among the plans that fit)")
    if p.skipped:
        by_plan: dict[str, list[str]] = {}
        for entry in p.skipped:
            by_plan.setdefault(entry["activations"], []).append(Candidate.from_dict(entry).placement)
        lines.append(f"  not compiled ({len(p.skipped)}), as the same activations with less in host memory (or, "
                     f"for a host-CPU update, streamed) fit and are at least as fast (--all-plans compiles them "
                     f"too): "
                     + "; ".join(f"{plan_spec} with {', '.join(placements)}"
                                 for plan_spec, placements in by_plan.items()))
    lines.append("  " + ASSUMPTIONS)
    lines.append("  xfer GB: both directions together; HBM/host GiB per GPU (2^30 bytes).")
    if p.search is not None:
        lines += ["", *render_search(p)]
    lines.append(f"  {p.timing['compiles']} compiles in {p.timing['total_s']:.1f} s "
                 f"({p.timing['workers']} compile process(es), start-up {p.timing['child_startup_s']:.1f} s)")
    return "\n".join(lines)


def render_search(p: Plan) -> list[str]:
    search = p.search
    axis = search["axis"]
    unit = "tokens" if axis == "seq_len" else "sequences"
    lines = [f"  search: largest {axis} that fits, per plan (multiples of {search['step']} {unit}, "
             f"cap {search['cap']})"]
    header = f"  {'plan':36s} {'opt':12s} {axis:>10s}  {'compiles':>8s} {'seconds':>8s}  notes"
    lines += [header, "  " + "-" * (len(header) - 2)]
    best_baseline = max((r["best"] or 0 for r in search["results"]
                         if Candidate.from_dict(r).no_offload), default=0)
    for r in search["results"]:
        notes = []
        if r["at_cap"]:
            notes.append("fits at the cap")
        elif not r["resolved"]:
            notes.append(f"unresolved between {r['best']} and {r['first_fail']}")
        if r["errors"]:
            notes.append(r["errors"][0].splitlines()[0][:120])
        if Candidate.from_dict(r).no_offload:
            notes.append("no offload")
        elif best_baseline and r["best"]:
            notes.append(f"{r['best'] / best_baseline:.1f}x the best without offload")
        lines.append(f"  {r['activations']:36s} {r['optimizer_state']:12s} "
                     f"{'none' if r['best'] is None else r['best']:>10} {r['compiles']:8d} {r['seconds']:8.1f}  "
                     + "; ".join(notes))
    return lines


def _hbm_limit_words(p: Plan) -> str:
    """How the HBM limit came about: "0.9 x 139.0 GiB = 125.1 GiB", or the budget that lowered it."""
    words = f"{p.headroom:g} x {p.target.hbm_bytes / GiB:.1f} GiB"
    if p.hbm_budget_bytes is not None and p.hbm_budget_bytes < p.headroom * p.target.hbm_bytes:
        return f"budget {p.hbm_limit_bytes / GiB:.2f} GiB (below {words})"
    return f"{words} = {p.hbm_limit_bytes / GiB:.1f} GiB"


def _nothing_fits_numbers(p: Plan) -> str:
    compiled = [row for row in p.rows if row.report is not None]
    if not compiled:
        return "every compile failed (see the warnings)"
    smallest = min(compiled, key=lambda row: row.report["hbm_bytes"])
    return (f"the smallest HBM is {smallest.report['hbm_bytes'] / GiB:.2f} GiB ({smallest.candidate.label}, "
            f"host {smallest.report['host_bytes'] * p.devices / GiB:.2f} GiB) against a limit of "
            f"{p.hbm_limit_bytes / GiB:.2f} GiB HBM per GPU ({_hbm_limit_words(p)}, "
            f"{p.target.display_name}) and {p.host_ram_bytes / GiB:.2f} GiB host RAM; reduce data.seq_len or "
            f"train.global_batch (or raise train.grad_accum), or use more GPUs")


# --- entry points ---------------------------------------------------------------------

def plan_command(args) -> int:
    """`spillway plan`: print the table (or --json), and draw it with --png.

    Exit 0 even when nothing fits (the table says so), except under
    --hbm-budget, which asks for a plan: then ValueError naming the smallest.
    """
    from spillway.recipes.registry import get_recipe

    recipe = get_recipe(args.recipe, args.set)
    budget = getattr(args, "hbm_budget", None)
    result = plan(recipe, args.gpu, args.devices, headroom=args.headroom, host_ram_gb=args.host_ram_gb,
                  hbm_budget_gib=budget, host_update_rate=getattr(args, "host_update_rate", None),
                  host_cores_per_gpu=getattr(args, "host_cores", None), search=args.search, workers=args.workers,
                  prune=not getattr(args, "all_plans", False))
    if args.json:
        json.dump(result.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render(result))
    if getattr(args, "png", None):
        from spillway.recipes.plan.chart import draw_plan
        draw_plan(result, args.png)
    if budget is not None:
        choose(result)   # a budget asks for a plan: none under it is an error naming the smallest
    return 0


def apply_plan(recipe: Recipe, how: str = "auto", *, gpu: str = "h200", devices: int | None = None,
               headroom: float = 0.9, host_ram_gb: float | None = None, echo=print) -> Recipe:
    """The recipe with the picked plan's offload settings, or ValueError with the numbers if none fits."""
    if how != "auto":
        raise ValueError(f"--plan must be 'auto', got {how!r}")
    if devices is None:
        devices = _default_devices(recipe)
    result = plan(recipe, gpu, devices, headroom=headroom, host_ram_gb=host_ram_gb)
    picked = choose(result)
    r = picked.report
    echo(f"plan auto: {picked.candidate.label}: HBM {r['hbm_bytes'] / GiB:.2f} GiB of "
         f"{result.hbm_limit_bytes / GiB:.2f} GiB, host {r['host_bytes'] / GiB:.2f} GiB per GPU, "
         f"estimated step {picked.step_s * 1e3:.0f} ms on {devices} x {result.target.display_name} "
         f"({result.timing['compiles']} compiles, {result.timing['total_s']:.0f} s)")
    for warning in result.warnings:
        echo(f"plan auto: warning: {warning}")
    return picked.candidate.applied_to(recipe)


def _default_devices(recipe: Recipe) -> int:
    """The mesh's GPU count when fully given; else every device this process sees."""
    sizes = (recipe.mesh.data, recipe.mesh.fsdp, recipe.mesh.tensor)
    if all(size > 0 for size in sizes):
        return math.prod(sizes)
    import jax
    return jax.device_count()


def predict_cases(cases: dict[str, tuple[str, list[str]]], gpu: str = "h200", devices: int = 1) -> dict:
    """Deviceless figures for named (recipe, --set overrides) cases, each compiled with its own plan.

    For benchmarks/gpu_suite.py: the predictions a GPU run is compared with.
    """
    from spillway.recipes.registry import get_recipe

    out = {}
    for name, (recipe_name, overrides) in cases.items():
        recipe = get_recipe(recipe_name, overrides)
        state = HOST_COMPUTE if recipe.optimizer.update_on_host and recipe.offload.optimizer_state == "host" \
            else recipe.offload.optimizer_state
        candidate = Candidate(recipe.offload.activations, state, recipe.offload.params, recipe.offload.update)
        row = plan(recipe, gpu, devices, plans=[candidate]).rows[0]
        out[name] = {"error": row.error} if row.report is None else {
            "hbm_bytes": row.report["hbm_bytes"], "host_bytes": row.report["host_bytes"],
            "fits": row.fits, "compute_s": row.compute_s, "transfer_s": row.transfer_s, "step_s": row.step_s}
    return out
