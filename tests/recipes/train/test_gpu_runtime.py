"""What a run on a GPU needs from its runtime: allocator limits that follow the planner (recipes/train/gpu_allocators.py), and cuDNN attention only where there is cuDNN."""

from spillway.recipes.plan import planner
from spillway.recipes.train import gpu_allocators


def test_unset_variables_are_set_to_the_planners_assumptions():
    environ: dict[str, str] = {}
    chosen = gpu_allocators.configure(environ, ram_bytes=128 * 2**30)
    assert environ == chosen
    assert float(environ["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == 0.9
    # 90% of 137.4 GB, in the variable's decimal GB, not above the RAM
    assert environ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] == "123"
    assert int(environ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"]) * 1e9 <= 128 * 2**30


def test_the_fraction_is_the_planners_default_headroom():
    import inspect
    assert inspect.signature(planner.plan).parameters["headroom"].default == gpu_allocators.HBM_FRACTION


def test_a_users_settings_are_kept():
    environ = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5", "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "10"}
    assert gpu_allocators.configure(environ, ram_bytes=128 * 2**30) == {}
    assert environ == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5", "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "10"}


def test_no_host_limit_where_the_ram_is_unknown(monkeypatch):
    monkeypatch.setattr(gpu_allocators, "host_ram_bytes", lambda: None)
    environ: dict[str, str] = {}
    assert set(gpu_allocators.configure(environ)) == {"XLA_PYTHON_CLIENT_MEM_FRACTION"}


def test_this_hosts_ram_is_read():
    ram = gpu_allocators.host_ram_bytes()
    assert ram is None or ram > 2**28


def test_cudnn_attention_off_a_gpu_is_one_line_naming_the_fix():
    import pytest

    from spillway.layers.errors import ConfigError
    from spillway.recipes.train.step import check_attention_backend

    with pytest.raises(ConfigError, match=r"attention_impl=cudnn needs an NVIDIA GPU.*attention_impl=flash"):
        check_attention_backend("cudnn", "cpu")
    check_attention_backend("cudnn", "gpu")
    check_attention_backend("flash", "cpu")


def test_a_cudnn_run_off_a_gpu_stops_before_it_prepares_data_or_takes_its_directory(tmp_path):
    import pytest

    from spillway.layers.errors import ConfigError
    from spillway.recipes.registry import get_recipe
    from spillway.recipes.train.loop import train

    run_dir = tmp_path / "run"
    recipe = get_recipe("tiny", ["execution.attention_impl=cudnn", f"checkpoint.dir={run_dir}"])
    said = []
    with pytest.raises(ConfigError, match="attention_impl=cudnn needs an NVIDIA GPU"):
        train(recipe, echo=said.append, progress=False)
    assert said == [] and not run_dir.exists()
