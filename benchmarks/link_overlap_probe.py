#!/usr/bin/env python
"""Whether this machine's host copies overlap: each other (both link directions at once) and compute.

The planner prices the host link from two assumptions it cannot read from a deviceless compile: whether a
copy to pinned host memory and one from it run at once (GpuTarget.host_link_duplex), and whether a copy runs
beside a matmul that does not need it. The GPU suite of 2026-12-04 (BENCHMARKS.md) measured a streamed
update costing both directions' bytes added, with nothing hidden under compute. This probe separates the two
with the smallest programs that can show them, each jitted on its own, the copies written as the project's
layers write them (`jax.device_put(x, jax.memory.Space.Host | Device)` inside the jitted program):

    h2d          one array from pinned host memory into HBM
    d2h          one array from HBM into pinned host memory
    both         the two above in one program, independent of each other
    matmuls      a chain of bf16 matmuls in HBM
    matmuls+h2d  the chain and the h2d copy in one program, independent of each other
    matmuls+d2h  the same with the d2h copy
    streamed     the project's own streamed AdamW update (recipes/optim: state in pinned host memory, a layer
                 at a time through HBM, the two halves' copies scheduled in flight together) of a stack of
                 --stream-layers bf16 layers of --stream-d squared with float32 masters; against `device`,
                 the same update with the state in HBM, its link time is the difference, and its rate the
                 state's bytes both ways over that time

Printed: each program's median time of --repeats calls, the link rates, and two ratios: both / (h2d + d2h)
(1.0: the directions take turns; 0.5: fully at once) and matmuls+copy / (matmuls + copy) (1.0: nothing
overlaps; max(matmuls, copy) / sum: fully hidden). A ratio is what this jax and driver do with these
programs, not the hardware's limit.

Run:  python benchmarks/link_overlap_probe.py [--gib 2] [--repeats 5] [--stream-layers 16] [--out PATH]
      (on the CPU it runs too, as a smoke test: its figures mean nothing there)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def median_seconds(fn, args, repeats: int) -> float:
    """Median wall time of `fn(*args)` to completion, after one call that compiles and warms up."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def probe(gib: float, repeats: int, matmul_dim: int, matmul_count: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    device = jax.devices()[0]
    host_kind = "pinned_host" if "pinned_host" in {m.kind for m in device.addressable_memories()} else None
    if host_kind is None:
        raise SystemExit(f"{device.platform}: no pinned_host memory on this device; nothing to probe")
    host = jax.sharding.SingleDeviceSharding(device, memory_kind=host_kind)
    elements = int(gib * 2**30) // 4
    on_host = jax.device_put(np.ones(elements, np.float32), host)
    on_device = jax.device_put(np.ones(elements, np.float32), device)
    square = jax.device_put(jnp.ones((matmul_dim, matmul_dim), jnp.bfloat16) / matmul_dim, device)

    to_device = lambda x: jax.device_put(x, jax.memory.Space.Device)   # noqa: E731
    to_host = lambda x: jax.device_put(x, jax.memory.Space.Host)       # noqa: E731

    def matmuls(a):
        return jax.lax.fori_loop(0, matmul_count, lambda _, m: m @ a, a)

    programs = {
        "h2d": (jax.jit(to_device), (on_host,)),
        "d2h": (jax.jit(to_host), (on_device,)),
        "both": (jax.jit(lambda h, d: (to_device(h), to_host(d))), (on_host, on_device)),
        "matmuls": (jax.jit(matmuls), (square,)),
        "matmuls+h2d": (jax.jit(lambda a, h: (matmuls(a), to_device(h))), (square, on_host)),
        "matmuls+d2h": (jax.jit(lambda a, d: (matmuls(a), to_host(d))), (square, on_device)),
    }
    seconds = {name: median_seconds(fn, args, repeats) for name, (fn, args) in programs.items()}
    moved = elements * 4
    return {
        "platform": device.platform, "device": device.device_kind, "jax": jax.__version__, "bytes": moved,
        "seconds": seconds,
        "h2d_bytes_per_s": moved / seconds["h2d"], "d2h_bytes_per_s": moved / seconds["d2h"],
        "both_over_sum": seconds["both"] / (seconds["h2d"] + seconds["d2h"]),
        "matmuls_h2d_over_sum": seconds["matmuls+h2d"] / (seconds["matmuls"] + seconds["h2d"]),
        "matmuls_d2h_over_sum": seconds["matmuls+d2h"] / (seconds["matmuls"] + seconds["d2h"]),
        "h2d_hidden_bound": max(seconds["matmuls"], seconds["h2d"]) / (seconds["matmuls"] + seconds["h2d"]),
        "d2h_hidden_bound": max(seconds["matmuls"], seconds["d2h"]) / (seconds["matmuls"] + seconds["d2h"]),
    }


