#!/usr/bin/env python
"""How fast this machine's CPU runs the optimizer update (`update_on_host`), in parameters per second per core.

The planner's host-update plans (optimizer state in pinned host memory,
updated by the host CPU: OptimizerConfig.update_on_host) cost the host CPU's
time. This script times that update, the optimizer's own code (AdamW with
clipping, fp32 state, bf16 parameters with an fp32 master copy unless
--no-master), on a stack of layers on this machine's CPU, and writes

    {"params_per_s_per_core": ..., "cores": ..., "params_per_s": ..., ...}

to a small JSON file that `spillway plan` reads (recipes/plan/host_update.py;
`--host-update-rate` overrides it). Run it on the machine that will train:
the rate is the host's, memory bandwidth bound, and differs a lot between
machines. Per core: parameters per CPU-second this process spent (all its
threads), so a machine shared with other work still gives its cores' rate;
the wall-clock rate is recorded beside it. The planner multiplies the
per-core rate by the host cores it assumes per GPU.

Run:  .venv/bin/python benchmarks/host_update_rate.py [--layers 8] [--d-model 1024] [--d-ff 4096]
      [--steps 5] [--no-master] [--out PATH]   (default PATH: recipes/plan/host_update.py's)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def measure(layers: int, d_model: int, d_ff: int, steps: int, master: bool) -> dict:
    import jax
    import jax.numpy as jnp

    from spillway.recipes.optim.config import OptimizerConfig
    from spillway.recipes.optim.layouts import LeafLayout
    from spillway.recipes.optim.optimizer import Optimizer

    dtype = jnp.bfloat16 if master else jnp.float32
    cfg = OptimizerConfig(update_on_host=True, master_weights=master, warmup_steps=0)  # the rate ignores the schedule
    opt = Optimizer(cfg, {"w": LeafLayout(stacked=True, state_memory="host", decay=True, master=master)},
                    total_steps=steps + 1)
    params = {"w": (0.02 * jax.random.normal(jax.random.key(0), (layers, d_model, d_ff))).astype(dtype)}
    grads = {"w": (0.01 * jax.random.normal(jax.random.key(1), (layers, d_model, d_ff))).astype(dtype)}
    state = opt.init(params)
    step = jax.jit(opt.update)
    params, state, _ = step(grads, state, params)       # compile and warm up
    jax.block_until_ready((params, state))
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(steps):
        params, state, _ = step(grads, state, params)
    jax.block_until_ready((params, state))
    seconds = (time.perf_counter() - started) / steps
    cpu_seconds = (time.process_time() - cpu_started) / steps   # all of this process's threads
    n = layers * d_model * d_ff
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # Per core from CPU time, not wall time: on a machine shared with other
    # work the wall clock counts their time too; CPU seconds count ours.
    return {"params_per_s_per_core": n / cpu_seconds, "params_per_s": n / seconds, "cores": cores,
            "seconds_per_update": seconds, "cpu_seconds_per_update": cpu_seconds, "params": n,
            "master_weights": master,
            "backend": jax.default_backend(), "jax": jax.__version__, "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(),
            "measured": datetime.date.today().isoformat()}


def main(argv: list[str]) -> None:
    from spillway.recipes.plan.host_update import DEFAULT_RATE_FILE

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--d-ff", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-master", action="store_true", help="fp32 parameters, no master copy")
    parser.add_argument("--out", default=str(DEFAULT_RATE_FILE))
    args = parser.parse_args(argv)
    if min(args.layers, args.d_model, args.d_ff, args.steps) < 1:
        parser.error("--layers, --d-model, --d-ff and --steps must be positive")
    result = measure(args.layers, args.d_model, args.d_ff, args.steps, not args.no_master)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"host update: {result['params'] / 1e6:.1f} M params in {result['seconds_per_update'] * 1e3:.0f} ms "
          f"on {result['cores']} core(s) ({result['backend']}, jax {result['jax']}): "
          f"{result['params_per_s'] / 1e6:.0f} M params/s wall clock, "
          f"{result['params_per_s_per_core'] / 1e6:.1f} M params per CPU-second "
          f"({result['cpu_seconds_per_update']:.2f} CPU-s per update) -> {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
