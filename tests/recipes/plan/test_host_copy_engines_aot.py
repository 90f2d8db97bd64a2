"""Which host-row offsets XLA's GPU compiler moves with memcpys and which with kernels, read from deviceless
H200 compiles of one small loop per offset form (benchmarks/host_copy_engines.py; docs/DESIGN.md section
6): an offset that is the loop's counter (plus a constant) is a memcpy under every jaxlib tested; an index
taken from a scan's xs is a kernel."""

import pytest

from spillway.recipes.plan.subprocess_runner import run_in_compile_process

pytestmark = pytest.mark.needs_toolchain   # tests/ci_gate.py: skips only without the CUDA toolkit, never under CI


@pytest.fixture(scope="module")
def compiled():
    return run_in_compile_process("benchmarks.host_copy_engines", ["--json", "--layers", "4", "--width", "256"],
                                  timeout_s=600)


@pytest.fixture
def rows(compiled):
    return compiled["rows"]


@pytest.fixture
def probe_rows(compiled):
    return compiled["probe_rows"]


def test_offsets_from_the_loop_counter_are_memcpys(rows):
    row_bytes = 256 * 256 * 4
    for form in ("fori i / i", "fori i+1 / i", "scan carried counter"):
        assert rows[form] == {"dma_bytes": 2 * 3 * row_bytes, "kernel_bytes": 0}, form


def test_an_index_from_a_scans_xs_is_a_kernel(rows):
    assert rows["scan xs / xs"]["dma_bytes"] == 0
    assert rows["scan xs / xs"]["kernel_bytes"] == 2 * 3 * 256 * 256 * 4


def test_the_gpu_probes_row_loops_can_show_what_they_time(probe_rows):
    """benchmarks/link_overlap_probe.py's row loops, compiled for the H200: the memcpy form moves its rows by
    memcpy and the kernel form by kernels, and in both the schedule has the two directions in flight together
    and every copy's window across the matmul, so the GPU's times say what the hardware and runtime do with
    them."""
    moved = 2 * 3 * 256 * 256 * 4   # 3 iterations, a row each way
    both = probe_rows["rows both+matmuls"]
    assert both["dma_bytes"] == moved and both["kernel_bytes"] == 0
    assert probe_rows["rows both+matmuls (kernels)"]["kernel_bytes"] == moved
    for name in ("rows both+matmuls", "rows both+matmuls (kernels)"):
        assert probe_rows[name]["both_directions_bytes"] == moved // 2, name
    # the kernels' windows span the matmul too, but a kernel is never counted beside compute (hlo.py)
    assert probe_rows["rows both+matmuls"]["beside_matmul_bytes"] == moved
    assert probe_rows["rows both+matmuls (kernels)"]["beside_matmul_bytes"] == 0
