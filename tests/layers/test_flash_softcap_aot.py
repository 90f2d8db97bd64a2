"""The soft-capped flash kernel compiled for an H200 without a GPU: at 8192 tokens its forward + backward holds
the same temporary HBM as the plain kernel (within a few percent), traced window or not.

One child process (the planner's compile process) runs benchmarks/flash_softcap_memory.py.
Marked `needs_toolchain` (tests/ci_gate.py), like tests/recipes/test_aot.py, and slow (about 50 s here).
"""

import pytest

from spillway.recipes.plan.subprocess_runner import run_in_compile_process

pytestmark = [pytest.mark.needs_toolchain, pytest.mark.slow]


def test_softcap_costs_no_hbm_at_8192_tokens():
    result = run_in_compile_process("benchmarks.flash_softcap_memory", ["--json", "--target", "h200"],
                                    timeout_s=600)
    rows = result["rows"]
    plain = rows["plain"]["temp_bytes"]
    # One fp32 [b, n, t, s] score matrix would be 8 GiB; the kernel's temp is a few hundred MiB.
    assert plain < 1 * 32 * 8192 * 8192 * 4 / 16, plain
    for name in ("softcap", "softcap_window", "static_window"):
        assert abs(rows[name]["temp_bytes"] - plain) <= 0.03 * plain, (name, rows[name], plain)