def streamed_update(layers: int, dim: int, repeats: int) -> dict:
    """The project's AdamW update of a `layers` x `dim` x `dim` bf16 stack with float32 masters, state on host
    (streamed) and in HBM: median seconds of each, and the state's bytes one way (masters and two moments)."""
    import jax
    import jax.numpy as jnp

    from spillway.recipes.optim.config import OptimizerConfig
    from spillway.recipes.optim.layouts import LeafLayout
    from spillway.recipes.optim.optimizer import Optimizer

    params = {"w": jnp.full((layers, dim, dim), 0.01, jnp.bfloat16)}
    grads = {"w": jnp.full((layers, dim, dim), 0.001, jnp.bfloat16)}
    seconds = {}
    for memory in ("device", "host"):
        opt = Optimizer(OptimizerConfig(master_weights=True, warmup_steps=0),
                        {"w": LeafLayout(stacked=True, state_memory=memory, decay=True, master=True)},
                        total_steps=repeats + 2)
        state = opt.init(params)
        step = jax.jit(opt.update)
        seconds[memory] = median_seconds(lambda: step(grads, state, params), (), repeats)
    state_bytes = layers * dim * dim * 12
    link = max(seconds["host"] - seconds["device"], 1e-9)
    return {"layers": layers, "dim": dim, "state_bytes": state_bytes, "seconds": seconds,
            "both_ways_bytes_per_s": 2 * state_bytes / link}


def summary(r: dict) -> str:
    s = r["seconds"]
    ms = "  ".join(f"{name} {t * 1e3:.1f} ms" for name, t in s.items())
    return (f"link probe ({r['device']}, jax {r['jax']}, {r['bytes'] / 2**30:.2f} GiB): {ms}\n"
            f"  h2d {r['h2d_bytes_per_s'] / 1e9:.1f} GB/s, d2h {r['d2h_bytes_per_s'] / 1e9:.1f} GB/s; "
            f"both / (h2d + d2h) = {r['both_over_sum']:.2f} (1.0 turns, 0.5 at once); "
            f"matmuls+h2d / sum = {r['matmuls_h2d_over_sum']:.2f} (hidden: {r['h2d_hidden_bound']:.2f}), "
            f"matmuls+d2h / sum = {r['matmuls_d2h_over_sum']:.2f} (hidden: {r['d2h_hidden_bound']:.2f})"
            + _streamed_line(r))


def _streamed_line(r: dict) -> str:
    u = r.get("streamed")
    if not u:
        return ""
    turns = u["state_bytes"] / r["h2d_bytes_per_s"] + u["state_bytes"] / r["d2h_bytes_per_s"]
    return (f"\n  streamed update ({u['layers']} x {u['dim']}^2, {u['state_bytes'] / 2**30:.2f} GiB of state): "
            f"{u['seconds']['host'] * 1e3:.1f} ms on host against {u['seconds']['device'] * 1e3:.1f} ms in HBM; "
            f"state both ways at {u['both_ways_bytes_per_s'] / 1e9:.1f} GB/s "
            f"(the directions taking turns at the rates above: {turns * 1e3:.1f} ms)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0, help="bytes per copy, GiB (default 2)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--matmul-dim", type=int, default=8192)
    ap.add_argument("--matmul-count", type=int, default=40,
                    help="matmuls in the chain (default 40: about 40 ms on an H200, the copies' order)")
    ap.add_argument("--stream-layers", type=int, default=16,
                    help="layers of the streamed update's stack (0: skip it; default 16 x 4096^2: 3 GiB of state)")
    ap.add_argument("--stream-d", type=int, default=4096)
    ap.add_argument("--out", help="also write the figures as JSON here")
    args = ap.parse_args()
    if not (args.gib > 0 and args.repeats > 0 and args.matmul_dim > 0 and args.matmul_count > 0):
        ap.error("--gib, --repeats, --matmul-dim and --matmul-count must be positive")
    if args.stream_layers < 0 or args.stream_d < 1:
        ap.error("--stream-layers must be 0 or more and --stream-d positive")
    result = probe(args.gib, args.repeats, args.matmul_dim, args.matmul_count)
    if args.stream_layers:
        result["streamed"] = streamed_update(args.stream_layers, args.stream_d, args.repeats)
    print(summary(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
