"""Fast tests of the deviceless-compile layer's pure-Python parts: HLO reading, targets, plugin paths.

No compile happens here (see test_aot.py for those), so these run anywhere.
"""

import sys
from pathlib import Path

import pytest

from spillway.recipes import targets
from spillway.recipes.plan import hlo, plugin

# A hand-written post-optimisation module in the form XLA prints it: a loop of 4
# iterations offloads one 1x128x256 bf16 slice per iteration through an async
# fusion, and the entry brings a host-resident f32[64,32] argument to the device.
_OFFLOADING_HLO = """\
HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[64,32]{1,0:S(5)})->f32[]}

%wrapped_dynamic-update-slice_computation (param_0: bf16[4,128,256], param_1: bf16[1,128,256], param_2: s32[]) -> bf16[4,128,256] {
  %param_0 = bf16[4,128,256]{2,1,0:S(5)} parameter(0)
  %param_1 = bf16[1,128,256]{2,1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  ROOT %dynamic-update-slice.1 = bf16[4,128,256]{2,1,0:S(5)} dynamic-update-slice(%param_0, %param_1, %param_2, %param_2, %param_2)
}

%body (arg_tuple.1: (s32[], bf16[4,128,256])) -> (s32[], bf16[4,128,256]) {
  %arg_tuple.1 = (s32[], bf16[4,128,256]{2,1,0:S(5)}) parameter(0)
  %index = s32[] get-tuple-element(%arg_tuple.1), index=0
  %buffer = bf16[4,128,256]{2,1,0:S(5)} get-tuple-element(%arg_tuple.1), index=1
  %slice = bf16[1,128,256]{2,1,0} fusion(), kind=kLoop, calls=%make_slice
  %dus-start = ((bf16[4,128,256]{2,1,0:S(5)}, bf16[1,128,256]{2,1,0}, s32[]), bf16[4,128,256]{2,1,0:S(5)}, u32[]) fusion-start(%buffer, %slice, %index), kind=kCustom, calls=%wrapped_dynamic-update-slice_computation
  %dus-done = bf16[4,128,256]{2,1,0:S(5)} fusion-done(%dus-start)
  ROOT %tuple.2 = (s32[], /*index=1*/bf16[4,128,256]{2,1,0:S(5)}) tuple(%index, %dus-done)
}

%condition (arg_tuple.2: (s32[], bf16[4,128,256])) -> pred[] {
  %arg_tuple.2 = (s32[], bf16[4,128,256]{2,1,0:S(5)}) parameter(0)
  ROOT %done = pred[] constant(false)
}

ENTRY %main.7 (host_arg: f32[64,32]) -> f32[] {
  %host_arg = f32[64,32]{1,0:S(5)} parameter(0)
  %copy-start = (f32[64,32]{1,0}, f32[64,32]{1,0:S(5)}, u32[]) copy-start(%host_arg)
  %copy-done = f32[64,32]{1,0} copy-done(%copy-start)
  %buffer = bf16[4,128,256]{2,1,0:S(5)} custom-call(), custom_call_target="AllocateBuffer"
  %zero = s32[] constant(0)
  %init = (s32[], bf16[4,128,256]{2,1,0:S(5)}) tuple(%zero, %buffer)
  %loop = (s32[], bf16[4,128,256]{2,1,0:S(5)}) while(%init), condition=%condition, body=%body, backend_config={"known_trip_count":{"n":"4"},"known_init_step":{"init":"0","step":"1"}}
  ROOT %sum = f32[] fusion(%copy-done), kind=kInput, calls=%reduce
}
"""


def test_shapes_parse_with_tuples_comments_and_host_layouts():
    shape = hlo.parse_shape("(s32[], /*index=1*/bf16[4,128,256]{2,1,0:S(5)}, f32[3]{0})")
    assert isinstance(shape, tuple) and len(shape) == 3
    assert shape[1] == hlo.ArrayShape("bf16", (4, 128, 256), on_host=True)
    assert shape[1].nbytes == 4 * 128 * 256 * 2
    assert shape[2].on_host is False and shape[0].dims == ()


def test_host_traffic_counts_loop_offloads_per_iteration_and_argument_copies():
    traffic = hlo.host_traffic(_OFFLOADING_HLO)
    slice_bytes = 128 * 256 * 2
    assert traffic.device_to_host_bytes == 4 * slice_bytes
    assert traffic.host_to_device_bytes == 64 * 32 * 4
    assert traffic.async_transfers == 2 and traffic.sync_transfers == 0
    assert traffic.unknown_trip_counts == 0


