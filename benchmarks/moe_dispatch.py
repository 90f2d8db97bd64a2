#!/usr/bin/env python
"""HBM of MoE layers compiled for a GPU without one (default H200; docs/DESIGN.md section 5), per dispatch.

Two checks, each forward + backward (value_and_grad of a mean-square loss with
respect to the parameters and the input), bfloat16 parameters and compute:

    layer   one MoE layer shaped like Qwen3-30B-A3B's (d 2048, 128 experts, top-8, expert
            hidden 768; --tokens tokens as one sequence per 4096) with each dispatch,
            beside a dense gated MLP of the same active FLOPs (hidden 8 x 768): HBM,
            temp, the largest device arrays, the FLOPs each executes, and the time
            they take at the target's peak bf16 rate (a lower bound: no GPU was timed)
    ragged_dot  `jax.lax.ragged_dot` alone at the layer's shapes (tokens x 8 copies of d 2048 times
            128 experts' [2048, 768]): temp and the largest array of its forward, input-gradient
            and weight-gradient products, to see where the GPU lowering's memory goes
    stack   a small scanned stack of MoE blocks (layers/moe_block.py) under MoE offload
            presets, each dispatch: HBM and the host buffers and bytes each preset moves
            (tests/layers/test_moe_aot.py asserts the expert-activation offload shows up)

Run:  .venv/bin/python benchmarks/moe_dispatch.py [--target h200] [--checks layer,stack,ragged_dot]
      [--tokens 8192] [--dispatches dropless,dropless_blocked,capacity] [--stack-presets A,B]
      [--json]   one JSON document on stdout, for tests (run it as a compile process)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from spillway.recipes.plan.subprocess_runner import prepare_compile_process, serve_compile_process  # noqa: E402
from spillway.recipes.targets import DEFAULT_GPU

MiB = 2**20
CHECKS = ("layer", "stack", "ragged_dot")
STACK_PRESETS = ("recompute_all", "moe_save_dots", "moe_offload_experts", "moe_offload_dots")


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=DEFAULT_GPU)
    parser.add_argument("--checks", default=",".join(CHECKS))
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of the layer check")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (a capacity group)")
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--stack-layers", type=int, default=4)
    parser.add_argument("--stack-tokens", type=int, default=1024)
    parser.add_argument("--stack-presets", default=",".join(STACK_PRESETS))
    parser.add_argument("--dispatches", default="dropless,dropless_blocked,capacity",
                        help="dropless (ragged_dot), dropless_blocked (layers/grouped_matmul.py), capacity")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.stack_presets = [p.strip() for p in args.stack_presets.split(",") if p.strip()]
    args.dispatches = [d.strip() for d in args.dispatches.split(",") if d.strip()]
    args.checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = sorted(set(args.checks) - set(CHECKS))
    if unknown:
        parser.error(f"unknown checks {unknown}; choose from {CHECKS}")
    if args.tokens % args.seq_len and args.tokens > args.seq_len:
        parser.error(f"--tokens ({args.tokens}) must be a multiple of --seq-len ({args.seq_len})")
    return args


def _moe_variant(cfg, dispatch: str):
    """cfg with the dispatch a row names; "dropless_blocked" is dropless by the blocked grouped matmul."""
    if dispatch == "dropless_blocked":
        return dataclasses.replace(cfg, dispatch="dropless", grouped_matmul="blocked")
    return dataclasses.replace(cfg, dispatch=dispatch)


def _compile(fn, state, x_btd, mesh):
    """CompileReport (as a dict) and the five largest device arrays of value_and_grad(fn) on `mesh`."""
    import jax

    from spillway.recipes.plan import compile as aot
    from spillway.recipes.plan import hlo

    step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
    report = aot.compile_report(step, aot.on_compile_mesh(state, mesh), aot.on_compile_mesh(x_btd, mesh),
                                keep_hlo_text=True)
    largest = [dataclasses.asdict(a) for a in hlo.largest_device_arrays(report.hlo_text, 5)]
    return {"report": report.to_dict(), "largest_device_arrays": largest}


def _layer_rows(args, mesh, target) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from spillway.layers.execution import Execution
    from spillway.layers.mlp import MLP
    from spillway.layers.moe import MoE, MoEConfig
    from spillway.layers.moe_flops import moe_layer_flops

    bf16 = Execution(dtype="bfloat16", param_dtype="bfloat16")
    seq = min(args.seq_len, args.tokens)
    batch = args.tokens // seq
    x_btd = jax.ShapeDtypeStruct((batch, seq, 2048), jnp.bfloat16)
    base = MoEConfig(d_model=2048, num_experts=128, top_k=8, expert_hidden=768, renormalize=True,
                     capacity_factor=args.capacity_factor, execution=bf16)
    rows = {}

    def loss(graphdef):
        def fn(state, x_btd):
            out = nnx.merge(graphdef, state)(x_btd)
            return jnp.mean(out.astype(jnp.float32) ** 2)
        return fn

    for dispatch in args.dispatches:
        cfg = _moe_variant(base, dispatch)
        graphdef, state = nnx.split(nnx.eval_shape(lambda: MoE(cfg, rngs=nnx.Rngs(0))))
        row = _compile(loss(graphdef), state, x_btd, mesh)
        active = moe_layer_flops(cfg, batch, seq).total
        executed = moe_layer_flops(cfg, batch, seq, counted="executed").total
        row.update(active_forward_flops=active, executed_forward_flops=executed,
                   peak_seconds=3 * executed / target.peak_bf16_flops)
        rows[dispatch] = row
    dense_hidden = base.top_k * base.expert_hidden
    graphdef, state = nnx.split(nnx.eval_shape(lambda: MLP(2048, dense_hidden, kind="swiglu", dtype=jnp.bfloat16,
                                                           param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))
    row = _compile(loss(graphdef), state, x_btd, mesh)
    dense_flops = 2.0 * args.tokens * 2048 * dense_hidden * 3
    row.update(active_forward_flops=dense_flops, executed_forward_flops=dense_flops,
               peak_seconds=3 * dense_flops / target.peak_bf16_flops)
    rows[f"dense_mlp_{dense_hidden}"] = row
    return {"tokens": args.tokens, "seq_len": seq, "capacity_factor": args.capacity_factor, "rows": rows}


def _ragged_dot_rows(args, mesh) -> dict:
    import jax
    import jax.numpy as jnp

    from spillway.recipes.plan import compile as aot
    from spillway.recipes.plan import hlo

    experts, rows, d, f = 128, args.tokens * 8, 2048, 768
    x_md = aot.abstract_array((rows, d), jnp.bfloat16, mesh)
    w_edf = aot.abstract_array((experts, d, f), jnp.bfloat16, mesh)
    sizes = aot.abstract_array((experts,), jnp.int32, mesh)
    dy_mf = aot.abstract_array((rows, f), jnp.bfloat16, mesh)
    products = {
        "forward": (lambda x, w, g: jax.lax.ragged_dot(x, w, g), (x_md, w_edf, sizes)),
        "input_gradient": (lambda x, w, g, dy: jax.vjp(lambda x: jax.lax.ragged_dot(x, w, g), x)[1](dy)[0],
                           (x_md, w_edf, sizes, dy_mf)),
        "weight_gradient": (lambda x, w, g, dy: jax.vjp(lambda w: jax.lax.ragged_dot(x, w, g), w)[1](dy)[0],
                            (x_md, w_edf, sizes, dy_mf)),
    }
    out = {}
    for name, (fn, arguments) in products.items():
        report = aot.compile_report(jax.jit(fn), *arguments, keep_hlo_text=True)
        largest = hlo.largest_device_arrays(report.hlo_text, 1)[0]
        out[name] = {"temp_bytes": report.temp_bytes, "largest_device_arrays": [dataclasses.asdict(largest)]}
    return {"rows": rows, "experts": experts, "products": out}


def _stack_rows(args, mesh) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from spillway.layers.block import BlockConfig, BlockContext
    from spillway.layers.execution import Execution
    from spillway.layers.moe import MoEConfig
    from spillway.layers.moe_block import moe_block
    from spillway.layers.stack import BlockStack

    bf16 = Execution(dtype="bfloat16", param_dtype="bfloat16")
    d = 512
    block = BlockConfig(d_model=d, num_heads=8, num_kv_heads=2, mlp_hidden=1024, execution=bf16)
    seq = min(args.stack_tokens, 512)
    x_btd = jax.ShapeDtypeStruct((args.stack_tokens // seq, seq, d), jnp.bfloat16)
    rows = {}
    for dispatch in args.dispatches:
        moe = _moe_variant(MoEConfig(d_model=d, num_experts=8, top_k=2, expert_hidden=512, capacity_factor=1.25,
                                     execution=bf16), dispatch)
        for preset in args.stack_presets:
            stack = nnx.eval_shape(lambda: BlockStack(block, args.stack_layers, block_cls=moe_block(moe),
                                                      remat=preset, rngs=nnx.Rngs(0)))
            graphdef, state = nnx.split(stack)

            def fn(state, x_btd, graphdef=graphdef):
                ctx = BlockContext(jnp.arange(x_btd.shape[1])[None])
                out = nnx.merge(graphdef, state)(x_btd, ctx)[0]
                return jnp.mean(out.astype(jnp.float32) ** 2)
            rows[f"{dispatch}/{preset}"] = _compile(fn, state, x_btd, mesh)
    # What offloading the expert activations should move a layer: the dispatched tokens, the gate and up
    # projections and the expert output, d + f + f + d bf16 values per token copy the experts compute
    # (dropless: tokens x k copies; capacity: every slot, groups x experts x capacity).
    from spillway.layers.moe_dispatch import expert_capacity
    copies = {"dropless": args.stack_tokens * 2, "dropless_blocked": args.stack_tokens * 2,
              "capacity": x_btd.shape[0] * 8 * expert_capacity(seq, 8, 2, 1.25)}
    return {"layers": args.stack_layers, "tokens": args.stack_tokens, "rows": rows,
            "expert_activation_bytes_per_layer": {k: n * (d + 512 + 512 + d) * 2 for k, n in copies.items()}}


def measure(argv: list[str]) -> dict:
    args = _parse(argv)
    prepare_compile_process()

    from spillway.recipes.plan import compile as aot
    from spillway.recipes.targets import get_target

    mesh = aot.compile_only_mesh(args.target, {"data": 1})
    result = {"target": args.target}
    if "layer" in args.checks:
        result["layer"] = _layer_rows(args, mesh, get_target(args.target))
    if "stack" in args.checks:
        result["stack"] = _stack_rows(args, mesh)
    if "ragged_dot" in args.checks:
        result["ragged_dot"] = _ragged_dot_rows(args, mesh)
    return result


def print_tables(result: dict) -> None:
    if "ragged_dot" in result:
        rd = result["ragged_dot"]
        print(f"jax.lax.ragged_dot of [{rd['rows']}, 2048] bf16 rows by {rd['experts']} experts' [2048, 768], "
              f"{result['target']} (deviceless)")
        for name, row in rd["products"].items():
            big = row["largest_device_arrays"][0]
            print(f"  {name:<16} temp {row['temp_bytes'] / MiB:>8.0f} MiB   largest {big['opcode']} "
                  f"{'x'.join(map(str, big['dims']))} {big['nbytes'] / MiB:.0f} MiB")
        print()
    if "layer" in result:
        layer = result["layer"]
        print(f"One Qwen3-MoE-shaped layer (d 2048, 128 experts, top-8, hidden 768), {layer['tokens']} tokens "
              f"({layer['seq_len']} a sequence), bf16, forward + backward, {result['target']} (deviceless); "
              f"capacity factor {layer['capacity_factor']}")
        print(f"{'row':<22}{'HBM MiB':>10}{'temp MiB':>10}{'largest array (opcode, dims, MiB)':>44}"
              f"{'fwd TFLOP':>11}{'3x fwd at peak ms':>19}")
        for name, row in layer["rows"].items():
            r, big = row["report"], row["largest_device_arrays"][0]
            print(f"{name:<22}{r['hbm_bytes'] / MiB:>10.0f}{r['temp_bytes'] / MiB:>10.0f}"
                  f"{' '.join([big['opcode'], 'x'.join(map(str, big['dims'])), format(big['nbytes'] / MiB, '.0f')]):>44}"
                  f"{row['executed_forward_flops'] / 1e12:>11.3f}{row['peak_seconds'] * 1e3:>19.2f}")
    if "stack" in result:
        stack = result["stack"]
        print(f"\nScanned stack of {stack['layers']} MoE blocks (d 512, 8 experts, top-2, hidden 512), "
              f"{stack['tokens']} tokens, bf16, forward + backward")
        print(f"{'dispatch/preset':<38}{'HBM MiB':>9}{'host MiB':>10}{'host bufs':>10}{'to host MiB':>13}")
        for name, row in stack["rows"].items():
            r = row["report"]
            print(f"{name:<38}{r['hbm_bytes'] / MiB:>9.1f}{r['host_bytes'] / MiB:>10.1f}{r['host_buffer_count']:>10}"
                  f"{r['device_to_host_bytes'] / MiB:>13.1f}")


if __name__ == "__main__":
    if "--json" in sys.argv[1:]:
        serve_compile_process(measure)
    else:
        print_tables(measure(sys.argv[1:]))
