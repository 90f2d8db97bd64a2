"""The one prepared GPU benchmark: step time and measured peak HBM of real train steps, beside the
deviceless prediction for the same step (HBM, and the planner's step-time estimate). One call,
under 8 minutes on one H200, prints a table.

    python -m benchmarks.gpu_suite --predict      # here, on a CPU machine: deviceless HBM predictions
                                                  #   -> benchmarks/gpu_predictions.json (commit it)
    python -m benchmarks.gpu_suite --dry-run      # here: what a GPU call would run, its predictions, its skips
    python -m benchmarks.gpu_suite                # on the GPU machine: measure the default cases, print the table

Before any case starts, each is judged deviceless against the GPU machine (one H200, 128 GiB of host RAM,
16 cores): the planner's predicted HBM against 0.9 x HBM, the host peak of the phases the suite runs
(state creation and the step; recipes/train/host_memory.py) against the RAM; a case that would not fit
is skipped with the reason. Per case it records peak HBM, the process's resident peak (VmHWM) and, where
the runtime reports it, its pinned host peak, step time, tokens/s and MFU. The default cases are the
headline: host against device optimizer state at the same global batch with 8 micro-batches (1B, 3B),
the update in the next forward pass against after the backward pass (1B, 3B; with the pending
gradients in host memory and, last, in HBM), and the 8B step with
cuDNN attention (its MFU). With the time left, the call ends with one MoE layer shaped like
Qwen3-30B-A3B's timed per dispatch beside a dense MLP of the same active FLOPs
(benchmarks/moe_layer_speed.py; --no-moe-layer skips it), then one checkpoint save (in pieces) and restore of
Llama 3.2 1B's host-resident state, their VmHWM beside the prediction (benchmarks/checkpoint_host_peak.py;
--no-checkpoint skips it).

Each case runs in its own child process, so each peak is that case's alone
(`memory_stats()["peak_bytes_in_use"]` cannot be reset). A case that runs out of
memory is reported as OOM, not as a failure of the suite. Cases stop being
started once the time budget is spent, and say so. Tokens are random: the
GPU machine has no `datasets`, and data does not change step time or memory.

Cases, in the order they run (most wanted first, so a short session still
gets them): Llama 3.2 1B and Llama 3.1 8B train steps at batch 1, sequence
8192, bf16 weights with fp32 master state, flash attention, under several
activation plans, with the optimizer state on device and in pinned host
memory (the step-time overhead of host-resident state is the ratio of those
two rows); then one row per other family at its published size (GPT-2 124M at
1024 tokens, its position limit; Qwen3 0.6B; Qwen2.5 1.5B; Mistral 7B),
recompute_all on device beside the plan `spillway plan` picks for one H200.

    python -m benchmarks.gpu_suite --out rows.json     # also keep the measured rows
    python -m benchmarks.gpu_suite --render rows.json  # the table again, with today's predictions
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from spillway.recipes.targets import DEFAULT_GPU

PREDICTIONS = Path(__file__).with_name("gpu_predictions.json")
SEQ_LEN = 8192

class Case(NamedTuple):
    recipe: str
    activations: str
    optimizer_state: str
    seq_len: int = SEQ_LEN
    overrides: tuple[str, ...] = ()
    global_batch: int = 1
    grad_accum: int = 1
    update: str = "after_backward"     # offload.update
    xla_flags: tuple[str, ...] = ()    # XLA_FLAGS for the case's process (its every compile), on top of the step's


CUDNN = ("execution.attention_impl=cudnn",)
# Llama 3.2 3B's shape (Meta's config: 28 layers of 3072, 24 heads, 8 KV heads, MLP 8192), on the 1B recipe.
LLAMA_3B = ("model.d_model=3072", "model.num_layers=28", "model.num_heads=24", "model.num_kv_heads=8",
            "model.mlp_hidden=8192")
PENDING_IN_HBM = "offload.pending_gradients=device"   # next_forward's pending gradients in HBM
BF16_MOMENTS = ("optimizer.moment_dtype=bfloat16",)   # AdamW's moments stored in bfloat16 (8 bytes a parameter)
# XLA's command buffers (CUDA graphs) chain the host copies they capture (docs/DESIGN.md section 6): the cases
# named after an alternative of recipes/train/xla_settings.py run their process with it as XLA_FLAGS.
COMMAND_BUFFER_CASES = {"concurrent_command_buffers": "command buffers concurrent",
                        "memcpys_outside_command_buffers": "memcpys outside command buffers",
                        "no_command_buffers": "command buffers off"}


def command_buffer_flags(case_suffix: str) -> tuple[str, ...]:
    from spillway.recipes.train.xla_settings import COMMAND_BUFFER_ALTERNATIVES, as_xla_flags
    return as_xla_flags(COMMAND_BUFFER_ALTERNATIVES[COMMAND_BUFFER_CASES[case_suffix]])


CASES = {
    "1b/recompute_all/device": Case("llama3_1b", "recompute_all", "device"),
    "1b/recompute_all/host": Case("llama3_1b", "recompute_all", "host"),
    "8b/recompute_all/host": Case("llama3_8b", "recompute_all", "host"),
    # block weights in pinned host memory too, streamed a layer at a time (offload.params)
    "1b/recompute_all/host_params": Case("llama3_1b", "recompute_all", "host", overrides=("offload.params=host",)),
    "gpt2_124m/recompute_all/device": Case("gpt2_124m", "recompute_all", "device", 1024),
    "gpt2_124m/save_dots/device": Case("gpt2_124m", "save_dots", "device", 1024),
    "qwen3_0_6b/recompute_all/device": Case("qwen3_0_6b", "recompute_all", "device"),
    "qwen3_0_6b/save_dots/device": Case("qwen3_0_6b", "save_dots", "device"),
    "1b/offload_dots/device": Case("llama3_1b", "offload_dots", "device"),
    "1b/save_all/device": Case("llama3_1b", "save_all", "device"),
    "8b/offload_dots/host": Case("llama3_8b", "offload_dots", "host"),
    "8b/recompute_all/device": Case("llama3_8b", "recompute_all", "device"),
    "qwen2_5_1_5b/recompute_all/device": Case("qwen2_5_1_5b", "recompute_all", "device"),
    "mistral_7b/recompute_all/host": Case("mistral_7b", "recompute_all", "host"),
    # cuDNN's fused attention beside the recipes' blockwise JAX one (layers/flash_attention.py)
    "1b/recompute_all/device/cudnn": Case("llama3_1b", "recompute_all", "device",
                                          overrides=("execution.attention_impl=cudnn",)),
    "8b/recompute_all/host/cudnn": Case("llama3_8b", "recompute_all", "host",
                                        overrides=("execution.attention_impl=cudnn",)),
    # The headline: host state against device state at the same global batch, 8 micro-batches of 8192
    # tokens (the update's link time spread over 8 forward and backward passes), and the update in the
    # next forward pass against after the backward pass at one batch per step; cuDNN attention.
    "1b/recompute_all/device/cudnn/ga8": Case("llama3_1b", "recompute_all", "device", overrides=CUDNN,
                                              global_batch=8, grad_accum=8),
    "1b/recompute_all/host/cudnn/ga8": Case("llama3_1b", "recompute_all", "host", overrides=CUDNN,
                                            global_batch=8, grad_accum=8),
    "3b/recompute_all/device/cudnn/ga8": Case("llama3_1b", "recompute_all", "device", overrides=CUDNN + LLAMA_3B,
                                              global_batch=8, grad_accum=8),
    "3b/recompute_all/host/cudnn/ga8": Case("llama3_1b", "recompute_all", "host", overrides=CUDNN + LLAMA_3B,
                                            global_batch=8, grad_accum=8),
    "3b/recompute_all/host/cudnn": Case("llama3_1b", "recompute_all", "host", overrides=CUDNN + LLAMA_3B),
    "3b/recompute_all/host_in_fwd/cudnn": Case("llama3_1b", "recompute_all", "host", overrides=CUDNN + LLAMA_3B,
                                               update="next_forward"),
    # Part of the state on host (offload.optimizer_state=host:N, the last N block layers'; issue 29): beside
    # the device and host rows above at the same batch. The counts are half the layers, chosen by hand: the
    # planner's picks for these shapes were not computed when the cases were added (BENCHMARKS.md says which).
    "1b/recompute_all/split/cudnn/ga8": Case("llama3_1b", "recompute_all", "host:8", overrides=CUDNN,
                                             global_batch=8, grad_accum=8),
    "3b/recompute_all/split/cudnn/ga8": Case("llama3_1b", "recompute_all", "host:14", overrides=CUDNN + LLAMA_3B,
                                             global_batch=8, grad_accum=8),
    "8b/recompute_all/split/cudnn": Case("llama3_8b", "recompute_all", "host:16", overrides=CUDNN),
    # The planner's picks under an HBM budget that refuses every device-state plan (1B: 24 GiB, 3B: 60 GiB;
    # BENCHMARKS.md "under an HBM budget"), beside the device-state pick without a budget (save_dots): the
    # issue's comparison, measured where the split's cost is the link's.
    "1b/save_dots/device/cudnn/ga8": Case("llama3_1b", "save_dots", "device", overrides=CUDNN,
                                          global_batch=8, grad_accum=8),
    "1b/save_dots/split_pick/cudnn/ga8": Case("llama3_1b", "save_dots", "host:12", overrides=CUDNN,
                                              global_batch=8, grad_accum=8),
    # The 1B's pick under the same 24 GiB budget once the planner priced the link's directions taking turns
    # (BENCHMARKS.md 2026-12-04): the first 8 layers' dots offloaded, the rest recomputed, 3 layers' state on host.
    "1b/offload_dots8+recompute_all/split_pick/cudnn/ga8": Case(
        "llama3_1b", "offload_dots:8,recompute_all", "host:3", overrides=CUDNN, global_batch=8, grad_accum=8),
    "3b/save_dots/device/cudnn/ga8": Case("llama3_1b", "save_dots", "device", overrides=CUDNN + LLAMA_3B,
                                          global_batch=8, grad_accum=8),
    # The 8B's pick at 8 micro-batches without a budget (`spillway plan llama3_8b_offload --set
    # train.global_batch=8 --set train.grad_accum=8`, 2026-12-02): every device-state plan is over HBM.
    "8b/save_qkv_offload_mlp/split_pick/cudnn/ga8": Case("llama3_8b", "save_qkv_offload_mlp", "host:14",
                                                         overrides=CUDNN, global_batch=8, grad_accum=8),
    "3b/save_qkv_offload_mlp/split_pick/cudnn/ga8": Case("llama3_1b", "save_qkv_offload_mlp", "host:8",
                                                         overrides=CUDNN + LLAMA_3B, global_batch=8, grad_accum=8),
    "1b/recompute_all/host/cudnn": Case("llama3_1b", "recompute_all", "host", overrides=CUDNN),
    "1b/recompute_all/host_in_fwd/cudnn": Case("llama3_1b", "recompute_all", "host", overrides=CUDNN,
                                               update="next_forward"),
    # The same with the pending gradients in HBM (offload.pending_gradients=device): host memory the state
    # alone, about the HBM of the update after the backward pass, no gradient over the link.
    "3b/recompute_all/host_in_fwd_hbm/cudnn": Case("llama3_1b", "recompute_all", "host",
                                                   overrides=CUDNN + LLAMA_3B + (PENDING_IN_HBM,),
                                                   update="next_forward"),
    "1b/recompute_all/host_in_fwd_hbm/cudnn": Case("llama3_1b", "recompute_all", "host",
                                                   overrides=CUDNN + (PENDING_IN_HBM,), update="next_forward"),
    # The update in the next forward pass at 8 micro-batches (the first one's forward pass takes it; the
    # running sum, and so the pending gradients, in HBM), beside the ga8 device and host rows above; then the
    # three with bfloat16 moments (a third less state over the link).
    "1b/recompute_all/host_in_fwd_hbm/cudnn/ga8": Case("llama3_1b", "recompute_all", "host",
                                                       overrides=CUDNN + (PENDING_IN_HBM,), global_batch=8,
                                                       grad_accum=8, update="next_forward"),
    "3b/recompute_all/host_in_fwd_hbm/cudnn/ga8": Case("llama3_1b", "recompute_all", "host",
                                                       overrides=CUDNN + LLAMA_3B + (PENDING_IN_HBM,),
                                                       global_batch=8, grad_accum=8, update="next_forward"),
    **{f"{size}/recompute_all/{placement}/cudnn/ga8/bf16_moments": Case(
        "llama3_1b", "recompute_all", state, overrides=CUDNN + shape + BF16_MOMENTS + pending, global_batch=8,
        grad_accum=8, update=update)
       for size, shape in (("1b", ()), ("3b", LLAMA_3B))
       for placement, state, pending, update in (("device", "device", (), "after_backward"),
                                                 ("host", "host", (), "after_backward"),
                                                 ("host_in_fwd_hbm", "host", (PENDING_IN_HBM,), "next_forward"))},
    # The same update in the next forward pass with every block layer's state on host and the non-stacked
    # leaves' (the tied embedding, final norm) in HBM (offload.optimizer_state=host:L): their update before
    # the forward pass then moves nothing over the link. Float32 and bfloat16 moments.
    **{f"{size}/recompute_all/host_layers_in_fwd_hbm/cudnn/ga8{suffix}": Case(
        "llama3_1b", "recompute_all", f"host:{layers}", overrides=CUDNN + shape + moments + (PENDING_IN_HBM,),
        global_batch=8, grad_accum=8, update="next_forward")
       for size, shape, layers in (("1b", (), 16), ("3b", LLAMA_3B, 28))
       for suffix, moments in (("", ()), ("/bf16_moments", BF16_MOMENTS))},
    # Part of the block layers' state on host and the update in the next forward pass (issue 29): the
    # resident layers' update from their HBM state, the host layers' streamed beside the forward pass; the
    # same split counts as the split rows above, pending gradients in HBM.
    **{f"{size}/recompute_all/split_in_fwd_hbm/cudnn/ga8": Case(
        "llama3_1b", "recompute_all", f"host:{layers}", overrides=CUDNN + shape + (PENDING_IN_HBM,),
        global_batch=8, grad_accum=8, update="next_forward")
       for size, shape, layers in (("1b", (), 8), ("3b", LLAMA_3B, 14))},
    # The headline rows again under each command-buffer alternative (the device rows too: their ratios are
    # the ones read).
    **{f"1b/recompute_all/{placement}/cudnn/ga8/{graphs}": Case(
        "llama3_1b", "recompute_all", state, overrides=CUDNN + pending, global_batch=8, grad_accum=8,
        update=update, xla_flags=flags)
       for graphs, flags in ((suffix, command_buffer_flags(suffix)) for suffix in COMMAND_BUFFER_CASES)
       for placement, state, pending, update in (("device", "device", (), "after_backward"),
                                                 ("host", "host", (), "after_backward"),
                                                 ("host_layers_in_fwd_hbm", "host:16", (PENDING_IN_HBM,),
                                                  "next_forward"))},
}
# What one call measures by default (under 8 minutes on one H200; `--cases all` runs every case). The budget
# (--budget-s) stops starting cases once spent, so the order is what matters most first: the 1B's device and
# host rows at 8 micro-batches, then the same under each command-buffer alternative (whether the CUDA graphs
# keep the streamed copies in turns: the 2026-12-04 rows hid nothing); then the planner's budget picks (never measured);
# then the update in the next forward pass (issues 27 and 29: host:L, the split, every leaf's state on host)
# beside the after-backward rows, for the 1B then the 3B; then the bfloat16 moments, the 8B, and the rows an
# earlier GPU call measured.
DEFAULT_CASES = ("1b/recompute_all/device/cudnn/ga8", "1b/recompute_all/host/cudnn/ga8",
                 *(f"1b/recompute_all/{placement}/cudnn/ga8/{graphs}"
                   for graphs in ("concurrent_command_buffers", "memcpys_outside_command_buffers",
                                  "no_command_buffers")
                   for placement in ("host", "device")),
                 *(f"1b/recompute_all/host_layers_in_fwd_hbm/cudnn/ga8/{graphs}"
                   for graphs in ("concurrent_command_buffers", "memcpys_outside_command_buffers",
                                  "no_command_buffers")),
                 "1b/save_dots/device/cudnn/ga8", "1b/offload_dots8+recompute_all/split_pick/cudnn/ga8",
                 "3b/save_dots/device/cudnn/ga8", "3b/save_qkv_offload_mlp/split_pick/cudnn/ga8",
                 "1b/recompute_all/host_layers_in_fwd_hbm/cudnn/ga8", "1b/recompute_all/split_in_fwd_hbm/cudnn/ga8",
                 "1b/recompute_all/host_in_fwd_hbm/cudnn/ga8", "1b/recompute_all/split/cudnn/ga8",
                 "3b/recompute_all/device/cudnn/ga8", "3b/recompute_all/host/cudnn/ga8",
                 "3b/recompute_all/host_layers_in_fwd_hbm/cudnn/ga8", "3b/recompute_all/split_in_fwd_hbm/cudnn/ga8",
                 "3b/recompute_all/host_in_fwd_hbm/cudnn/ga8", "3b/recompute_all/split/cudnn/ga8",
                 *(f"{size}/recompute_all/{placement}/cudnn/ga8/bf16_moments" for size in ("1b", "3b")
                   for placement in ("device", "host_layers_in_fwd_hbm", "host", "host_in_fwd_hbm")),
                 "8b/recompute_all/host/cudnn", "8b/save_qkv_offload_mlp/split_pick/cudnn/ga8",
                 "3b/recompute_all/host/cudnn", "3b/recompute_all/host_in_fwd/cudnn",
                 "1b/recompute_all/host/cudnn", "1b/recompute_all/host_in_fwd/cudnn",
                 "3b/recompute_all/host_in_fwd_hbm/cudnn", "1b/recompute_all/host_in_fwd_hbm/cudnn")
# The GPU machine: one H200, 128 GiB of host RAM, 16 cores.
HOST_RAM_BYTES = 128 * 2**30
GPU_TARGET = DEFAULT_GPU
# Most time per case goes to compiling and to 8B host-state steps (seconds each).
CASE_TIMEOUT_S = 150.0
LARGE_PARAMS = 3e9   # above this, fewer steps are timed


def case_overrides(case: Case) -> list[str]:
    return [f"offload.activations={case.activations}", f"offload.optimizer_state={case.optimizer_state}",
            f"offload.update={case.update}", f"train.global_batch={case.global_batch}",
            f"train.grad_accum={case.grad_accum}", f"data.seq_len={case.seq_len}",
            f"model.max_seq_len={case.seq_len}", "mesh.fsdp=-1", *case.overrides]


def measure_case(name: str, warmup: int | None = None, timed: int | None = None, *, case: Case | None = None,
                 extra_overrides: tuple[str, ...] = ()) -> dict:
    """Child process: build, compile, run `timed` steps; step time and peak bytes.

    `case` replaces CASES[name], and `extra_overrides` change the step: for the CPU smoke test
    (tests/recipes/test_gpu_suite_smoke.py) that keeps this script from
    failing for the first time on a GPU.
    """
    import jax
    import numpy as np

    from spillway.recipes.train.metrics import peak_flops_per_device
    from spillway.recipes.registry import get_recipe
    from spillway.models.flops import model_flops_per_token
    from spillway.recipes.train.batch import Batch
    from spillway.recipes.train.step import setup

    from benchmarks.resident_peak import ResidentPeak

    resident = ResidentPeak()   # started first: where /proc keeps no VmHWM it samples from here on
    case = case or CASES[name]
    seq_len = case.seq_len
    recipe = get_recipe(case.recipe, case_overrides(case) + list(extra_overrides))
    large = recipe.num_params() > LARGE_PARAMS
    warmup = warmup if warmup is not None else (1 if large else 2)
    timed = timed if timed is not None else (3 if large else 5)
    batch_size = recipe.train.global_batch
    t0 = time.perf_counter()
    s = setup(recipe)
    opt_state = jax.jit(s.optimizer.init, out_shardings=s.opt_state_shardings)(s.params)
    tokens = np.random.default_rng(0).integers(0, recipe.model.vocab_size, (batch_size, seq_len + 1),
                                                dtype=np.int32)
    batch = Batch(tokens=jax.device_put(tokens, s.batch_sharding))
    pending = s.nothing_pending(s.params)   # None unless the step defers its update: one signature either way
    compiled = s.train_step.lower(s.params, opt_state, pending, batch).compile()
    m = compiled.memory_analysis()
    compile_s = time.perf_counter() - t0
    params = s.params
    times = []
    for i in range(warmup + timed):
        start = time.perf_counter()
        params, opt_state, pending, metrics = compiled(params, opt_state, pending, batch)
        jax.block_until_ready((params, metrics))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    host_memory = _host_memory_now(device, resident)
    step_s = statistics.median(times)
    peak, _ = peak_flops_per_device()
    tokens_per_step = batch_size * seq_len
    flops = model_flops_per_token(recipe.decoder_spec(), seq_len) * tokens_per_step
    return {"case": name, "device": device.device_kind, "params": recipe.num_params(), "timed_steps": timed, "jax": jax.__version__,
            "compiled_hbm_bytes": m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes, "host_temp_bytes": m.host_temp_size_in_bytes,
            "peak_bytes_in_use": stats.get("peak_bytes_in_use"), "step_s": step_s,
            "tokens_per_s": tokens_per_step / step_s, "mfu": flops / step_s / peak, "compile_s": compile_s,
            "loss": float(metrics["loss"]), **host_memory}


def _host_memory_now(device, resident) -> dict:
    """The process's resident high-water mark (benchmarks/resident_peak.py: VmHWM where /proc keeps it) and,
    where the runtime reports it, its pinned host bytes."""
    resident_row = {"host_resident_peak_bytes": resident.peak(), "host_resident_peak_source": resident.source}
    pinned = None
    for memory in getattr(device, "addressable_memories", lambda: [])():
        if memory.kind == "pinned_host" and hasattr(memory, "memory_stats"):
            stats = memory.memory_stats() or {}
            pinned = stats.get("peak_bytes_in_use", stats.get("bytes_in_use"))
    return {**resident_row, "host_pinned_peak_bytes": pinned}


def run_child(name: str, timeout_s: float, module: str = "benchmarks.gpu_suite") -> dict:
    """`python -m MODULE --child NAME` in its own process (its peak memory alone); its JSON line, or the error."""
    cmd = [sys.executable, "-m", module, "--child", name]
    # The allocator limits training sets (JAX's defaults, 75% of HBM and 64 GB of
    # pinned host memory, break plans the planner accepts), and full tracebacks.
    from spillway.recipes.train import gpu_allocators
    env = dict(os.environ, JAX_TRACEBACK_FILTERING="off")
    gpu_allocators.configure(env)
    flags = CASES[name].xla_flags if name in CASES else ()
    if flags:
        env["XLA_FLAGS"] = " ".join((env.get("XLA_FLAGS", ""), *flags)).strip()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                             cwd=Path(__file__).resolve().parents[1], env=env)
    except subprocess.TimeoutExpired:
        return {"case": name, "error": f"timeout after {timeout_s:.0f}s"}
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if out.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = out.stderr[-4000:]
    kind = "OOM" if "RESOURCE_EXHAUSTED" in tail or "Out of memory" in tail else "error"
    # The exception's own line (the last one), and the frames above it for the record.
    lines = [line for line in tail.splitlines() if "stack_frame_id" not in line]
    return {"case": name, "error": kind, "detail": lines[-1] if lines else "", "traceback": "\n".join(lines[-30:])}


def predict(names: list[str]) -> None:
    """Deviceless predictions (HBM bytes per case for one H200) from the planner's compile process; the
    cases named are (re)written, the others kept."""
    from spillway.recipes.plan.commands import predict_cases
    cases = {name: (CASES[name].recipe, case_overrides(CASES[name])) for name in names}
    kept = json.loads(PREDICTIONS.read_text()) if PREDICTIONS.exists() else {}
    kept.update(predict_cases(cases, gpu=GPU_TARGET))
    PREDICTIONS.write_text(json.dumps(kept, indent=2, sort_keys=True))
    print(f"wrote {PREDICTIONS}")


def host_fit(phases: dict[str, int], host_ram_bytes: int = HOST_RAM_BYTES,
             judged: tuple[str, ...] = ("state creation", "step")) -> tuple[str, int, str]:
    """(the phase of the host peak among `judged`, its bytes, why it does not fit the RAM or ""): the one host
    check of the GPU machine's cases (fit_case) and of benchmarks/recipe_picks.py's."""
    phase, peak = max(((p, phases[p]) for p in judged), key=lambda item: item[1])
    why = f"host {peak / 2**30:.1f} GiB at {phase} > {host_ram_bytes / 2**30:.1f} GiB" if peak > host_ram_bytes else ""
    return phase, peak, why


def fit_case(name: str, prediction: dict, host_ram_bytes: int = HOST_RAM_BYTES, case: Case | None = None) -> dict:
    """Whether a case fits the GPU machine, deviceless: the planner's predicted HBM against its limit (0.9 x
    the H200's), and the host peak of the phases the suite runs (state creation and the step: it saves no
    checkpoint; recipes/train/host_memory.py) against the host's RAM. Run with JAX on the CPU."""
    import jax

    from spillway.layers.mesh import MeshConfig
    from spillway.layers.sharding import make_mesh
    from spillway.recipes.targets import get_target
    from spillway.recipes.registry import get_recipe
    from spillway.recipes.train.host_memory import phases_of
    from spillway.recipes.train.step import abstract_setup

    case = case or CASES[name]
    recipe = get_recipe(case.recipe, case_overrides(case))
    s = abstract_setup(recipe, make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1]), platform="cuda")
    phases = phases_of(s, step_host=prediction.get("host_bytes"), gpu=True, per_device=True).by_phase()
    phase, host_peak, host_reason = host_fit(phases, host_ram_bytes)
    hbm_limit = 0.9 * get_target(GPU_TARGET).hbm_bytes
    reasons = []
    hbm = prediction.get("hbm_bytes")
    if hbm is not None and hbm > hbm_limit:
        reasons.append(f"HBM {hbm / 2**30:.1f} > {hbm_limit / 2**30:.1f} GiB")
    if host_reason:
        reasons.append(host_reason)
    return {"case": name, "fits": not reasons, "why_not": "; ".join(reasons), "hbm_bytes": hbm,
            "host_peak_bytes": host_peak, "host_phase": phase, "predicted_step_s": prediction.get("step_s"),
            "tokens_per_step": case.global_batch * case.seq_len,
            "note": "" if hbm is not None else "no deviceless HBM prediction (run --predict)"}