def test_host_traffic_flags_loops_without_a_trip_count():
    without_trip_count = _OFFLOADING_HLO.replace('"known_trip_count":{"n":"4"},', "")
    traffic = hlo.host_traffic(without_trip_count)
    assert traffic.unknown_trip_counts == 1
    assert traffic.device_to_host_bytes == 128 * 256 * 2


def test_host_memory_annotations_are_counted():
    assert hlo.count_host_memory_annotations(_OFFLOADING_HLO) > 0
    assert hlo.count_host_memory_annotations("f32[2]{0} add(...)") == 0


# A loop body in the order XLA schedules the streamed optimizer update: the
# write-back of one layer (device->host) starts before the prefetch of the
# next (host->device) is done, so both are in flight together; a third,
# lone prefetch overlaps nothing. `{sequential}` swaps in a done first.
_TWO_DIRECTION_BODY = """\
HloModule jit_update, is_scheduled=true

%body (arg: (s32[], f32[4,64]{1,0:S(5)}, f32[4,64]{1,0:S(5)})) -> (s32[], f32[4,64]{1,0:S(5)}, f32[4,64]{1,0:S(5)}) {
  %arg = (s32[], f32[4,64]{1,0:S(5)}, f32[4,64]{1,0:S(5)}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %a = f32[4,64]{1,0:S(5)} get-tuple-element(%arg), index=1
  %b = f32[4,64]{1,0:S(5)} get-tuple-element(%arg), index=2
  %row = f32[1,64]{1,0} fusion(%i), kind=kLoop, calls=%update
  %fetch-start = ((f32[4,64]{1,0:S(5)}, s32[]), f32[1,64]{1,0}, u32[]) fusion-start(%b, %i), kind=kCustom, calls=%ds
  {sequential}%write-start = ((f32[4,64]{1,0:S(5)}, f32[1,64]{1,0}, s32[]), f32[4,64]{1,0:S(5)}, u32[]) fusion-start(%a, %row, %i), kind=kCustom, calls=%dus
  %fetch-done = f32[1,64]{1,0} fusion-done(%fetch-start)
  %write-done = f32[4,64]{1,0:S(5)} fusion-done(%write-start)
  %lone-start = ((f32[4,64]{1,0:S(5)}, s32[]), f32[1,64]{1,0}, u32[]) fusion-start(%a, %i), kind=kCustom, calls=%ds
  %lone-done = f32[1,64]{1,0} fusion-done(%lone-start)
  ROOT %out = (s32[], f32[4,64]{1,0:S(5)}, f32[4,64]{1,0:S(5)}) tuple(%i, %write-done, %b)
}

%condition (arg.1: (s32[], f32[4,64]{1,0:S(5)}, f32[4,64]{1,0:S(5)})) -> pred[] {
  %arg.1 = (s32[], f32[4,64]{1,0:S(5)}, f32[4,64]{1,0:S(5)}) parameter(0)
  ROOT %c = pred[] constant(false)
}

ENTRY %main (a.1: f32[4,64], b.1: f32[4,64]) -> (s32[], f32[4,64], f32[4,64]) {
  %a.1 = f32[4,64]{1,0:S(5)} parameter(0)
  %b.1 = f32[4,64]{1,0:S(5)} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,64]{1,0:S(5)}, f32[4,64]{1,0:S(5)}) tuple(%zero, %a.1, %b.1)
  ROOT %loop = (s32[], f32[4,64]{1,0:S(5)}, f32[4,64]{1,0:S(5)}) while(%init), condition=%condition, body=%body, backend_config={"known_trip_count":{"n":"3"}}
}
"""


def test_opposite_direction_copies_in_flight_together_are_found():
    row_bytes = 64 * 4
    overlap = hlo.overlapping_host_copies(_TWO_DIRECTION_BODY.replace("{sequential}", ""))
    assert overlap.overlapping_pairs == 1
    assert overlap.host_to_device_bytes == 3 * 2 * row_bytes     # two fetches per iteration, 3 iterations
    assert overlap.device_to_host_bytes == 3 * row_bytes
    assert overlap.overlapped_bytes == 3 * row_bytes             # the lone fetch overlaps nothing


