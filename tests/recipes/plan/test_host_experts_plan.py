"""The planner and the experts-on-host placement (offload.params=experts), without compiling: which candidates
a model with MoE blocks gets, how pruning orders and skips them, and the weight-stream bytes by hand.

The compiled step's own bytes are checked against the same model in
tests/recipes/plan/test_host_experts_aot.py.
"""

import dataclasses

import jax
import numpy as np
import pytest

from benchmarks.moe_blocks import block_path
from spillway.layers.host_weights import is_expert_weight
from spillway.recipes.plan import cost_model, pruning
from spillway.recipes.plan import candidates as plan_candidates
from spillway.recipes.plan import result as plan_result
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.registry import get_recipe
from spillway.recipes.train import host_memory
from spillway.recipes.train.step import abstract_model

SMALL = ["model.vocab_size=128", "model.d_model=32", "model.num_layers=4", "model.num_heads=4",
         "model.num_kv_heads=2", "model.mlp_hidden=64", "model.max_seq_len=32", "data.seq_len=16",
         "train.global_batch=8"]


def moe_recipe(*extra):
    return get_recipe("tiny", [*SMALL, f"block={block_path('tiny', 'dropless')}", *extra])


def expert_arrays(recipe):
    return [var.get_value() for var in jax.tree.leaves(abstract_model(recipe)[1],
                                                       is_leaf=lambda x: hasattr(x, "get_metadata"))
            if is_expert_weight(var.get_metadata().get("logical_axes"))]


def test_the_router_and_shared_experts_are_not_expert_weights():
    assert is_expert_weight(("layers", "expert", "embed", "mlp")) and is_expert_weight(("expert", "mlp", "embed"))
    assert not is_expert_weight(("layers", "embed", "expert"))    # the router: "expert" is its output axis
    assert not is_expert_weight(("layers", "embed", "mlp"))       # a dense (or shared-expert) MLP
    assert not is_expert_weight(None)


def test_a_model_with_moe_blocks_gets_experts_on_host_candidates_and_a_dense_one_none():
    dense = get_recipe("tiny", SMALL)
    assert not plan_candidates.has_expert_weights(dense)
    assert all(c.params == "device" for c in plan_candidates.candidates(dense))
    recipe = moe_recipe()
    assert plan_candidates.has_expert_weights(recipe)
    experts = [c for c in plan_candidates.candidates(recipe) if c.params == "experts"]
    # the host-compute plans of an MoE block (its moe_offload_dots: the dense one names what it never tags)
    assert {(c.activations, c.state_word) for c in experts} == {
        (plan, state) for plan in plan_candidates.MOE_HOST_COMPUTE_PLANS
        for state in ("host", plan_candidates.HOST_COMPUTE)}
    for c in experts:   # each applies to a valid recipe and reads back from its dict
        applied = c.applied_to(recipe)
        assert applied.offload.params == "experts" and applied.offload.optimizer_state == "host"
        assert Candidate.from_dict(c.to_dict()) == c
        assert c.label.endswith("/ params=experts")
    # A small model: no whole-stack host placement (HOST_PARAMS_MIN_PARAMS), as for dense models.
    assert not [c for c in plan_candidates.candidates(recipe) if c.params == "host"]


def _row(candidate, fits):
    row = plan_result.PlanRow(candidate, "flash", None, None, {}, compute_s=1.0, compile_s=0.0)
    row.fits = fits
    return row


