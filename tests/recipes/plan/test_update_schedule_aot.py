"""What XLA's schedule does with the streamed optimizer state's host copies, read from deviceless H200
compiles of a small stand-in (benchmarks/update_in_forward.py): with the train step's XLA settings
(recipes/train/xla_settings.py) a layer's state copies run beside its matmuls, at XLA's default limit of
async copies in flight they do not; and the even/odd-parity shape tied to each layer's input puts every
copy of both directions beside a matmul, in place (docs/DESIGN.md section 6)."""

import pytest

from spillway.recipes.plan.subprocess_runner import run_in_compile_process

pytestmark = [pytest.mark.needs_toolchain,   # tests/ci_gate.py: skips only without the CUDA toolkit, never under CI
              pytest.mark.slow]            # two compile processes, four small compiles: ~30 s on 2 loaded cores

SMALL = ["--layers", "4", "--d-model", "512", "--tokens", "1024", "--variants", "in_place,parity_tied"]


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
    assert step["beside_matmul_forward"][0] > default["beside_matmul_forward"][0]
    # The shape the step runs writes the previous layer's rows before reading the next layer's from them
    # (in place): the writes are done before the reads start, beside no matmul.
    assert step["copies_across_matmuls"]["out"][0] == 0


def test_the_parity_shape_tied_to_the_layer_input_runs_every_copy_beside_a_matmul_in_place(rows):
    row = rows["step"]["parity_tied"]
    beside, moved = row["beside_matmul_forward"]
    assert beside == moved > 0
    assert row["host_temp"] == 0 and row["host_alias"] == row["host"] > 0
    assert rows["default"]["parity_tied"]["beside_matmul_forward"][0] < moved