# The wrapped computations of the body above: the slice XLA addresses from the loop counter (a memcpy) and a
# dynamic-update-slice it does not (a kernel).
_WRAPPED = """
%ds (p0: f32[4,64], p1: s32[]) -> f32[1,64] {
  %p0 = f32[4,64]{1,0:S(5)} parameter(0)
  %p1 = s32[] parameter(1)
  ROOT %slice = f32[1,64]{1,0} dynamic-slice(%p0, %p1, %p1), dynamic_slice_sizes={1,64}, backend_config={"dynamic_slice_config":{"loop_index":"0","byte_offset":"0","byte_stride":"256"}}
}

%dus (q0: f32[4,64], q1: f32[1,64], q2: s32[]) -> f32[4,64] {
  %q0 = f32[4,64]{1,0:S(5)} parameter(0)
  %q1 = f32[1,64]{1,0} parameter(1)
  %q2 = s32[] parameter(2)
  ROOT %put = f32[4,64]{1,0:S(5)} dynamic-update-slice(%q0, %q1, %q2, %q2)
}
"""


def test_host_slices_addressed_from_the_loop_counter_are_memcpys_and_the_rest_kernels():
    """hlo.host_copy_engines: the two fetches' wrapped slice carries XLA's dynamic_slice_config (a memcpy),
    the write-back's does not (a kernel over PCIe); loop bodies count per iteration."""
    row_bytes = 64 * 4
    engines = hlo.host_copy_engines(_TWO_DIRECTION_BODY.replace("{sequential}", "") + _WRAPPED)
    assert engines.dma_bytes == 3 * 2 * row_bytes
    assert engines.kernel_bytes == 3 * row_bytes
    assert engines.sync_bytes == 0
    assert engines.kernel_fraction == pytest.approx(1 / 3)
    unmarked = hlo.host_copy_engines(_TWO_DIRECTION_BODY.replace("{sequential}", ""))
    assert unmarked.dma_bytes == 0 and unmarked.kernel_bytes == 3 * 3 * row_bytes


def test_overlap_is_credited_to_the_autodiff_pass_of_its_copies():
    plain = hlo.overlapping_host_copies(_TWO_DIRECTION_BODY.replace("{sequential}", ""))
    assert plain.overlapped_by_pass == {"forward": 0, "backward": 0, "other": 3 * 64 * 4}
    # The same copies named as JAX names the backward pass's operations.
    named = _TWO_DIRECTION_BODY.replace("{sequential}", "").replace(
        "calls=%dus", 'calls=%dus, metadata={op_name="jit(step)/transpose(jvp(scan))/device_put"}').replace(
        "fusion-start(%b, %i), kind=kCustom, calls=%ds",
        'fusion-start(%b, %i), kind=kCustom, calls=%ds, metadata={op_name="jit(step)/transpose(jvp(scan))/ds"}')
    overlap = hlo.overlapping_host_copies(named)
    assert overlap.overlapped_by_pass == {"forward": 0, "backward": 3 * 64 * 4, "other": 0}
    assert overlap.overlapped_bytes == plain.overlapped_bytes


def test_copies_that_take_turns_are_not_credited():
    # The fetch completes before the write starts: one direction at a time.
    sequential = _TWO_DIRECTION_BODY.replace(
        "  %fetch-done = f32[1,64]{1,0} fusion-done(%fetch-start)\n", "").replace(
        "{sequential}", "%fetch-done = f32[1,64]{1,0} fusion-done(%fetch-start)\n  ")
    overlap = hlo.overlapping_host_copies(sequential)
    assert overlap.overlapping_pairs == 0 and overlap.overlapped_bytes == 0
    assert overlap.device_to_host_bytes == 3 * 64 * 4


