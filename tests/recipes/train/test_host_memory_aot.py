"""What a GPU run keeps in pinned host memory, read from deviceless H200 compiles of its programs
(benchmarks/host_memory_aot.py): the step writes the new state over the old one, the state is created in
host memory without a copy beside it, and the update in the next forward pass writes the new state over the
old one too, and the new pending gradients over the old ones (recipes/train/host_memory.py counts each once),
as does the flush of that update before a save."""

import pytest

from spillway.recipes.plan.subprocess_runner import run_in_compile_process

pytestmark = [pytest.mark.needs_toolchain,   # tests/ci_gate.py: skips only without the CUDA toolkit, never under CI
              pytest.mark.slow]            # two minutes of compiles on 2 loaded cores

SMALL = ["model.vocab_size=1024", "model.d_model=128", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=4", "model.mlp_hidden=256"]


@pytest.fixture(scope="module")
def configs():
    return run_in_compile_process("benchmarks.host_memory_aot", ["--json", "--configs", "host,host_next_forward",
                                                                 "--set", *SMALL], timeout_s=600)["configs"]


def test_the_donated_step_writes_the_new_state_over_the_old(configs):
    row = configs["host"]
    step = row["programs"]["step"]
    assert step["host_argument_bytes"] == row["state_host_bytes"] > 0
    assert step["host_alias_bytes"] == step["host_argument_bytes"] == step["host_output_bytes"]
    assert step["host_temp_bytes"] == 0


def test_the_state_is_created_in_host_memory_with_nothing_beside_it(configs):
    for row in configs.values():
        init = row["programs"]["init"]
        assert init["host_output_bytes"] == row["state_host_bytes"]
        assert init["host_temp_bytes"] == 0 and init["host_argument_bytes"] == 0


def test_the_update_in_the_next_forward_pass_writes_the_new_state_over_the_old(configs):
    """Each layer's new state goes over its old row in the scan's carried buffers and the new pending
    gradients over the old ones (both donated): every host byte aliases a donated one, and the host
    temporaries stay under one layer of the state (they are 0: before, the scan's stacked outputs made a
    second copy of the state, and nothing aliased)."""
    row = configs["host_next_forward"]
    step = row["programs"]["step"]
    held = row["state_host_bytes"] + row["pending_host_bytes"]
    assert step["host_argument_bytes"] == step["host_output_bytes"] == held > row["pending_host_bytes"] > 0
    assert step["host_alias_bytes"] == held
    # A layer of SMALL is 164k of its 590k parameters (2 layers of d 128, MLP 256; embedding and head of
    # 1024 x 128), so a quarter of the state is less than one layer's.
    assert step["host_temp_bytes"] < row["state_host_bytes"] // 4



def test_the_flush_writes_the_new_state_over_the_old_too(configs):
    """The flush before a save runs the step's own hook over the layers (update_in_forward.make_flush), so
    that a resumed run rounds as the uninterrupted one: it must keep the hook's in-place writes, every host
    byte aliasing a donated one and no host temporaries."""
    row = configs["host_next_forward"]
    flush = row["programs"]["flush"]
    held = row["state_host_bytes"] + row["pending_host_bytes"]
    assert flush["host_argument_bytes"] == flush["host_output_bytes"] == flush["host_alias_bytes"] == held
    assert flush["host_temp_bytes"] == 0

def test_joining_the_halves_for_a_save_is_a_whole_copy_of_them(configs):
    join = configs["host"]["programs"]["join"]
    assert join["host_alias_bytes"] == 0 and join["host_output_bytes"] == join["host_argument_bytes"]
