"""recipes/plan/cost_model.py on hand-worked cases: compile reports written out as numbers, the phases and
the step they must give worked out by hand in the docstrings (no compile).

A host link of 1 GB/s and a GPU so fast that compute takes no time make every phase its link time in
seconds: bytes / 1e9. The compiled figures these formulas meet are checked against the bytes computed from
the model's shapes in test_planner.py and test_host_params_aot.py.
"""

import dataclasses

import pytest

from spillway.recipes.config import NEXT_FORWARD
from spillway.recipes.plan import compute_model, cost_model
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.registry import get_recipe
from spillway.recipes.targets import get_target

ONE_GPU = {"data": 1, "fsdp": 1, "tensor": 1}
# A link that carries both directions at once (host_link_duplex): the overlap credit's arithmetic.
SLOW_LINK = dataclasses.replace(get_target("h200"), host_link_bytes_per_s=1e9, peak_bf16_flops=1e30,
                                host_link_duplex=True)
GB = 1e9


def small_recipe():
    # bfloat16 compute: the compute figures below are priced at the target's bf16 peak (float32's is TF32's)
    return get_recipe("tiny", ["train.global_batch=4", "execution.dtype=bfloat16"])


# 5 GB out, 6 GB in, 4 GB of host argument (the optimizer state), 3 GB of it moved with both directions busy:
# the first test below works it by hand on a duplex link, the third on one that takes turns.
STREAMED_UPDATE_REPORT = {"device_to_host_bytes": 5 * GB, "host_to_device_bytes": 6 * GB,
                          "host_argument_bytes": 4 * GB, "overlapped_transfer_bytes": 3 * GB,
                          "overlapped_bytes_by_pass": {"forward": 0, "backward": 0.5 * GB, "other": 2.5 * GB}}


def host_state_row(report: dict, target) -> cost_model.PlanRow:
    """The planner's row for recompute_all with the optimizer state on host, from `report`, on `target`."""
    return cost_model.plan_row(Candidate.of("recompute_all", "host"), {"report": report}, small_recipe(), target,
                               ONE_GPU)


def test_the_streamed_update_pays_state_in_and_out_less_what_moves_both_ways_at_once():
    """5 GB out, 6 GB in, 4 GB of host argument (the optimizer state, weights on device), 3 GB moved with
    both directions busy: 0.5 GB of it in the backward pass, 2.5 GB in the update.

        transfer  (5 + 6 - 3) / 1             = 8 s
        state     min(4, 5, 6)                = 4 GB in and 4 GB out during the update
        forward   activations out: 5 - 4      = 1 s   (nothing comes in)
        backward  activations back: 6 - 4     = 2 s   (nothing goes out, so 0.5 GB overlap counts as 0)
        update    (4 + 4 - 2.5) / 1           = 5.5 s
        step      1 + 2 + 5.5                 = 8.5 s
    """
    row = host_state_row(STREAMED_UPDATE_REPORT, SLOW_LINK)
    assert row.transfer_s == pytest.approx(8.0)
    assert (row.forward_s, row.backward_s, row.update_s) == pytest.approx((1.0, 2.0, 5.5))
    assert row.step_s == pytest.approx(8.5)


def test_overlap_is_credited_at_most_the_smaller_direction():
    """The same state, 4 GB each way, with 5 GB reported as overlapped in the update: at most 4 GB can be,
    so the update takes (4 + 4 - 4) / 1 = 4 s, not 3."""
    report = {"device_to_host_bytes": 4 * GB, "host_to_device_bytes": 4 * GB, "host_argument_bytes": 4 * GB,
              "overlapped_transfer_bytes": 5 * GB, "overlapped_bytes_by_pass": {"other": 5 * GB}}
    row = host_state_row(report, SLOW_LINK)
    assert row.update_s == pytest.approx(4.0)
    assert (row.forward_s, row.backward_s) == pytest.approx((0.0, 0.0))
    assert cost_model.link_seconds(6, 4, 3, 1.0) == 7.0 and cost_model.link_seconds(6, 4, 9, 1.0) == 6.0