def test_copies_in_flight_across_a_matmul_are_beside_compute():
    """host_copies_beside_compute: with a cuBLAS call scheduled between the fetch's and the write-back's
    starts and their dones, those two copies run beside compute, the lone fetch does not; without it none.
    Their slices are memcpys here (both wrapped computations addressed from the loop counter)."""
    row_bytes = 64 * 4
    both_memcpys = _WRAPPED.replace("ROOT %put = f32[4,64]{1,0:S(5)} dynamic-update-slice(%q0, %q1, %q2, %q2)",
                                    'ROOT %put = f32[4,64]{1,0:S(5)} dynamic-update-slice(%q0, %q1, %q2, %q2), '
                                    'backend_config={"dynamic_slice_config":{"loop_index":"0"}}')
    body = _TWO_DIRECTION_BODY.replace("{sequential}", "") + both_memcpys
    plain = hlo.host_copies_beside_compute(body)
    assert plain.moved_by_pass["other"] == 3 * 3 * row_bytes and plain.beside_compute_by_pass["other"] == 0
    with_matmul = body.replace("  %fetch-done", '  %mm = f32[1,64]{1,0} custom-call(%row), '
                                                'custom_call_target="__cublas$gemm"\n  %fetch-done')
    beside = hlo.host_copies_beside_compute(with_matmul)
    assert beside.beside_compute_by_pass["other"] == 3 * 2 * row_bytes
    assert beside.hidden_fraction("other") == pytest.approx(2 / 3) and beside.hidden_fraction("forward") == 0


def test_a_copy_moved_by_a_kernel_is_never_beside_compute():
    """The same schedule with the write-back's slice a kernel (no dynamic_slice_config): it takes the SMs the
    matmul needs, so only the fetch counts as beside compute; both still count as moved."""
    row_bytes = 64 * 4
    body = _TWO_DIRECTION_BODY.replace("{sequential}", "") + _WRAPPED
    with_matmul = body.replace("  %fetch-done", '  %mm = f32[1,64]{1,0} custom-call(%row), '
                                                'custom_call_target="__cublas$gemm"\n  %fetch-done')
    beside = hlo.host_copies_beside_compute(with_matmul)
    assert beside.moved_by_pass["other"] == 3 * 3 * row_bytes
    assert beside.beside_compute_by_pass["other"] == 3 * row_bytes


# A host computation (compute_on: custom-call-start to HostExecute) reading two host
# arrays and writing its result to device memory, as jaxlib 0.10.2 compiles the
# micro-batch gradient sums of host-resident weights; then copies named by
# JAX's autodiff passes: one in the forward (jvp), one in the backward
# (transpose(jvp)), and one without a name.
_HOST_CALL_HLO = """\
HloModule jit_step, is_scheduled=true

ENTRY %main (a: f32[16,64], b: f32[16,64], w: bf16[8,64], g: bf16[8,64]) -> f32[16,64] {
  %a = f32[16,64]{1,0:S(5)} parameter(0)
  %b = f32[16,64]{1,0:S(5)} parameter(1)
  %w = bf16[8,64]{1,0:S(5)} parameter(2)
  %g = bf16[8,64]{1,0} parameter(3)
  %call-start = ((f32[16,64]{1,0:S(5)}, f32[16,64]{1,0:S(5)}), f32[16,64]{1,0}, u32[]) custom-call-start(%a, %b), async_execution_thread="host", custom_call_target="HostExecute", metadata={op_name="jit(train_step)/while/body/closed_call/compute_on/add"}
  %call-done = f32[16,64]{1,0} custom-call-done(%call-start), metadata={op_name="jit(train_step)/while/body/closed_call/compute_on/add"}
  %in-start = (bf16[8,64]{1,0}, bf16[8,64]{1,0:S(5)}, u32[]) copy-start(%w), metadata={op_name="jit(train_step)/jvp()/while/body/dynamic_slice"}
  %in-done = bf16[8,64]{1,0} copy-done(%in-start)
  %again-start = (bf16[8,64]{1,0}, bf16[8,64]{1,0:S(5)}, u32[]) copy-start(%w), metadata={op_name="jit(train_step)/transpose(jvp())/while/body/dynamic_slice"}
  %again-done = bf16[8,64]{1,0} copy-done(%again-start)
  %out-start = (bf16[8,64]{1,0:S(5)}, bf16[8,64]{1,0}, u32[]) copy-start(%g), metadata={op_name="jit(train_step)/transpose(jvp())/while/body/dynamic_update_slice"}
  %out-done = bf16[8,64]{1,0:S(5)} copy-done(%out-start)
  %back-start = (f32[16,64]{1,0:S(5)}, f32[16,64]{1,0}, u32[]) copy-start(%call-done)
  %back-done = f32[16,64]{1,0:S(5)} copy-done(%back-start)
  ROOT %r = f32[16,64]{1,0} copy(%call-done)
}
"""


