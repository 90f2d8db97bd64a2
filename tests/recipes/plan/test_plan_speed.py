"""The compile cache end to end: real deviceless compiles of a small Llama for an H100, planned three times.

tests/recipes/plan/test_compile_cache.py checks the cache's logic with stand-in compile processes in
seconds; this checks that the compile processes' own cache (the lowered program as the key) and the
planner's (the request as the key) answer real compiles: a repeated plan compiles nothing and gives the
same figures, a setting the program does not read (train.log_every) lowers again and compiles nothing,
one it does read (data.seq_len) compiles again. Two candidates, two real compiles per cold plan: slow on
the shared 2-core machine (minutes under load).
"""

from __future__ import annotations

import pytest

from spillway.recipes.plan import compile_cache, planner
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.registry import get_recipe

needs_toolchain = pytest.mark.needs_toolchain   # tests/ci_gate.py: never skipped under CI

SMALL = ["model.num_layers=2", "model.d_model=128", "model.num_heads=2", "model.num_kv_heads=2",
         "model.mlp_hidden=256", "model.vocab_size=512", "model.max_seq_len=512", "execution.dtype=bfloat16",
         "execution.param_dtype=bfloat16", "execution.attention_impl=flash", "execution.flash_block_size=128",
         "data.seq_len=256", "train.global_batch=2"]
PLANS = [Candidate.of("recompute_all", "device"), Candidate.of("offload_dots", "host")]


def figures(result):
    return [(row.candidate, row.report["hbm_bytes"], row.report["host_bytes"], row.report["device_to_host_bytes"])
            for row in result.rows]


@pytest.mark.slow   # 4 real compiles and 4 compile processes: minutes on the loaded 2-core machine
@needs_toolchain
def test_real_compiles_are_cached_by_request_and_by_program(monkeypatch, tmp_path):
    monkeypatch.setenv(compile_cache.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(compile_cache.CACHE_SWITCH_ENV, raising=False)

    def plan(*sets):
        return planner.plan(get_recipe("tiny", [*SMALL, *sets]), "h100", 1, plans=PLANS, progress_write=None)

    cold = plan()
    assert cold.timing["compiles"] == 2 and cold.timing["cached"] == 0
    again = plan()
    assert again.timing["compiles"] == 0 and again.timing["cached"] == 2 and again.timing["workers"] == 0
    assert figures(again) == figures(cold)
    relogged = plan("train.log_every=7")   # a new request, the same programs
    assert relogged.timing["compiles"] == 0 and relogged.timing["workers"] > 0
    assert figures(relogged) == figures(cold)
    longer = plan("data.seq_len=512")
    assert longer.timing["compiles"] == 2
    assert all(a[1] < b[1] for a, b in zip(figures(cold), figures(longer)))
