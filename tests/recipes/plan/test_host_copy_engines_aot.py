"""Which host-row offsets XLA's GPU compiler moves with memcpys and which with kernels, read from deviceless
H200 compiles of one small loop per offset form (benchmarks/host_copy_engines.py; docs/DESIGN.md section
6): an offset that is the loop's counter (plus a constant) is a memcpy under every jaxlib tested; an index
taken from a scan's xs is a kernel."""

import pytest

from spillway.recipes.plan.subprocess_runner import run_in_compile_process

pytestmark = pytest.mark.needs_toolchain   # tests/ci_gate.py: skips only without the CUDA toolkit, never under CI


@pytest.fixture(scope="module")
def rows():
    return run_in_compile_process("benchmarks.host_copy_engines", ["--json", "--layers", "4", "--width", "256"],
                                  timeout_s=600)["rows"]


def test_offsets_from_the_loop_counter_are_memcpys(rows):
    row_bytes = 256 * 256 * 4
    for form in ("fori i / i", "fori i+1 / i", "scan carried counter"):
        assert rows[form] == {"dma_bytes": 2 * 3 * row_bytes, "kernel_bytes": 0}, form


def test_an_index_from_a_scans_xs_is_a_kernel(rows):
    assert rows["scan xs / xs"]["dma_bytes"] == 0
    assert rows["scan xs / xs"]["kernel_bytes"] == 2 * 3 * 256 * 256 * 4
