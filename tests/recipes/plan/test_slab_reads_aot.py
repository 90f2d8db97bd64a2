"""The save's device reads of host memory (recipes/train/piece_take.py) compile for an H200 without one
(benchmarks/slab_reads_compiled.py): every slab program, both ways, reads its host argument in place (S(5)
in the entry layout) with one dynamic-slice, so a GPU's save takes its pieces as a TPU's did (measured there
15x faster than the host CPU's slices), not by the fallback."""

import pytest

from spillway.recipes.plan.subprocess_runner import run_in_compile_process

pytestmark = pytest.mark.needs_toolchain   # tests/ci_gate.py: skips only without the CUDA toolkit, never under CI


def test_every_slab_read_compiles_for_a_gpu_reading_host_memory_in_place():
    result = run_in_compile_process("benchmarks.slab_reads_compiled", ["--json", "--target", "h200"], timeout_s=300)
    rows = result["rows"]
    assert len(rows) == 10 and not [row for row in rows if "error" in row]
    assert all(row["host_argument"] and row["dynamic_slices"] == 1 for row in rows), rows