def test_a_link_that_takes_turns_credits_no_overlap():
    """The first test's report on a link whose directions take turns (every shipped target: the H200 measured
    so, BENCHMARKS.md 2026-12-04): the 3 GB in flight both ways count twice. Transfer (5 + 6) = 11 s; the
    update (4 + 4) = 8 s; the backward pass's 0.5 GB changes nothing (nothing goes out then); the same bytes
    in a next_forward plan's forward pass add too."""
    assert not any(get_target(name).host_link_duplex for name in ("h100", "h200", "l4", "gh200-96gb"))
    turns = dataclasses.replace(SLOW_LINK, host_link_duplex=False)
    row = host_state_row(STREAMED_UPDATE_REPORT, turns)
    assert row.transfer_s == pytest.approx(11.0)
    assert (row.forward_s, row.backward_s, row.update_s) == pytest.approx((1.0, 2.0, 8.0))
    forward = {"device_to_host_bytes": 3 * GB, "host_to_device_bytes": 4 * GB,
               "overlapped_bytes_by_pass": {"forward": 2 * GB}, "overlapped_transfer_bytes": 2 * GB,
               "host_argument_bytes": 4 * GB,
               "transfer_bytes_by_pass": {"forward": {"device_to_host_bytes": 3 * GB, "host_to_device_bytes": 4 * GB}}}
    deferred = Candidate.of("recompute_all", "host", "device", NEXT_FORWARD)
    assert cost_model.plan_row(deferred, {"report": forward}, small_recipe(), turns, ONE_GPU).forward_s \
        == pytest.approx(7.0)
    assert cost_model.plan_row(deferred, {"report": forward}, small_recipe(), SLOW_LINK, ONE_GPU).forward_s \
        == pytest.approx(5.0)


def test_state_on_device_moves_nothing_in_the_update():
    """No host argument: the 2 GB out and 2 GB back are offloaded activations, 1 GB of them overlapped in the
    backward pass: forward 2 s, backward (2 - 0) = 2 s (nothing goes out then), update 0 s."""
    report = {"device_to_host_bytes": 2 * GB, "host_to_device_bytes": 2 * GB, "host_argument_bytes": 0,
              "overlapped_transfer_bytes": 1 * GB, "overlapped_bytes_by_pass": {"backward": 1 * GB}}
    row = cost_model.plan_row(Candidate.of("offload_inputs", "device"), {"report": report}, small_recipe(),
                              SLOW_LINK, ONE_GPU)
    assert (row.forward_s, row.backward_s, row.update_s) == pytest.approx((2.0, 2.0, 0.0))
    assert row.transfer_s == pytest.approx(3.0)


def test_the_update_in_the_next_forward_is_read_pass_by_pass():
    """Forward: 3 GB out, 4 GB in, 2 GB of it both ways at once: (3 + 4 - 2) = 5 s; backward: 1 GB of
    gradients out: 1 s; the update before the forward pass (leaves outside the stack): 0.5 GB each way, no
    overlap: 1 s. Transfer: (4.5 + 4.5 - 2) = 7 s."""
    report = {"device_to_host_bytes": 4.5 * GB, "host_to_device_bytes": 4.5 * GB, "host_argument_bytes": 4 * GB,
              "overlapped_transfer_bytes": 2 * GB, "overlapped_bytes_by_pass": {"forward": 2 * GB},
              "transfer_bytes_by_pass": {
                  "forward": {"device_to_host_bytes": 3 * GB, "host_to_device_bytes": 4 * GB},
                  "backward": {"device_to_host_bytes": 1 * GB, "host_to_device_bytes": 0},
                  "other": {"device_to_host_bytes": 0.5 * GB, "host_to_device_bytes": 0.5 * GB}}}
    candidate = Candidate.of("recompute_all", "host", "device", NEXT_FORWARD)
    row = cost_model.plan_row(candidate, {"report": report}, small_recipe(), SLOW_LINK, ONE_GPU)
    assert (row.forward_s, row.backward_s, row.update_s) == pytest.approx((5.0, 1.0, 1.0))
    assert row.transfer_s == pytest.approx(7.0)


def test_the_update_in_the_next_forward_hides_only_what_the_schedule_runs_beside_a_matmul():
    """The forward pass's 5 s of link time (as above) beside 10 s of forward compute: with every copy
    scheduled beside a matmul it hides (10 s); with half of the bytes beside one, the other half waits on
    its own: max(10, 2.5) + 2.5 = 12.5 s. A report from before the schedule was read hides it all."""
    recipe = small_recipe()
    forward_flops = cost_model.flop_count.train_step_flops(recipe.decoder_spec(), recipe.train.global_batch,
                                                           recipe.data.seq_len, remat="recompute_all").forward
    fraction = compute_model.efficiency(recipe.execution.attention_impl).fraction
    target = dataclasses.replace(SLOW_LINK, peak_bf16_flops=forward_flops / 10 / fraction)
    report = {"device_to_host_bytes": 3 * GB, "host_to_device_bytes": 4 * GB, "host_argument_bytes": 4 * GB,
              "overlapped_transfer_bytes": 2 * GB, "overlapped_bytes_by_pass": {"forward": 2 * GB},
              "transfer_bytes_by_pass": {"forward": {"device_to_host_bytes": 3 * GB, "host_to_device_bytes": 4 * GB}}}
    candidate = Candidate.of("recompute_all", "host", "device", NEXT_FORWARD)
    forward_s = {}
    for beside in (7, 3.5, None):
        scheduled = {} if beside is None else {"async_copy_bytes_by_pass": {"forward": 7 * GB},
                                               "copies_beside_compute_by_pass": {"forward": beside * GB}}
        row = cost_model.plan_row(candidate, {"report": {**report, **scheduled}}, recipe, target, ONE_GPU)
        forward_s[beside] = row.forward_s
    assert forward_s == pytest.approx({7: 10.0, 3.5: 12.5, None: 10.0})


