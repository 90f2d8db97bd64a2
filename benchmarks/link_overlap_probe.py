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

and, in loops of --rows rows (a stack of rows in pinned host memory, a row moved per iteration, as the
streamed update moves a layer's state), compiled with the train step's XLA settings and again with XLA's
command buffers (CUDA graphs) off:

    rows h2d / d2h / both         row i+1 of one host stack prefetched into HBM, the row held written into
                                  row i of another, or both (as the streamed update moves a layer's state)
    rows matmuls                  one bf16 matmul per iteration
    rows both+matmuls             both copies and the matmul in each iteration, independent of each other
    rows both (kernels)           both, the row index taken from a scan's xs: XLA then moves the rows with
                                  kernels reading pinned host memory, not memcpys (hlo.host_copy_engines)
    rows both+matmuls (kernels)

(the deviceless compile says which engine each program's rows use: "DMA" or "kernels"; the streamed
update's layer loop after the backward pass is the first form, its rows in the next forward pass the
second, docs/DESIGN.md section 6).

Printed: each program's median time of --repeats calls, the link rates, and two ratios: both / (h2d + d2h)
(1.0: the directions take turns; 0.5: fully at once) and matmuls+copy / (matmuls + copy) (1.0: nothing
overlaps; max(matmuls, copy) / sum: fully hidden). A ratio is what this jax and driver do with these
programs, not the hardware's limit.

Run:  python benchmarks/link_overlap_probe.py [--gib 2] [--repeats 5] [--stream-layers 16] [--rows 16]
      [--row-mib 64] [--out PATH]
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

    from spillway.recipes.optim.host_streaming import to_device, to_host   # the streamed update's own moves

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


def _threaded_seconds(fn, state: tuple, rest: tuple, repeats: int) -> tuple[float, tuple]:
    """(median wall time of `fn`, the state it leaves): `fn(*state, *rest)` donates `state` and returns its new
    value, and each call takes the previous call's (the host stacks are written in place, never copied)."""
    import jax

    state = jax.block_until_ready(fn(*state, *rest))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        state = jax.block_until_ready(fn(*state, *rest))
        times.append(time.perf_counter() - started)
    return statistics.median(times), tuple(state)


def row_programs(rows: int) -> dict:
    """The row loops (module docstring) as functions (source, sink, row, m, w) -> (source, sink, row, m), `rows`
    - 1 iterations: as the streamed update does, iteration i writes the row it holds into row i of `sink`
    and prefetches row i + 1 of `source` for the next iteration (neither copy waits on the other, nor on the
    matmul chain on `m`)."""
    import jax.numpy as jnp
    from jax import lax

    from spillway.recipes.optim.host_streaming import to_device, to_host   # the streamed update's own moves

    def iteration(i, state, w, read: bool, write: bool, matmul: bool):
        source, sink, row, m = state
        if write:
            sink = lax.dynamic_update_slice_in_dim(sink, to_host(row * 0.5), i, axis=0)
        if read:
            row = to_device(lax.dynamic_slice_in_dim(source, i + 1, 1, axis=0))
        if matmul:
            m = jnp.tanh(m @ w)
        return source, sink, row, m

    def program(read: bool, write: bool, matmul: bool, kernels: bool = False):
        def run(source, sink, row, m, w):
            state = (source, sink, row, m)
            if kernels:   # the row index from xs: not the loop counter, so XLA cannot address it as a memcpy
                step = lambda c, i: (iteration(i, c, w, read, write, matmul), None)   # noqa: E731
                return lax.scan(step, state, jnp.arange(rows - 1))[0]
            return lax.fori_loop(0, rows - 1, lambda i, c: iteration(i, c, w, read, write, matmul), state)
        return run

    return {
        "rows h2d": program(True, False, False), "rows d2h": program(False, True, False),
        "rows both": program(True, True, False), "rows matmuls": program(False, False, True),
        "rows both+matmuls": program(True, True, True),
        "rows both (kernels)": program(True, True, False, kernels=True),
        "rows both+matmuls (kernels)": program(True, True, True, kernels=True),
    }


def row_loops(rows: int, row_mib: float, repeats: int, matmul_dim: int) -> dict:
    """Rows moved in loops (module docstring): median seconds per program, per compile setting; and which
    engine the compiled program moves its rows with (hlo.host_copy_engines)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from spillway.recipes.plan import hlo
    from spillway.recipes.train.xla_settings import COMMAND_BUFFER_ALTERNATIVES, step_compiler_options

    device = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    width = max(1, int(row_mib * 2**20) // 4)

    # One set of buffers for every program (each donates them and returns them written in place).
    state = (jax.device_put(np.ones((rows, width), np.float32), host),
             jax.device_put(np.zeros((rows, width), np.float32), host),
             jax.device_put(np.zeros((1, width), np.float32), device),
             jax.device_put(jnp.ones((matmul_dim, matmul_dim), jnp.bfloat16), device))
    weight = jax.device_put(jnp.full((matmul_dim, matmul_dim), 1.0 / matmul_dim, jnp.bfloat16), device)
    programs = row_programs(rows)
    gpu = device.platform in ("gpu", "cuda")
    base = step_compiler_options("cuda") if gpu else None
    # The step's settings, then each command-buffer alternative on top (recipes/train/xla_settings.py; GPU
    # compiler options, so on a CPU every row compiles as the first).
    settings = {"step settings": base, **{name: {**(base or {}), **extra} if gpu else None
                                          for name, extra in COMMAND_BUFFER_ALTERNATIVES.items()}}
    seconds: dict[str, dict[str, float]] = {}
    engines: dict[str, str] = {}
    for setting, options in settings.items():
        seconds[setting] = {}
        for name, fn in programs.items():
            compiled = jax.jit(fn, donate_argnums=(0, 1, 2, 3)).lower(*state, weight).compile(compiler_options=options)
            moved = hlo.host_copy_engines(compiled.as_text())
            if moved.dma_bytes + moved.kernel_bytes:
                engines[name] = "kernels" if moved.kernel_bytes > moved.dma_bytes else "DMA"
            seconds[setting][name], state = _threaded_seconds(compiled, state, (weight,), repeats)
    return {"rows": rows, "row_bytes": width * 4, "matmul_dim": matmul_dim, "seconds": seconds,
            "engines": engines}


def row_loop_lines(u: dict) -> str:
    """The row loops' figures: each setting's times and the two ratios for the memcpy and the kernel form."""
    lines = [f"\n  row loops ({u['rows']} rows of {u['row_bytes'] / 2**20:.3g} MiB; rows moved by "
             + ", ".join(f"{name}: {engine}" for name, engine in u["engines"].items()) + ")"]
    for setting, s in u["seconds"].items():
        ms = "  ".join(f"{name.removeprefix('rows ')} {t * 1e3:.1f}" for name, t in s.items())
        both = s["rows both"] / (s["rows h2d"] + s["rows d2h"])
        hidden = s["rows both+matmuls"] / (s["rows both"] + s["rows matmuls"])
        hidden_k = s["rows both+matmuls (kernels)"] / (s["rows both (kernels)"] + s["rows matmuls"])
        lines.append(f"    {setting}: {ms} ms; both / (h2d + d2h) = {both:.2f}; both+matmuls / sum = {hidden:.2f} "
                     f"(kernels: {hidden_k:.2f})")
    return "\n".join(lines)


def summary(r: dict) -> str:
    s = r["seconds"]
    ms = "  ".join(f"{name} {t * 1e3:.1f} ms" for name, t in s.items())
    return (f"link probe ({r['device']}, jax {r['jax']}, {r['bytes'] / 2**30:.2f} GiB): {ms}\n"
            f"  h2d {r['h2d_bytes_per_s'] / 1e9:.1f} GB/s, d2h {r['d2h_bytes_per_s'] / 1e9:.1f} GB/s; "
            f"both / (h2d + d2h) = {r['both_over_sum']:.2f} (1.0 turns, 0.5 at once); "
            f"matmuls+h2d / sum = {r['matmuls_h2d_over_sum']:.2f} (hidden: {r['h2d_hidden_bound']:.2f}), "
            f"matmuls+d2h / sum = {r['matmuls_d2h_over_sum']:.2f} (hidden: {r['d2h_hidden_bound']:.2f})"
            + _streamed_line(r) + (row_loop_lines(r["row_loops"]) if r.get("row_loops") else ""))


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
    ap.add_argument("--rows", type=int, default=16, help="rows in the row loops (0: skip them; default 16)")
    ap.add_argument("--row-mib", type=float, default=64.0, help="MiB per row in the row loops (default 64)")
    ap.add_argument("--out", help="also write the figures as JSON here")
    args = ap.parse_args()
    if not (args.gib > 0 and args.repeats > 0 and args.matmul_dim > 0 and args.matmul_count > 0):
        ap.error("--gib, --repeats, --matmul-dim and --matmul-count must be positive")
    if args.stream_layers < 0 or args.stream_d < 1:
        ap.error("--stream-layers must be 0 or more and --stream-d positive")
    if args.rows < 0 or args.row_mib <= 0:
        ap.error("--rows must be 0 or more and --row-mib positive")
    result = probe(args.gib, args.repeats, args.matmul_dim, args.matmul_count)
    if args.stream_layers:
        result["streamed"] = streamed_update(args.stream_layers, args.stream_d, args.repeats)
    if args.rows:
        result["row_loops"] = row_loops(args.rows, args.row_mib, args.repeats, args.matmul_dim)
    print(summary(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
