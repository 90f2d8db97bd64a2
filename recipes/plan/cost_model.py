"""The planner's cost model: a compiled candidate's step time, and what the parameters move over the host link.

From a candidate's compile report (HBM, host bytes, the bytes each link
direction moves, by autodiff pass, and the bytes moved with both directions
in flight) and the FLOPs counted from the model's shapes (models/flops.py), a
`PlanRow` per candidate (`plan_row`), per GPU:

    transfer     both directions added, at the host link's rate; on a target
                 whose link is measured to move both at once
                 (GpuTarget.host_link_duplex, none yet) less the bytes the
                 compiled schedule moves in one direction while the other is
                 busy too (hlo.overlapping_host_copies);
    compute      FLOPs at the fraction of the GPU's peak dense bf16 rate
                 measured on an H200 for the run's attention kernel
                 (recipes/plan/compute_model.py: cuDNN 47%, blockwise 14%);
    step         forward + backward + update. Forward: max(forward compute,
                 (activations going to host + block weights coming in) / link);
                 backward: max(backward + recompute compute, (activations
                 coming back + block weights coming in again + their gradients
                 going out) / link); update: host-resident optimizer state
                 copied in and out of HBM (with host weights also their
                 gradients in and the new weights out), which overlaps no
                 compute. Within each phase the two directions add (on a
                 duplex link less the bytes that phase's compiled schedule
                 moves with both in flight, never more than its smaller
                 direction: `link_seconds`). A
                 plan whose update runs in the next forward pass is read
                 straight from what each pass moves (`phases_by_pass`),
                 each pass's copies hiding under its compute only as far
                 as the compiled schedule runs them beside a matmul
                 (`beside_compute`, hlo.host_copies_beside_compute).

The weight terms are zero unless the block weights live in host memory;
`ParamTraffic` says how they are counted and how they compare with the
compiled step. docs/DESIGN.md section 9 tells the whole model.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spillway.layers.memory import Memory
from spillway.layers.sharding import logical_to_spec, variable_axes
from spillway.models import flops as flop_count
from spillway.models import lora_flops
from spillway.recipes.config import NEXT_FORWARD, Recipe
from spillway.recipes.optim.layouts import keeps_master_copy
from spillway.layers.residency import host_layers, is_param_split, is_split
from spillway.recipes.optim.param_placement import param_memories
from spillway.recipes.plan import compute_model, hlo
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.plan.mesh_rules import compute_ways
from spillway.recipes.plan.result import PlanRow
from spillway.recipes.train.step import abstract_model


@dataclasses.dataclass(frozen=True)
class ParamTraffic:
    """Bytes per GPU and per step that the parameters and their gradients move over the host link.

    Everything here is besides the optimizer state (the step's host argument
    less `host_weights`) and the offloaded activations. From the recipe and the
    mesh (`param_traffic`), by what lives where (recipes/optim/param_placement.py)
    and how it streams (layers/host_weights.py, recipes/optim/host_streaming.py).

    Block weights in host memory (offload.params=host, or only the routed
    experts' with offload.params=experts: W counts the leaves that live there),
    A = train.grad_accum
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
        turn       offload.params_keep=K: the last K streamed layers' weights come
                   in once per micro-batch, before the forward scan, and stay for the
                   backward pass: the backward pass brings A x K x w fewer in (w: one
                   streamed layer's weights), `kept_weights`, the bytes not moved. In the
                   compiled program each streamed layer's copy is in the branch of a
                   conditional that the K kept layers of the N streamed do not take, and
                   hlo.py counts every branch: `plan_row` takes K/N of the compile's
                   conditional bytes out of its count (`kept_fraction`; 2 x A x K x w
                   when both passes fetch, tests/recipes/plan/test_params_keep_aot.py);
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
    (recipes/plan/hlo.py traffic_by_pass; tests/recipes/plan/test_host_params_aot.py),
    jaxlib 0.10.2, H200 target, bf16 and fp32 weights, grad_accum 1 to 3, meshes
    1x1x1, 1x2x1, 1x1x2, 1x2x2: equal to the byte in the forward and backward
    passes and in the update, except that the compiled update moves a few
    bytes more host->device (a float32 per host leaf: the host CPU's sums of
    squared gradients for the clipping norm), which the residual counts as
    activations. Where the compile first disagreed with this model, the
    compile was right: the update of a leaf with a master copy never reads its
    weights; the gradient sums of grad_accum > 1 cross as float32; and hlo.py
    counted every host computation twice (fixed there).

    With the experts on host: equal to the byte per pass too, each MoE dispatch,
    grad_accum 2 and fsdp 2 included (tests/recipes/plan/test_host_experts_aot.py),
    except that on fsdp 2 the dropless dispatch's compiled step leaves its last
    backward layer and its gradient write-backs without JAX op_names, so
    hlo.traffic_by_pass files them under "other" and the plan prices them in
    the update phase (the totals still match).
    """

    host_weights: int = 0          # W: the step's host argument holds these besides the optimizer state
    weights_in_forward: int = 0
    weights_in_backward: int = 0
    gradients_out: int = 0
    sums_in: int = 0               # grad_accum > 1: the running sums into each backward pass
    update_in: int = 0             # besides optimizer state; includes the sums outside the loop
    update_out: int = 0
    kept_weights: int = 0          # offload.params_keep: bytes the backward pass does not bring in again
    kept_fraction: float = 0.0     # K / N: of the streamed layers' fetches (conditional branches), those not run

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
    master copy, whether the step trains it (a LoRA run's frozen base is read, never given a gradient)."""
    shape: tuple[int, ...]
    elements: int
    nbytes: int
    on_host: bool
    master: bool
    trained: bool = True


def parameter_shards(recipe: Recipe, mesh: dict[str, int], params: str) -> list[_Leaf]:
    """Every parameter's shard on one GPU, placed as offload.params=`params` places it."""
    _, state = abstract_model(recipe)
    variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    memories = jax.tree.leaves(param_memories(state, params))   # "host" | "device", in the same order
    lora = recipe.lora.enabled   # only the adapters (nnx.LoRAParam) train: recipes/train/lora_step.py
    leaves = []
    for var, memory in zip(variables, memories, strict=True):
        trained = not lora or isinstance(var, nnx.LoRAParam)
        value = var.get_value()
        spec = logical_to_spec(variable_axes(var), value.shape, mesh)
        ways = math.prod(math.prod(mesh[a] for a in ((axes,) if isinstance(axes, str) else axes))
                         for axes in spec if axes is not None)
        elements = int(np.prod(value.shape)) // ways
        itemsize, master = jnp.dtype(value.dtype).itemsize, keeps_master_copy(recipe.optimizer, value.dtype)
        split = memory == Memory.HOST and is_param_split(params)
        on_host = host_layers(params, value.shape[0]) if split else 0
        if not 0 < on_host < (value.shape[0] if split else 1):
            leaves.append(_Leaf(tuple(value.shape), elements, elements * itemsize,
                                on_host=memory == Memory.HOST and (on_host > 0 or not split), master=master,
                                trained=trained))
            continue
        # A split weight (offload.params=host:N) is two leaves here: its device rows and its host rows.
        for rows, host in ((value.shape[0] - on_host, False), (on_host, True)):
            part = elements * rows // value.shape[0]
            leaves.append(_Leaf((rows, *value.shape[1:]), part, part * itemsize, on_host=host, master=master,
                                trained=trained))
    return leaves


def param_traffic(candidate: Candidate, recipe: Recipe, mesh: dict[str, int]) -> ParamTraffic:
    """`ParamTraffic` of a candidate (per GPU, per step)."""
    host_cpu = candidate.update_on_host
    if candidate.params == Memory.DEVICE and not host_cpu:
        return ParamTraffic()   # nothing of the parameters crosses: the state is all the update moves
    accum = recipe.train.grad_accum
    leaves = parameter_shards(recipe, mesh, candidate.params)

    def grad_bytes(leaf: _Leaf) -> int:   # micro-batch sums are float32
        return leaf.nbytes if accum == 1 else 4 * leaf.elements

    # A frozen leaf (LoRA's base) is read in both passes and sends no gradient: nothing of it is updated.
    on_host = [leaf for leaf in leaves if leaf.on_host]
    trained_on_host = [leaf for leaf in on_host if leaf.trained]
    in_hbm = [leaf for leaf in leaves if not leaf.on_host and leaf.trained]
    weights = sum(leaf.nbytes for leaf in on_host)
    summed = accum > 1 and bool(trained_on_host)
    host_grads = sum(grad_bytes(leaf) for leaf in trained_on_host)
    # The zeroed sums: one buffer per distinct shape (recipes/train/step.py), a GPU's shard of it.
    zeros = sum(4 * leaf.elements for leaf in {leaf.shape: leaf for leaf in trained_on_host}.values()) if summed else 0
    def sent(leaves: list[_Leaf]) -> int:   # to the update: the gradients, and weights without a master copy
        return sum(grad_bytes(leaf) + (0 if leaf.master else leaf.nbytes) for leaf in leaves)

    if host_cpu:
        # The leaves the host CPU updates whose weights are in HBM cross: all of those in HBM, or with the state
        # split (host:N) the last N layers' rows (host_cpu_rows) less those whose weights are split there too.
        updated, already_on_host = ((in_hbm, []) if not is_split(candidate.optimizer_state)
                                    else (host_cpu_rows(candidate, recipe, mesh), trained_on_host))
        update_out = sent(updated) - sent(already_on_host)
        update_in = sum(leaf.nbytes for leaf in updated) - sum(leaf.nbytes for leaf in already_on_host)
    else:
        update_in = sum(grad_bytes(leaf) + (0 if leaf.master else leaf.nbytes) for leaf in trained_on_host)
        update_out = sum(leaf.nbytes for leaf in trained_on_host)
    # The weights across the turn: K layers of the streamed weights (each host leaf's rows are its layers).
    kept = accum * candidate.params_keep * sum(leaf.nbytes // leaf.shape[0] for leaf in on_host)
    streamed = max((leaf.shape[0] for leaf in on_host), default=0)
    return ParamTraffic(
        host_weights=weights, weights_in_forward=accum * weights, weights_in_backward=accum * weights - kept,
        gradients_out=accum * host_grads, sums_in=accum * host_grads if summed else 0,
        update_in=update_in, update_out=update_out + zeros, kept_weights=kept,
        kept_fraction=candidate.params_keep / streamed if streamed else 0.0)


def host_cpu_rows(candidate: Candidate, recipe: Recipe, mesh: dict[str, int]) -> list[_Leaf]:
    """With the optimizer state split (host:N) and updated by the host CPU: the shards of the last N block
    layers' rows, the only ones it updates (the first layers' and the leaves outside the stack have their state
    in HBM, where the GPU updates them)."""
    return [leaf for leaf in parameter_shards(recipe, mesh, candidate.optimizer_state) if leaf.on_host and leaf.trained]


def plan_row(candidate: Candidate, result: dict, recipe: Recipe, target, mesh: dict[str, int],
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
    counted = step_flops(recipe, candidate.activations)
    # Compute at the efficiency measured for the kernel the run uses (cuDNN plans compile as flash).
    peak, _ = compute_model.peak_flops(target, recipe.execution.dtype)   # float32 runs at TF32's, not bf16's
    rate = compute_model.effective_flops_per_s(compute_ways(mesh) * peak, run_attention_impl or impl)
    row = PlanRow(candidate, impl, result.get("report"), result.get("error"), counted.to_dict(),
                  compute_s=counted.total / rate, compile_s=result.get("seconds", 0.0))
    if row.report is None:
        return row
    host_cpu = candidate.update_on_host
    if host_cpu and host_update_params_per_s is None:
        raise ValueError("host-compute plans need the host update rate (recipes/plan/host_update.py)")
    link = target.host_link_bytes_per_s
    params = param_traffic(candidate, recipe, mesh)
    if params.kept_fraction:
        # The row reads what moves: the compile's static count (kept in host_to_device_bytes_counted) less the
        # kept layers' fetches that never run; the table, the JSON and the turn search see that.
        row.report = {**row.report, "host_to_device_bytes": host_to_device_moved(params, row.report),
                      "host_to_device_bytes_counted": row.report["host_to_device_bytes"]}
    to_host, from_host = row.report["device_to_host_bytes"], row.report["host_to_device_bytes"]
    # Bytes in flight both ways at once count once only where the link is measured to carry both at once.
    duplex = target.host_link_duplex
    row.transfer_s = (to_host + from_host - (row.report.get("overlapped_transfer_bytes", 0) if duplex else 0)) / link
    if candidate.update == NEXT_FORWARD:
        phases_by_pass(row, counted, rate, link, recipe.train.grad_accum, duplex)
        return row
    # Host-resident optimizer state is the rest of the step's host *argument*;
    # the streamed update brings all of it in and writes it back. The host CPU
    # updates it where it is.
    state = 0 if host_cpu else max(0, min(row.report["host_argument_bytes"] - params.host_weights,
                                          to_host, from_host))
    update_in, update_out = state + params.update_in, state + params.update_out
    activations_out = max(0, to_host - params.backward_out - update_out)
    activations_back = max(0, from_host - params.forward_in - params.backward_in - update_in)
    backward_moved = (row.report.get("transfer_bytes_by_pass") or {}).get("backward")
    if backward_moved is not None:
        # Offloaded activations come back only in the backward pass: what the step brings in outside the two
        # passes beyond the state (a few scalars) is not backward traffic.
        activations_back = min(activations_back, max(0, backward_moved["host_to_device_bytes"] - params.backward_in))
    # Bytes the compiled schedule moves in both directions at once (the
    # streamed update's write-back beside the next prefetch; in the backward
    # pass with grad_accum > 1, a layer's gradient sum going out beside the
    # next layer's coming in), credited to the phase whose copies they are,
    # never more than that phase's smaller direction. Reports older than the
    # split credit everything to the update.
    overlapped = row.report.get("overlapped_transfer_bytes", 0)
    by_pass = (row.report.get("overlapped_bytes_by_pass") or {"other": overlapped}) if duplex else {}
    forward_out, forward_in = activations_out, params.forward_in
    backward_in, backward_out = activations_back + params.backward_in, params.backward_out
    row.forward_s = max(counted.forward / rate,
                        link_seconds(forward_out, forward_in, by_pass.get("forward", 0), link))
    row.backward_s = max((counted.backward + counted.recompute) / rate,
                         link_seconds(backward_out, backward_in, by_pass.get("backward", 0), link))
    if host_cpu:
        # Per leaf the copies and the host CPU's update follow one another: added.
        updated = (sum(leaf.elements for leaf in host_cpu_rows(candidate, recipe, mesh))
                   if is_split(candidate.optimizer_state) else params_per_gpu(recipe, mesh))
        row.update_s = (update_in + update_out) / link + updated / host_update_params_per_s
    else:
        row.update_s = link_seconds(update_out, update_in, by_pass.get("other", 0), link)
    return row


def step_flops(recipe: Recipe, activations) -> flop_count.StepFlops:
    """What one step multiplies: an MoE layer's capacity slots and padded blocks too (moe_counted="executed");
    for a LoRA recipe the frozen base's input gradients and the adapters' products (models/lora_flops.py),
    not a full fine-tune's weight gradients."""
    args = (recipe.decoder_spec(), recipe.train.global_batch, recipe.data.seq_len)
    kwargs = dict(remat=activations, attention_impl=recipe.execution.attention_impl, moe_counted="executed")
    if recipe.lora.enabled:
        return lora_flops.lora_step_flops(*args, recipe.lora_spec(), **kwargs)
    return flop_count.train_step_flops(*args, **kwargs)


def host_to_device_moved(params: ParamTraffic, report: dict) -> int:
    """The host->device bytes a compiled step moves: its static count, less the kept layers' fetches that it
    holds in conditional branches never taken (offload.params_keep; `ParamTraffic` "turn")."""
    return report["host_to_device_bytes"] - int(params.kept_fraction * report.get("conditional_host_to_device_bytes", 0))


def link_seconds(out: int, back: int, overlapped: int, link: float) -> float:
    """Link time of one phase: both directions added, less the bytes moved with both in flight (at most
    the smaller direction)."""
    return (out + back - min(overlapped, out, back)) / link


def phases_by_pass(row: PlanRow, counted, rate: float, link: float, grad_accum: int = 1,
                   duplex: bool = False) -> None:
    """The three phases from what the compiled step moves in each autodiff pass (CompileReport
    transfer_bytes_by_pass), for a plan whose update runs in the next forward pass: the stacked state
    crosses in the forward pass; what the update moves before it (the leaves outside the stack) is the
    update phase. Within a pass the two directions add (on a `duplex` link less the bytes the schedule
    moves with both in flight); of that link time, the share the schedule runs beside a matmul (`hidden_fraction`) hides
    under the pass's compute and the rest adds to it (`beside_compute`). A report without the split counts
    every byte in the update phase.

    With `grad_accum` K > 1 the update runs in the first micro-batch's forward pass only: the forward and
    backward passes of micro-batch 1 (hlo FORWARD, BACKWARD) are priced beside 1/K of the step's compute,
    those of micro-batches 2..K (hlo LATER_FORWARD, LATER_BACKWARD: their own link traffic, offloaded
    activations) beside the other (K - 1)/K, each phase the sum of the two."""
    report = row.report
    moved = report.get("transfer_bytes_by_pass") or {
        "other": {"device_to_host_bytes": report["device_to_host_bytes"],
                  "host_to_device_bytes": report["host_to_device_bytes"]}}
    overlapped = (report.get("overlapped_bytes_by_pass") or {}) if duplex else {}

    def link_s(kind: str) -> float:
        return link_seconds(moved.get(kind, {}).get("device_to_host_bytes", 0),
                             moved.get(kind, {}).get("host_to_device_bytes", 0), overlapped.get(kind, 0), link)

    def pass_s(kind: str, compute_s: float) -> float:
        return beside_compute(compute_s, link_s(kind), hidden_fraction(report, kind))

    first, later = 1 / grad_accum, (grad_accum - 1) / grad_accum   # shares of the step's compute
    forward_s, backward_s = counted.forward / rate, (counted.backward + counted.recompute) / rate
    row.forward_s = pass_s(hlo.FORWARD, first * forward_s) + pass_s(hlo.LATER_FORWARD, later * forward_s)
    row.backward_s = pass_s(hlo.BACKWARD, first * backward_s) + pass_s(hlo.LATER_BACKWARD, later * backward_s)
    row.update_s = link_s(hlo.OTHER)


def hidden_fraction(report: dict, kind: str) -> float:
    """The share of pass `kind`'s async host copy bytes the compiled schedule runs beside a matmul
    (hlo.host_copies_beside_compute, CompileReport copies_beside_compute_by_pass). A report written before
    the schedule was read has none: all of it, as the model assumed then."""
    moved = report.get("async_copy_bytes_by_pass")
    if not moved:
        return 1.0
    return report.get("copies_beside_compute_by_pass", {}).get(kind, 0) / moved[kind] if moved.get(kind) else 0.0


def beside_compute(compute_s: float, link_s: float, hidden: float) -> float:
    """A pass's time: its compute, with the `hidden` share of its link time running beside it (the longer
    of the two sets the pace) and the rest waiting on its own."""
    return max(compute_s, hidden * link_s) + (1 - hidden) * link_s


def params_per_gpu(recipe: Recipe, mesh: dict[str, int]) -> float:
    """A GPU's share of the trained parameters, which the host CPU updates: the parameters are split over
    fsdp x tensor; data-parallel replicas each update their own copy. A LoRA recipe trains its adapters only."""
    if recipe.lora.enabled:
        trained = sum(var.get_value().size for var in jax.tree.leaves(
            abstract_model(recipe)[1], is_leaf=lambda x: isinstance(x, nnx.Variable))
            if isinstance(var, nnx.LoRAParam))
    else:
        trained = recipe.num_params()
    return trained / (mesh["fsdp"] * mesh["tensor"])