def test_a_host_computation_is_counted_once_at_its_start():
    result, weights = 16 * 64 * 4, 8 * 64 * 2
    traffic = hlo.host_traffic(_HOST_CALL_HLO)
    # Its result crosses to the device once (the done moves nothing more), and goes back once.
    assert traffic.host_to_device_bytes == result + 2 * weights
    assert traffic.device_to_host_bytes == result + weights
    assert traffic.async_transfers == 5 and traffic.sync_transfers == 0


def test_a_host_computation_is_no_kernel_and_keeps_its_place_beside_compute():
    """Only a host slice's fusion-start can be a kernel: a host computation's custom-call-start (the host CPU's
    work) moves no bytes by kernel, and across a matmul it counts as beside compute."""
    result = 16 * 64 * 4
    assert hlo.host_copy_engines(_HOST_CALL_HLO).kernel_bytes == 0
    with_matmul = _HOST_CALL_HLO.replace("  %call-done", '  %mm = f32[16,64]{1,0} custom-call(%g), '
                                                          'custom_call_target="__cublas$gemm"\n  %call-done')
    assert hlo.host_copies_beside_compute(with_matmul).beside_compute_by_pass["other"] == result


def test_transfers_are_split_by_autodiff_pass():
    result, weights = 16 * 64 * 4, 8 * 64 * 2
    assert hlo.traffic_by_pass(_HOST_CALL_HLO) == {
        hlo.FORWARD: {"device_to_host_bytes": 0, "host_to_device_bytes": weights},
        hlo.BACKWARD: {"device_to_host_bytes": weights, "host_to_device_bytes": weights},
        hlo.OTHER: {"device_to_host_bytes": result, "host_to_device_bytes": result}}
    assert hlo.autodiff_pass("jit(f)/while/body/jvp(remat)/dot") == hlo.FORWARD
    assert hlo.autodiff_pass("jit(f)/transpose(jvp(remat))/dot") == hlo.BACKWARD
    assert hlo.autodiff_pass("") == hlo.OTHER


def test_the_micro_batches_after_the_one_that_takes_the_update_are_passes_of_their_own():
    """The deferred update with grad_accum > 1 names its later micro-batches (op names as the CPU compile of
    that step writes them): the planner prices those apart from micro-batch 1's passes, and a step without
    them keeps the three kinds it had."""
    later = "jit(train_step)/later_micro_batches/while/body/closed_call/jvp()/while/body/closed_call/dot_general"
    assert hlo.autodiff_pass(later) == hlo.LATER_FORWARD
    assert hlo.autodiff_pass(later.replace("/jvp()/", "/transpose(jvp())/")) == hlo.LATER_BACKWARD
    assert hlo.autodiff_pass("jit(train_step)/later_micro_batches/while/body/add") == hlo.OTHER
    assert hlo.autodiff_pass("jit(train_step)/jvp()/while/body/closed_call/dot_general") == hlo.FORWARD
    assert hlo.autodiff_pass("jit(f)/my_later_micro_batches_x/jvp()/dot") == hlo.FORWARD   # a whole scope only
    renamed = _HOST_CALL_HLO.replace('op_name="jit(train_step)/transpose(jvp())',
                                     'op_name="jit(train_step)/later_micro_batches/transpose(jvp())')
    passes = hlo.traffic_by_pass(renamed)
    assert set(passes) == {hlo.FORWARD, hlo.BACKWARD, hlo.OTHER, hlo.LATER_BACKWARD}
    assert passes[hlo.LATER_BACKWARD]["device_to_host_bytes"] > 0 == passes[hlo.BACKWARD]["device_to_host_bytes"]


def test_target_facts_match_their_hardware():
    h100 = targets.get_target("h100")
    assert 79e9 < h100.hbm_bytes < 86e9            # "80GB" as CUDA reports it
    assert h100.peak_bf16_flops == 989e12
    assert h100.sm_version == "sm_90a"
    assert targets.get_target("h200").hbm_bytes > 140e9
    assert targets.get_target("a100").sm_version == "sm_80"
    assert targets.get_target("b200").sm_version == "sm_100a"
    gh200 = targets.get_target("GH200")                 # alias, any case
    assert gh200.name == "gh200-96gb" and gh200.host_link_bytes_per_s > 5 * h100.host_link_bytes_per_s