def fit_cases(names: list[str], predictions: dict, host_ram_bytes: int = HOST_RAM_BYTES) -> dict:
    """fit_case for each name, in a child process with JAX on the CPU (the parent must not take the GPU)."""
    cmd = [sys.executable, "-m", "benchmarks.gpu_suite", "--fits", ",".join(names),
           "--host-ram-gib", str(host_ram_bytes / 2**30)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], env=env,
                         timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"the deviceless fit check failed: {out.stderr[-2000:]}")
    return json.loads(lines[-1])


def dry_run_table(fits: dict) -> str:
    """What a GPU call would run, with the deviceless predictions, and what it would skip and why."""
    gib = 2**30
    lines = [f"{'case':38s} {'pred HBM':>9s} {'host peak':>18s} {'pred ms':>8s} {'pred tok/s':>10s}  run?"]
    for name, f in fits.items():
        step = f.get("predicted_step_s")
        hbm = f.get("hbm_bytes")
        tokens_per_s = f"{f['tokens_per_step'] / step:.0f}" if step else "-"
        lines.append(f"{name:38s} {'-' if hbm is None else f'{hbm / gib:.2f}G':>9s} "
                     f"{f['host_peak_bytes'] / gib:8.1f}G {f['host_phase']:>9s} "
                     f"{'-' if step is None else f'{step * 1e3:.1f}':>8s} "
                     f"{tokens_per_s:>10s}  "
                     f"{'yes' if f['fits'] else 'skip: ' + f['why_not']}{'; ' + f['note'] if f['note'] else ''}")
    return "\n".join(lines)


