"""Deviceless GPU compiles: offload shows up as host memory, HBM orders as it should.

The compiles run in one child process (``spillway.recipes.plan.selfcheck`` through
``run_in_compile_process``): this pytest process initialised JAX without the GPU
compiler plugin, and a PJRT plugin can only join at backend start.

Marked ``needs_toolchain`` (tests/ci_gate.py): skipped only where the CUDA
toolkit's ptxas/libdevice is missing, and never under CI. A missing or
mismatched plugin fails, with the install command: ``make test`` installs it.
"""

import pytest

from spillway.recipes import targets
from spillway.recipes.plan.subprocess_runner import CompileProcessError, run_in_compile_process

pytestmark = pytest.mark.needs_toolchain   # tests/ci_gate.py: skips only without the CUDA toolkit, never under CI


def _report(data):
    # Imported here: spillway.recipes.plan.compile imports JAX, which only matters once a test runs.
    from spillway.recipes.plan.compile import CompileReport
    return CompileReport.from_dict(data)


@pytest.fixture(scope="module")
def selfcheck():
    return run_in_compile_process("spillway.recipes.plan.selfcheck", ["--target", "h200"], timeout_s=300)


@pytest.fixture(scope="module")
def policy_reports(selfcheck):
    return {name: _report(data) for name, data in selfcheck["policies"]["reports"].items()}


def test_offloaded_activation_is_in_host_memory(selfcheck, policy_reports):
    offload, save = policy_reports["offload"], policy_reports["save"]
    all_layers_hidden = selfcheck["policies"]["layers"] * selfcheck["policies"]["hidden_bytes_per_layer"]
    assert offload.host_buffer_count > 0
    assert offload.host_bytes > 0
    assert offload.host_temp_bytes == all_layers_hidden
    assert offload.hbm_bytes <= save.hbm_bytes
    # Each layer's activation goes out in the forward pass and comes back in the backward.
    assert offload.device_to_host_bytes == all_layers_hidden
    assert offload.host_to_device_bytes == all_layers_hidden
    assert offload.host_async_transfers > 0
    assert offload.device_kind == targets.get_target("h200").device_name


def test_nothing_is_offloaded_when_the_policy_does_not_ask(policy_reports):
    for name in ("save", "recompute"):
        assert policy_reports[name].host_buffer_count == 0
        assert policy_reports[name].host_bytes == 0
        assert policy_reports[name].device_to_host_bytes == 0


def test_full_recompute_needs_less_hbm_than_saving(policy_reports):
    assert policy_reports["recompute"].hbm_bytes < policy_reports["save"].hbm_bytes


def test_two_gpu_data_parallel_compile_splits_the_batch(selfcheck):
    sharded = selfcheck["sharded"]
    report = _report(sharded["report"])
    assert report.num_devices == 2
    assert sharded["has_all_reduce"]              # gradients are summed over the data axis
    # Per device: all weights, half of x and half of y.
    assert report.argument_bytes == sharded["param_bytes"] + sharded["batch_bytes_per_array"]
    assert report.host_buffer_count > 0


def test_host_memory_arguments_stay_on_the_host(selfcheck):
    host = selfcheck["host_arguments"]
    report = _report(host["report"])
    assert report.host_argument_bytes == host["momentum_bytes"]
    assert report.argument_bytes == host["param_bytes"] + host["grad_bytes"]
    # Streamed a layer at a time: every momentum byte crosses once each way.
    assert report.host_to_device_bytes == host["momentum_bytes"]
    assert report.device_to_host_bytes == host["momentum_bytes"]
    assert report.hbm_bytes < report.argument_bytes + host["momentum_bytes"]


def test_a_call_with_only_host_arguments_compiles(selfcheck):
    host = selfcheck["host_arguments"]
    report = _report(host["host_only_report"])
    assert report.argument_bytes == 0
    assert report.host_argument_bytes == host["momentum_bytes"]
    assert report.host_output_bytes == host["momentum_bytes"]


def test_every_known_target_compiles_an_offloading_step(selfcheck):
    results = selfcheck["targets"]
    assert sorted(results) == targets.target_names()
    failures = {name: result["error"] for name, result in results.items() if not result["ok"]}
    assert not failures
    for name, result in results.items():
        report = _report(result["report"])
        assert report.device_kind == targets.get_target(name).device_name
        assert report.host_buffer_count > 0


def test_a_failing_compile_process_reports_its_stderr():
    with pytest.raises(CompileProcessError, match="unknown checks"):
        run_in_compile_process("spillway.recipes.plan.selfcheck", ["--checks", "no-such-check"],
                               timeout_s=120)
