"""The host memory checks a run makes before it allocates anything: its peak over phases against the RAM
(naming the phase), the pinned-host limit against the plan's pinned need, `--host-ram-gb` above the machine's
RAM; each bad input one line (recipes/train/host_memory.py, recipes/train/gpu_allocators.py)."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from spillway.layers.errors import ConfigError
from spillway.layers.mesh import MeshConfig
from spillway.layers.sharding import make_mesh
from spillway.recipes.registry import get_recipe
from spillway.recipes.train import gpu_allocators, host_memory
from spillway.recipes.train import step as step_lib
from spillway.recipes.optim.host_memory import HostMemoryError

GB = 10**9


def small_recipe(*extra):
    return get_recipe("tiny", ["model.vocab_size=128", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
                               "model.num_kv_heads=2", "model.mlp_hidden=64", "model.max_seq_len=32",
                               "data.seq_len=16", "train.global_batch=4", *extra])


def test_a_pinned_limit_set_below_the_plans_need_is_one_line_naming_the_variable():
    env = {gpu_allocators.HOST_LIMIT_ENV: "64"}
    with pytest.raises(HostMemoryError, match=r"^XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=64 caps pinned host memory at 64 "
                       r"GB, but this run pins 120.0 GB at its peak.*at least 120 or unset it") as caught:
        gpu_allocators.check_pinned_limit(120 * GB, env)
    assert "\n" not in str(caught.value)
    gpu_allocators.check_pinned_limit(60 * GB, env)        # enough: no error
    gpu_allocators.check_pinned_limit(10**15, {})          # not set by hand: training sets it
    with pytest.raises(ConfigError, match=r"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB='lots' is not a number of GB"):
        gpu_allocators.check_pinned_limit(1, {gpu_allocators.HOST_LIMIT_ENV: "lots"})


def test_training_sets_the_pinned_limit_from_the_plans_need():
    env = {}
    chosen = gpu_allocators.configure(env, ram_bytes=128 * 2**30, pinned_need_bytes=100 * GB)
    assert chosen[gpu_allocators.HOST_LIMIT_ENV] == "112"       # 1.1 x 100 GB + 2 GB
    mine = {gpu_allocators.HOST_LIMIT_ENV: "50"}
    assert gpu_allocators.HOST_LIMIT_ENV not in gpu_allocators.configure(mine, ram_bytes=128 * 2**30,
                                                                         pinned_need_bytes=100 * GB)
    assert mine[gpu_allocators.HOST_LIMIT_ENV] == "50"           # the user's stays, and check_pinned_limit judges it


def test_the_pinned_need_of_a_recipe_counts_state_and_the_saves_staging_without_starting_a_backend():
    """Llama 3.1 8B with its state on host, one process: the save's pinned peak is the state (12 bytes a
    parameter), its stacked part joined again, and the bf16 weights staged by orbax (2 bytes a parameter)."""
    recipe = get_recipe("llama3_8b_offload", ["optimizer.update_on_host=false"])   # streamed: halves to join
    need = host_memory.pinned_need_of_recipe(recipe)
    n = recipe.num_params()
    assert 12 * n + 2 * n < need < 24 * n + 2 * n


def test_host_ram_gb_above_the_machines_warns_naming_both():
    s = step_lib.abstract_setup(small_recipe("offload.optimizer_state=host"),
                                make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1]), platform="cpu")
    said = []
    host_memory.check_run(s, host_ram_bytes=512 * GB, machine_ram_bytes=16 * GB, say=said.append)
    assert len(said) == 1 and "--host-ram-gb 512 is more than this machine's RAM (16.0 GB" in said[0]
    said.clear()
    host_memory.check_run(s, host_ram_bytes=8 * GB, machine_ram_bytes=16 * GB, say=said.append)
    assert not said


def test_a_peak_above_the_ram_stops_the_run_before_anything_is_allocated(tmp_path, monkeypatch):
    from spillway.recipes.train import data_pipeline, loop

    monkeypatch.setattr(loop, "setup", lambda *args, **kwargs: pytest.fail("setup() ran: the weights were made"))
    # and before any data is prepared (tokenizing a corpus can take hours)
    monkeypatch.setattr(data_pipeline, "prepare", lambda *args, **kwargs: pytest.fail("the data was prepared"))
    recipe = small_recipe("offload.optimizer_state=host", "model.vocab_size=512", "data.source=builtin:stdlib:200000",
                          f"data.cache_dir={tmp_path / 'cache'}", "data.num_proc=1", "train.steps=2",
                          "train.eval_every=0", "train.global_batch=8",
                          f"checkpoint.dir={tmp_path / 'run'}")
    with pytest.raises(host_memory.HostPeakError, match=r"^this run's host memory would peak at \S+ GiB during the "
                       r"\w[\w -]+ \(process .*\), but this host has 0.0 GiB of RAM"):
        loop.train(recipe, progress=False, host_ram_gb=0.001)


def test_a_host_ram_gb_that_is_not_positive_is_one_config_error(tmp_path):
    from spillway.recipes.train import loop
    with pytest.raises(ConfigError, match=r"--host-ram-gb must be positive, got -1"):
        loop.train(small_recipe(f"checkpoint.dir={tmp_path}"), progress=False, host_ram_gb=-1)


def test_a_peak_with_nothing_in_host_memory_does_not_advise_moving_it_to_the_device():
    """The state and the weights already on the device: the refusal names the phase and its bytes and says a
    bigger host is what helps, not offload.optimizer_state=device (already so)."""
    on_device = host_memory.HostPhases(footprint=GB, state=0, halved=0, weights=0, pending=0, step_host=0,
                                       saved_device=GB, saved_host=0, gpu=False)
    with pytest.raises(host_memory.HostPeakError, match=r"during the checkpoint save \(process .*\), but this host "
                       r"has 0.5 GiB of RAM: nothing of this run is in host memory already .*more RAM$") as refused:
        host_memory.check_host_peak(on_device, GB // 2)
    assert "offload.optimizer_state=device" not in str(refused.value)
    with pytest.raises(host_memory.HostPeakError, match=r"keep more on device \(offload.optimizer_state=device"):
        host_memory.check_host_peak(dataclasses.replace(on_device, state=GB, step_host=GB), GB // 2)