def render_table(rows: list[dict], predictions: dict) -> str:
    """The printed table: measured beside predicted, per case, and the host-state overhead."""
    gib = 2**30
    lines = [f"\n{'case':34s} {'predicted HBM':>13s} {'GPU-compiled':>12s} {'measured peak':>13s} "
             f"{'peak/pred':>9s} {'step ms':>8s} {'pred ms':>8s} {'tok/s':>8s} {'MFU':>6s}"]
    for r in rows:
        pred = predictions.get(r["case"], {}).get("hbm_bytes")
        pred_step = predictions.get(r["case"], {}).get("step_s") or float("nan")
        if "error" in r:
            lines.append(f"{r['case']:34s} {(pred or 0) / gib:12.2f}G  {r['error']} {r.get('detail', '')[:80]}")
            continue
        peak = r["peak_bytes_in_use"]
        ratio = peak / pred if pred and peak else float("nan")
        lines.append(f"{r['case']:34s} {(pred or float('nan')) / gib:12.2f}G {r['compiled_hbm_bytes'] / gib:11.2f}G "
                     f"{(peak or float('nan')) / gib:12.2f}G {ratio:9.3f} {r['step_s'] * 1e3:8.1f} "
                     f"{pred_step * 1e3:8.1f} {r['tokens_per_s']:8.0f} {r['mfu']:6.1%}")
    by_case = {r["case"]: r for r in rows if "error" not in r}
    for size in ("1b", "8b"):
        dev, host = by_case.get(f"{size}/recompute_all/device"), by_case.get(f"{size}/recompute_all/host")
        if dev and host:
            lines.append(f"{size}: host-resident optimizer state step time overhead: "
                         f"{host['step_s'] / dev['step_s']:.3f}x")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--predict", action="store_true", help="deviceless predictions (CPU machine)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting cases after this long")
    ap.add_argument("--cases", default="default",
                    help="comma-separated cases, 'default' (the headline set, one call) or 'all'")
    ap.add_argument("--out", help="also write the measured rows (JSON) here")
    ap.add_argument("--render", help="print the table of rows saved by --out, with today's predictions")
    ap.add_argument("--dry-run", action="store_true",
                    help="print what a GPU call would run, its deviceless predictions and what it would skip")
    ap.add_argument("--host-ram-gib", type=float, default=HOST_RAM_BYTES / 2**30,
                    help="host RAM of the GPU machine (default: 128)")
    ap.add_argument("--fits", help=argparse.SUPPRESS)
    ap.add_argument("--no-moe-layer", dest="moe_layer", action="store_false",
                    help="skip the MoE layer timing per dispatch at the end (benchmarks/moe_layer_speed.py)")
    ap.add_argument("--no-checkpoint", dest="checkpoint", action="store_false",
                    help="skip the host peak of a checkpoint save and restore of host state at the end "
                         "(benchmarks/checkpoint_host_peak.py)")
    args = ap.parse_args()
    predictions = json.loads(PREDICTIONS.read_text()) if PREDICTIONS.exists() else {}
    if args.render:
        print(render_table(json.loads(Path(args.render).read_text()), predictions))
        return 0
    if args.child:
        print(json.dumps(measure_case(args.child)), flush=True)
        return 0
    if args.fits:
        ram = int(args.host_ram_gib * 2**30)
        print(json.dumps({n: fit_case(n, predictions.get(n, {}), ram) for n in args.fits.split(",")}), flush=True)
        return 0

    names = list(CASES) if args.cases == "all" else list(DEFAULT_CASES) if args.cases == "default" \
        else args.cases.split(",")
    unknown = [name for name in names if name not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    if not args.host_ram_gib > 0:
        ap.error(f"--host-ram-gib must be positive, got {args.host_ram_gib}")
    if args.predict:
        predict(names)
        return 0
    # Deviceless, before any case starts: the cases that would not fit this machine are skipped, with why.
    fits = fit_cases(names, predictions, int(args.host_ram_gib * 2**30))
    if args.dry_run:
        print(dry_run_table(fits))
        return 0
    start = time.perf_counter()
    rows = []
    for name in names:
        if not fits[name]["fits"]:
            rows.append({"case": name, "error": f"skipped: does not fit ({fits[name]['why_not']})"})
            continue
        left = args.budget_s - (time.perf_counter() - start)
        if left < 30:
            rows.append({"case": name, "error": "skipped (time budget)"})
            continue
        rows.append(run_child(name, timeout_s=min(left, CASE_TIMEOUT_S)))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if args.out:   # after every case: a run stopped from outside keeps what it measured
            Path(args.out).write_text(json.dumps(rows, indent=1))

    print(render_table(rows, predictions))
    left = args.budget_s - (time.perf_counter() - start)
    if args.moe_layer and left >= 60:
        print(moe_layer_speed(timeout_s=min(left, MOE_LAYER_TIMEOUT_S)))
    elif args.moe_layer:
        print("MoE layer speed: skipped (time budget)")
    left = args.budget_s - (time.perf_counter() - start)
    if args.checkpoint and left >= 60:
        print(checkpoint_host_peak(timeout_s=min(left, CHECKPOINT_TIMEOUT_S)))
    elif args.checkpoint:
        print("checkpoint host peak: skipped (time budget)")
    print(f"total {time.perf_counter() - start:.0f}s; {os.uname().nodename}")
    return 0


MOE_LAYER_TIMEOUT_S = 180


def _in_own_process(what: str, cmd: list[str], timeout_s: float) -> str:
    """`cmd` run from the repository root in its own process: its output, or one line on why there is none."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                             cwd=Path(__file__).resolve().parents[1])
    except subprocess.TimeoutExpired:
        return f"{what}: timeout after {timeout_s:.0f}s"
    if out.returncode != 0:
        last = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode
        return f"{what}: failed: {last}"
    return out.stdout.rstrip()


def moe_layer_speed(timeout_s: float) -> str:
    """benchmarks/moe_layer_speed.py in its own process (a dispatch's out-of-memory stays in it): its table,
    or why there is none."""
    return _in_own_process("MoE layer speed", [sys.executable, str(Path(__file__).with_name("moe_layer_speed.py"))],
                           timeout_s)


CHECKPOINT_TIMEOUT_S = 240


def checkpoint_host_peak(timeout_s: float) -> str:
    """benchmarks/checkpoint_host_peak.py in its own process (its VmHWM is that case's alone): its line, or
    why there is none."""
    return _in_own_process("checkpoint host peak",
                           [sys.executable, "-m", "benchmarks.checkpoint_host_peak", "--mode", "pieces"], timeout_s)


if __name__ == "__main__":
    sys.exit(main())
