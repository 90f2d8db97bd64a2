"""The one prepared GPU benchmark: step time and measured peak HBM of real train steps, beside the
deviceless prediction for the same step (HBM, and the planner's step-time estimate). One call,
under 8 minutes on one H200, prints a table.

    python -m benchmarks.gpu_suite --predict      # here, on a CPU machine: deviceless HBM predictions
                                                  #   -> benchmarks/gpu_predictions.json (commit it)
    python -m benchmarks.gpu_suite                # on the GPU machine: measure every case, print the table

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

PREDICTIONS = Path(__file__).with_name("gpu_predictions.json")
SEQ_LEN = 8192

class Case(NamedTuple):
    recipe: str
    activations: str
    optimizer_state: str
    seq_len: int = SEQ_LEN
    overrides: tuple[str, ...] = ()


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
}
# Most time per case goes to compiling and to 8B host-state steps (seconds each).
CASE_TIMEOUT_S = 150.0
LARGE_PARAMS = 3e9   # above this, fewer steps are timed


def case_overrides(case: Case) -> list[str]:
    return [f"offload.activations={case.activations}", f"offload.optimizer_state={case.optimizer_state}",
            "train.global_batch=1", "train.grad_accum=1", f"data.seq_len={case.seq_len}",
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
    from spillway.recipes.train.step import setup

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
    batch = jax.device_put(tokens, s.batch_sharding)
    compiled = s.train_step.lower(s.params, opt_state, batch).compile()
    m = compiled.memory_analysis()
    compile_s = time.perf_counter() - t0
    params = s.params
    times = []
    for i in range(warmup + timed):
        start = time.perf_counter()
        params, opt_state, metrics = compiled(params, opt_state, batch)
        jax.block_until_ready((params, metrics))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    step_s = statistics.median(times)
    peak, _ = peak_flops_per_device()
    tokens_per_step = batch_size * seq_len
    flops = model_flops_per_token(recipe.decoder_spec(), seq_len) * tokens_per_step
    return {"case": name, "device": device.device_kind, "params": recipe.num_params(), "timed_steps": timed, "jax": jax.__version__,
            "compiled_hbm_bytes": m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes, "host_temp_bytes": m.host_temp_size_in_bytes,
            "peak_bytes_in_use": stats.get("peak_bytes_in_use"), "step_s": step_s,
            "tokens_per_s": tokens_per_step / step_s, "mfu": flops / step_s / peak, "compile_s": compile_s,
            "loss": float(metrics["loss"])}


def run_child(name: str, timeout_s: float, module: str = "benchmarks.gpu_suite") -> dict:
    """`python -m MODULE --child NAME` in its own process (its peak memory alone); its JSON line, or the error."""
    cmd = [sys.executable, "-m", module, "--child", name]
    # The allocator limits training sets (JAX's defaults, 75% of HBM and 64 GB of
    # pinned host memory, break plans the planner accepts), and full tracebacks.
    from spillway.recipes.train import gpu_allocators
    env = dict(os.environ, JAX_TRACEBACK_FILTERING="off")
    gpu_allocators.configure(env)
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


def predict() -> None:
    """Deviceless predictions (HBM bytes per case for one H200) from the planner's compile process."""
    from spillway.recipes.plan.commands import predict_cases
    cases = {name: (case.recipe, case_overrides(case)) for name, case in CASES.items()}
    PREDICTIONS.write_text(json.dumps(predict_cases(cases, gpu="h200"), indent=2, sort_keys=True))
    print(f"wrote {PREDICTIONS}")


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
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset")
    ap.add_argument("--out", help="also write the measured rows (JSON) here")
    ap.add_argument("--render", help="print the table of rows saved by --out, with today's predictions")
    args = ap.parse_args()
    predictions = json.loads(PREDICTIONS.read_text()) if PREDICTIONS.exists() else {}
    if args.render:
        print(render_table(json.loads(Path(args.render).read_text()), predictions))
        return 0
    if args.predict:
        predict()
        return 0
    if args.child:
        print(json.dumps(measure_case(args.child)), flush=True)
        return 0

    unknown = [name for name in args.cases.split(",") if name not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    start = time.perf_counter()
    rows = []
    for name in args.cases.split(","):
        left = args.budget_s - (time.perf_counter() - start)
        if left < 30:
            rows.append({"case": name, "error": "skipped (time budget)"})
            continue
        rows.append(run_child(name, timeout_s=min(left, CASE_TIMEOUT_S)))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if args.out:   # after every case: a run stopped from outside keeps what it measured
            Path(args.out).write_text(json.dumps(rows, indent=1))

    print(render_table(rows, predictions))
    print(f"total {time.perf_counter() - start:.0f}s; {os.uname().nodename}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