def test_small_memory_ada_targets_carry_their_datasheet_facts():
    l4, l40s = targets.get_target("L4"), targets.get_target("l40s-48gb")
    assert 22 * 2**30 < l4.hbm_bytes < 24 * 2**30 and 44 * 2**30 < l40s.hbm_bytes < 48 * 2**30
    assert l4.peak_bf16_flops == 121e12 and l40s.peak_bf16_flops == 362e12   # dense, not the sparse figure
    assert l4.sm_version == l40s.sm_version == "sm_89"
    assert l4.host_link == l40s.host_link == "PCIe Gen4 x16"
    assert l4.host_link_bytes_per_s == targets.get_target("a100").host_link_bytes_per_s
    for target in (l4, l40s):
        text = target.target_config_text
        assert "threads_per_core_limit: 1536" in text and "minor: 9" in text
        assert "feature_extension: NONE" in text
        assert "no spec" in target.notes       # says what it approximates
    assert "threads_per_core_limit: 2048" in targets.get_target("h100").target_config_text
    assert targets.target_for_device_kind("NVIDIA L4").name == "l4"
    assert targets.target_for_device_kind("NVIDIA L40S").name == "l40s"   # not taken for L4

def test_target_config_text_carries_the_device_facts():
    text = targets.get_target("b200").target_config_text
    assert 'name: "NVIDIA B200"' in text
    assert "device_memory_size: 191514411008" in text
    assert "major: 10" in text and "ACCELERATED_FEATURES" in text
    assert "minor:" not in text.split("dnn_version_info")[0]   # minor 0 is the proto default


def test_unknown_target_names_the_known_ones():
    with pytest.raises(ValueError, match="h100.*h200|known targets"):
        targets.get_target("tpu-v5e")


def test_unsupported_target_says_why():
    with pytest.raises(ValueError, match="not supported: .*sm_70"):
        targets.get_target("v100")


def test_install_command_pins_both_wheels_to_jaxlib(monkeypatch, tmp_path):
    monkeypatch.setenv(plugin.PLUGIN_DIR_ENV, str(tmp_path / "gpu-plugin"))
    version = plugin.required_version()
    assert plugin.install_command() == [
        sys.executable, "-m", "pip", "install", "--no-deps", "--target",
        str(tmp_path / "gpu-plugin"),
        f"jax-cuda13-plugin=={version}", f"jax-cuda13-pjrt=={version}"]


def test_missing_plugin_reason_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv(plugin.PLUGIN_DIR_ENV, str(tmp_path / "empty"))
    assert plugin.installed_version() is None
    reason = plugin.plugin_missing_reason()
    assert reason is not None and "pip install --no-deps" in reason and "empty" in reason


def test_default_plugin_dir_is_inside_the_running_venv(monkeypatch, tmp_path):
    # One checkout, several venvs (make test / test-jax011 / test-newest), each
    # with its own jaxlib: each must get its own plugin folder.
    monkeypatch.delenv(plugin.PLUGIN_DIR_ENV, raising=False)
    for venv in ("venv-a", "venv-b"):
        monkeypatch.setattr(sys, "prefix", str(tmp_path / venv))
        assert plugin.plugin_dir() == tmp_path / venv / "spillway-gpu-plugin"


def test_default_plugin_dir_outside_a_venv_is_the_checkouts_venv(monkeypatch):
    monkeypatch.delenv(plugin.PLUGIN_DIR_ENV, raising=False)
    monkeypatch.setattr(sys, "prefix", sys.base_prefix)
    repo_root = Path(plugin.__file__).resolve().parents[2]
    assert plugin.plugin_dir() == repo_root / ".venv" / "spillway-gpu-plugin"


def test_install_never_replaces_a_folder_holding_other_files(monkeypatch, tmp_path):
    folder = tmp_path / "not-a-plugin"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    monkeypatch.setenv(plugin.PLUGIN_DIR_ENV, str(folder))
    with pytest.raises(plugin.PluginInstallError, match="refusing"):
        plugin.install()
    assert (folder / "notes.txt").read_text() == "keep me"


def test_runtime_device_kinds_map_to_targets():
    from spillway.recipes.targets import target_for_device_kind
    assert target_for_device_kind("NVIDIA H200").name == "h200"
    assert target_for_device_kind("NVIDIA GH200 480GB").name == "gh200-96gb"  # not taken for H200
    assert target_for_device_kind("NVIDIA A100-SXM4-80GB").peak_bf16_flops == 312e12
    assert target_for_device_kind("Tesla V100-SXM2-32GB") is None
