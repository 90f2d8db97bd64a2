"""A scanned stack of MoE blocks compiled for an H200 without a GPU: the expert-activation offload preset puts
exactly the expert activations in host memory; recompute_all puts nothing there.

CPU JAX treats memory kinds as no-ops, so only a GPU compile shows where a
value lives (docs/DESIGN.md section 3). One compile process (the planner's,
recipes/plan/subprocess_runner.py) runs benchmarks/moe_dispatch.py's stack
check: 2 scanned blocks (d 512, 8 experts, top-2, expert hidden 512), 512
tokens, bfloat16, forward and backward, each dispatch (dropless by ragged_dot
and by blocks, capacity). What the preset
offloads per layer, and so what must appear as host temp and as bytes sent to
host, is d + f + f + d values per token copy the experts compute (the
dispatched tokens, gate, up, the expert output): tokens x k copies dropless,
every slot with the capacity dispatch.

Marked `needs_toolchain` (tests/ci_gate.py) and `slow` (six GPU compiles).
"""

import pytest

from spillway.recipes.plan.subprocess_runner import run_in_compile_process

pytestmark = [pytest.mark.needs_toolchain, pytest.mark.slow]


@pytest.fixture(scope="module")
def stack():
    return run_in_compile_process(
        "benchmarks.moe_dispatch",
        ["--json", "--checks", "stack", "--stack-layers", "2", "--stack-tokens", "512",
         "--stack-presets", "recompute_all,moe_offload_experts"], timeout_s=900)["stack"]


@pytest.mark.parametrize("dispatch", ["dropless", "dropless_blocked", "capacity"])
def test_expert_activation_offload_shows_host_buffers_of_exactly_the_expert_activations(stack, dispatch):
    offload = stack["rows"][f"{dispatch}/moe_offload_experts"]["report"]
    expected = stack["layers"] * stack["expert_activation_bytes_per_layer"][dispatch]
    assert offload["host_buffer_count"] > 0
    assert offload["host_temp_bytes"] == expected
    assert offload["device_to_host_bytes"] == expected
    # Everything sent out comes back for the backward pass (the combine reads the expert output too).
    assert offload["host_to_device_bytes"] == expected
    assert offload["host_async_transfers"] > 0


@pytest.mark.parametrize("dispatch", ["dropless", "dropless_blocked", "capacity"])
def test_recompute_all_keeps_nothing_in_host_memory(stack, dispatch):
    report = stack["rows"][f"{dispatch}/recompute_all"]["report"]
    assert report["host_buffer_count"] == 0 and report["host_bytes"] == 0 and report["device_to_host_bytes"] == 0