def test_with_micro_batches_the_update_in_the_next_forward_hides_under_the_first_one_only():
    """4 GB of state copies in the first micro-batch's forward pass (4 s at 1 GB/s, all beside a matmul) and a
    forward pass of 10 s over the whole step. With one batch per step the copies hide under the 10 s; with 4
    micro-batches only under the first one's 2.5 s: max(2.5, 4) + the other three's 7.5 s = 11.5 s. The later
    micro-batches' own copies (1 GB of activations out, beside their matmuls) hide under their 7.5 s; the
    same 1 GB waiting on its own (not beside a matmul) adds 1 s."""
    forward = {"device_to_host_bytes": 2 * GB, "host_to_device_bytes": 2 * GB}
    one_batch = {"device_to_host_bytes": 2 * GB, "host_to_device_bytes": 2 * GB, "host_argument_bytes": 2 * GB,
                 "overlapped_transfer_bytes": 0, "overlapped_bytes_by_pass": {},
                 "transfer_bytes_by_pass": {"forward": forward}, "async_copy_bytes_by_pass": {"forward": 4 * GB},
                 "copies_beside_compute_by_pass": {"forward": 4 * GB}}
    later = {"device_to_host_bytes": 1 * GB, "host_to_device_bytes": 0}
    accumulated = {**one_batch, "device_to_host_bytes": 3 * GB,
                   "transfer_bytes_by_pass": {"forward": forward, "later_forward": later},
                   "async_copy_bytes_by_pass": {"forward": 4 * GB, "later_forward": 1 * GB}}
    reports = {(1, "beside"): one_batch,
               (4, "beside"): {**accumulated, "copies_beside_compute_by_pass": {"forward": 4 * GB,
                                                                                "later_forward": 1 * GB}},
               (4, "alone"): accumulated}
    candidate = Candidate.of("recompute_all", "host", "device", NEXT_FORWARD, pending_gradients="device")
    forward_s = {}
    for (grad_accum, where), report in reports.items():
        recipe = get_recipe("tiny", ["train.global_batch=4", f"train.grad_accum={grad_accum}",
                                     "execution.dtype=bfloat16"])
        forward_flops = cost_model.flop_count.train_step_flops(recipe.decoder_spec(), recipe.train.global_batch,
                                                               recipe.data.seq_len, remat="recompute_all").forward
        fraction = compute_model.efficiency(recipe.execution.attention_impl).fraction
        target = dataclasses.replace(SLOW_LINK, peak_bf16_flops=forward_flops / 10 / fraction)
        row = cost_model.plan_row(candidate, {"report": report}, recipe, target, ONE_GPU)
        forward_s[grad_accum, where] = row.forward_s
    assert forward_s == pytest.approx({(1, "beside"): 10.0, (4, "beside"): 11.5, (4, "alone"): 12.5})


def test_compute_hides_a_shorter_transfer():
    """At a peak rate that makes the forward pass take 10 s (at the efficiency the planner prices the recipe's
    attention kernel at, recipes/plan/compute_model.py), 1 GB of activations (1 s) hides under it: the
    phase is the compute's 10 s."""
    recipe = small_recipe()
    forward_flops = cost_model.flop_count.train_step_flops(recipe.decoder_spec(), 4, recipe.data.seq_len,
                                                           remat="offload_inputs").forward
    fraction = compute_model.efficiency(recipe.execution.attention_impl).fraction
    target = dataclasses.replace(SLOW_LINK, peak_bf16_flops=forward_flops / 10 / fraction)
    report = {"device_to_host_bytes": 1 * GB, "host_to_device_bytes": 1 * GB, "host_argument_bytes": 0,
              "overlapped_transfer_bytes": 0}
    row = cost_model.plan_row(Candidate.of("offload_inputs", "device"), {"report": report}, recipe, target, ONE_GPU)
    assert row.forward_s == pytest.approx(10.0)
