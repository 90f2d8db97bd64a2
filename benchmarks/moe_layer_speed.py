#!/usr/bin/env python
"""Tokens/s of one MoE layer per dispatch, beside a dense MLP of the same active FLOPs, timed on this backend.

The deviceless side (HBM, executed FLOPs) is benchmarks/moe_dispatch.py; this
is the GPU side it cannot give: wall time. One layer shaped like
Qwen3-30B-A3B's (d 2048, 128 experts, top-8, expert hidden 768; flags change
it), bfloat16, forward + backward (value_and_grad of a mean-square loss with
respect to the parameters and the input) jitted, warmed up once, then timed
`--repeats` times (median). Per row: ms, tokens/s, the TFLOP/s of the active
FLOPs (what a model's MFU counts), and the time relative to the dense MLP
(hidden top_k x expert_hidden, the same active FLOPs). A dispatch that runs out
of memory is a row saying so, not the end of the run (ragged_dot lowers for
GPUs as a dense masked product on jax 0.10.2: BENCHMARKS.md, "MoE dispatches").

    python benchmarks/moe_layer_speed.py                    # on the GPU machine (benchmarks/gpu_suite.py runs it)
    python benchmarks/moe_layer_speed.py --d-model 64 --experts 5 --top-k 2 --expert-hidden 32 --tokens 256
                                                            # a CPU-sized smoke run
    ... --json                                              # one JSON document on stdout
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

DISPATCHES = ("dropless", "dropless_blocked", "capacity")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--expert-hidden", type=int, default=768)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--dispatches", default=",".join(DISPATCHES))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    args.dispatches = args.dispatches.split(",")
    unknown = sorted(set(args.dispatches) - set(DISPATCHES))
    if unknown:
        p.error(f"unknown dispatch(es) {unknown}; known: {', '.join(DISPATCHES)}")
    if args.repeats < 1 or args.tokens < 1:
        p.error("--repeats and --tokens must be positive")
    return args


def _timed(module, x_btd, repeats: int) -> dict:
    """Median wall seconds of one jitted forward + backward of `module` on x_btd."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(module)

    @jax.jit
    def step(state, x_btd):
        def loss(state, x_btd):
            return jnp.mean(nnx.merge(graphdef, state)(x_btd).astype(jnp.float32) ** 2)
        return jax.value_and_grad(loss, argnums=(0, 1))(state, x_btd)

    jax.block_until_ready(step(state, x_btd))   # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(state, x_btd))
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "spread": (max(times) - min(times)) / statistics.median(times)}


def measure(argv: list[str]) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from spillway.layers.execution import Execution
    from spillway.layers.mlp import MLP
    from spillway.layers.moe import MoE, MoEConfig
    from spillway.layers.moe_flops import moe_layer_flops

    args = _parse(argv)
    seq = min(args.seq_len, args.tokens)
    batch = max(1, args.tokens // seq)
    tokens = batch * seq
    x_btd = jax.random.normal(jax.random.key(0), (batch, seq, args.d_model), jnp.bfloat16)
    bf16 = Execution(dtype="bfloat16", param_dtype="bfloat16")
    base = MoEConfig(d_model=args.d_model, num_experts=args.experts, top_k=args.top_k,
                     expert_hidden=args.expert_hidden, capacity_factor=args.capacity_factor, execution=bf16)
    dense_hidden = args.top_k * args.expert_hidden
    # fwd + bwd = 3 x the forward's matmul FLOPs; the dense MLP's three projections of [d, hidden]
    dense_forward = 2.0 * tokens * args.d_model * dense_hidden * 3
    rows = {}
    for dispatch in args.dispatches:
        cfg = dataclasses.replace(base, dispatch="dropless", grouped_matmul="blocked") \
            if dispatch == "dropless_blocked" else dataclasses.replace(base, dispatch=dispatch)
        active = moe_layer_flops(cfg, batch, seq).total
        try:
            timing = _timed(MoE(cfg, rngs=nnx.Rngs(0)), x_btd, args.repeats)
        except Exception as error:   # an out-of-memory dispatch is this row's result, not the run's end
            rows[dispatch] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
            continue
        rows[dispatch] = {**timing, "active_forward_flops": active}
    timing = _timed(MLP(args.d_model, dense_hidden, kind="swiglu", dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                        rngs=nnx.Rngs(0)), x_btd, args.repeats)
    rows[f"dense_mlp_{dense_hidden}"] = {**timing, "active_forward_flops": dense_forward}
    dense_s = rows[f"dense_mlp_{dense_hidden}"]["seconds"]
    for row in rows.values():
        if "seconds" in row:
            row.update(tokens_per_s=tokens / row["seconds"], vs_dense=row["seconds"] / dense_s,
                       active_tflops_per_s=3 * row["active_forward_flops"] / row["seconds"] / 1e12)
    return {"backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind), "tokens": tokens,
            "shape": {"d_model": args.d_model, "experts": args.experts, "top_k": args.top_k,
                      "expert_hidden": args.expert_hidden, "capacity_factor": args.capacity_factor},
            "rows": rows}


def render(result: dict) -> str:
    s = result["shape"]
    lines = [f"MoE layer d {s['d_model']}, top-{s['top_k']} of {s['experts']}, expert hidden {s['expert_hidden']}, "
             f"{result['tokens']} tokens, fwd+bwd, bf16, on {result['device']} ({result['backend']})",
             f"{'row':22s} {'ms':>9s} {'tokens/s':>11s} {'active TFLOP/s':>15s} {'vs dense':>9s}"]
    for name, row in result["rows"].items():
        if "error" in row:
            lines.append(f"{name:22s} {row['error']}")
            continue
        lines.append(f"{name:22s} {row['seconds'] * 1e3:9.2f} {row['tokens_per_s']:11.0f} "
                     f"{row['active_tflops_per_s']:15.2f} {row['vs_dense']:8.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    result = measure(argv)
    print(json.dumps(result) if "--json" in argv else render(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