def test_pruning_puts_experts_between_device_weights_and_the_whole_stack_on_host():
    recipe = moe_recipe()
    whole = [Candidate.of(plan, "host", "host", update_on_host=cpu)
             for cpu in (False, True) for plan in plan_candidates.HOST_COMPUTE_PLANS]
    todo = plan_candidates.candidates(recipe) + whole   # as a model past HOST_PARAMS_MIN_PARAMS gets them
    index = {c: i for i, c in enumerate(todo)}
    state_on_host = Candidate.of("recompute_all", "host")
    experts = Candidate.of("recompute_all", "host", "experts")
    every = Candidate.of("recompute_all", "host", "host")
    # The experts plan is skipped when the weights fit on device; the whole stack when the experts plan fits.
    rows = {index[Candidate.of("recompute_all", "device")]: _row(Candidate.of("recompute_all", "device"), False),
            index[state_on_host]: _row(state_on_host, True)}
    assert pruning.faster_plan_that_fits(experts, todo, rows, []) == state_on_host.label
    rows = {index[state_on_host]: _row(state_on_host, False), index[experts]: _row(experts, True)}
    assert pruning.faster_plan_that_fits(every, todo, rows, []) == experts.label
    assert pruning.faster_plan_that_fits(experts, todo, rows, []) is None
    # ...and one skipped for a plan that fits names that plan.
    skipped = [{**experts.to_dict(), "label": experts.label, "because": state_on_host.label}]
    assert pruning.faster_plan_that_fits(every, todo, {}, skipped) == state_on_host.label
    # Each plan is compiled in a stage after every plan it is compared with.
    stage_of = {todo[i]: k for k, stage in enumerate(pruning.stages(todo)) for i in stage}
    assert sorted(i for stage in pruning.stages(todo) for i in stage) == list(range(len(todo)))
    for c in todo:
        for before in pruning._less_in_host_memory(c, todo):
            if before in stage_of:
                assert stage_of[before] < stage_of[c], (c.label, before.label)
    assert stage_of[experts] < stage_of[every]
    assert stage_of[Candidate.of("recompute_all", "host", "experts", update_on_host=True)] > stage_of[experts]


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_the_weight_stream_counts_the_experts_alone(grad_accum):
    """By hand: W = the experts' bytes (float32 here), A = grad_accum; forward A x W in, backward A x W in
    and A x W of gradients out (float32 running sums in and out with A > 1), the update W of gradients in,
    W of weights in (float32 weights keep no master copy, so the update reads them) and W of new weights
    out (plus the zeroed sums once, one buffer per expert leaf shape)."""
    recipe = moe_recipe(f"train.grad_accum={grad_accum}", "offload.params=experts", "offload.optimizer_state=host")
    weights = sum(a.size * a.dtype.itemsize for a in expert_arrays(recipe))
    one_gpu = {"data": 1, "fsdp": 1, "tensor": 1}
    model = cost_model.param_traffic(Candidate.of("recompute_all", "host", "experts"), recipe, one_gpu)
    assert model.host_weights == weights > 0
    assert model.forward_in == model.weights_in_backward == model.gradients_out == grad_accum * weights
    assert model.sums_in == (grad_accum * weights if grad_accum > 1 else 0)
    zeros = 0 if grad_accum == 1 else sum(4 * int(np.prod(a.shape)) for a in
                                          {a.shape: a for a in expert_arrays(recipe)}.values())
    assert (model.update_in, model.update_out) == (2 * weights, weights + zeros)
    # fsdp 2 splits the expert axis: each GPU streams half the experts.
    split = cost_model.param_traffic(Candidate.of("recompute_all", "host", "experts"), recipe,
                                     {"data": 1, "fsdp": 2, "tensor": 1})
    assert split.forward_in == model.forward_in // 2


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_the_host_phases_count_the_experts_weights_not_the_rest_of_the_stack(grad_accum):
    """What a run reserves in pinned host memory before anything exists (recipes/train/host_memory.py): the
    experts' weights, and in the step their gradients (grad_accum 1) or float32 sums read and written."""
    experts = sum(a.size * a.dtype.itemsize for a in expert_arrays(moe_recipe()))
    recipes = {params: moe_recipe("offload.optimizer_state=host", f"offload.params={params}",
                                  f"train.grad_accum={grad_accum}") for params in ("device", "experts", "host")}
    phases = {params: host_memory.phases_of_recipe(r) for params, r in recipes.items()}
    assert phases["device"].weights == 0 and phases["experts"].weights == experts < phases["host"].weights
    gradients = experts if grad_accum == 1 else 2 * experts   # float32 toy: the sums are the weights' size
    assert phases["experts"].step_host == phases["device"].step_host + experts + gradients
    # A checkpoint saves the same bytes, from host memory instead of HBM.
    assert phases["experts"].saved_device == phases["device"].saved_device - experts
    assert phases["experts"].saved_host == phases["device"].saved_host + experts
    # Reserved before the run picks its save (in pieces, or orbax's whole one with its pinned staging): the
    # larger of the two peaks.
    whole_save = dataclasses.replace(phases["experts"], save_in_pieces=False)
    assert host_memory.pinned_need_of_recipe(recipes["experts"]) == max(phases["experts"].pinned_peak(),
                                                                       whole_save.pinned_peak())


def test_a_large_dense_model_is_staged_as_before_the_experts_placement():
    """Everything on device; the state on host, streamed (updated in the next forward pass: host:L, the
    non-stacked leaves' state in HBM); the host CPU's update beside the weights on host, streamed, and the
    whole state on host updated in the next forward pass; last the host CPU's update with the weights on host."""
    todo = plan_candidates.candidates(get_recipe("llama3_8b"))
    whole_state_deferred = lambda c: c.update == "next_forward" and c.optimizer_state == "host"  # noqa: E731
    assert [len(stage) for stage in pruning.stages(todo)] == [
        sum(c.optimizer_state == "device" for c in todo),
        sum(c.optimizer_state != "device" and not c.update_on_host and c.params == "device"
            and not whole_state_deferred(c) for c in todo),
        sum(c.update_on_host != (c.params == "host") or whole_state_deferred(c) for c in todo),
        sum(c.update_on_host and c.params == "host" for c in todo)]
    assert sum(c.optimizer_state == "host:32" for c in todo) == sum(whole_state_deferred(c) for c in todo) > 0
    assert sum(c.params == "host" for c in todo) > 0
