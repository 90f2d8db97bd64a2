"""What XLA's schedule does with the streamed optimizer state's host copies, read from deviceless H200
compiles of a small stand-in (benchmarks/update_in_forward.py): with the train step's XLA settings
(recipes/train/xla_settings.py) a layer's state copies run beside its matmuls, at XLA's default limit of
async copies in flight they do not; the even/odd-parity shape tied to each layer's input puts every copy
of both directions across a matmul, in place, and with its row offsets the loop's counter
(parity_counted_tied) those copies are memcpys, the only copies the planner counts as beside compute
(kernels take the SMs the matmuls need; docs/DESIGN.md section 6)."""

import pytest

from spillway.recipes.plan.subprocess_runner import run_in_compile_process

pytestmark = [pytest.mark.needs_toolchain,   # tests/ci_gate.py: skips only without the CUDA toolkit, never under CI
              pytest.mark.slow]            # two compile processes, six small compiles: ~40 s on 2 loaded cores

# 8 layers: parity_counted's scan of pairs then runs 3 times (a loop of one trip XLA unrolls into kernels)
SMALL = ["--layers", "8", "--d-model", "512", "--tokens", "1024", "--variants",
         "in_place,parity_tied,parity_counted_tied"]


@pytest.fixture(scope="module")
def rows():
    """{"step": the variants compiled with the step's settings, "default": at XLA's default limit (2)}."""
    return {name: run_in_compile_process("benchmarks.update_in_forward", ["--json", *SMALL, *extra],
                                         timeout_s=600)["rows"]
            for name, extra in (("step", []), ("default", ["--async-compute-limit", "2"]))}


def test_the_step_settings_put_the_state_reads_beside_the_matmuls(rows):
    step, default = rows["step"]["in_place"], rows["default"]["in_place"]
    reads_across, reads = step["copies_across_matmuls"]["in"]
    assert reads_across == reads == 3                       # mu, nu and the master row of the next layer
    assert default["copies_across_matmuls"]["in"][0] < 3    # two in flight at a time, by default
    # the step's rows are kernels (an index from the scan's xs, clamped offsets): never beside compute
    assert step["beside_matmul_forward"][0] == 0 and step["kernel_bytes"] > 0
    # The shape the step runs writes the previous layer's rows before reading the next layer's from them
    # (in place): the writes are done before the reads start, beside no matmul.
    assert step["copies_across_matmuls"]["out"][0] == 0


def test_the_parity_shape_tied_to_the_layer_input_runs_every_copy_across_a_matmul_in_place(rows):
    row = rows["step"]["parity_tied"]
    (reads_across, reads), (writes_across, writes) = row["copies_across_matmuls"].values()
    assert reads_across == reads > 0 and writes_across == writes > 0
    assert row["host_temp"] == 0 and row["host_alias"] == row["host"] > 0
    assert rows["default"]["parity_tied"]["copies_across_matmuls"]["in"][0] < reads


def test_with_counter_offsets_the_parity_shapes_rows_are_memcpys_beside_the_matmuls_in_place(rows):
    """parity_counted_tied: the forward scan's copies are memcpys (a pair counter carried through the scan),
    each across a matmul, in place; the first fetch and the last pair, outside the scan, are not all so."""
    row, kernels = rows["step"]["parity_counted_tied"], rows["step"]["parity_tied"]["kernel_bytes"]
    (reads_across, reads), (writes_across, writes) = row["copies_across_matmuls"].values()
    assert reads_across == reads > 0 and writes_across == writes > 0
    beside, moved = row["beside_matmul_forward"]
    assert moved > beside > 0.75 * moved       # the rest: the first fetch and the last pair's, outside the scan
    assert 0 < row["kernel_bytes"] < kernels / 3
    assert row["host_temp"] == 0 and row["host_alias"] == row["host"] > 0
