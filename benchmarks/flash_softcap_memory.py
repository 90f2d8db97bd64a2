#!/usr/bin/env python
"""Device memory of the flash kernel's forward + backward with and without soft-capping, compiled for a GPU.

Deviceless compile for a GPU target (default H200; docs/DESIGN.md section 5)
of one attention layer's forward and backward through layers/flash_attention.py,
the shape docs/DESIGN.md section 5 measures (8192 tokens, 32 query heads, 8 kv
heads, head_dim 128, bf16, blocks of 512), once per variant:

    plain           no cap, no window
    softcap         scores capped at 50 (Gemma 2's attn_logit_softcapping)
    softcap_window  capped, and a traced sliding window of 4096 (an int32 argument, as a
                    scanned stack of Gemma layers hands it over)
    static_window   no cap, a static window of 4096

Reports per variant the compiled program's temp HBM and its total HBM
(argument + output - alias + temp), and the compile seconds. The soft-cap adds
one block-sized fp32 temporary to each loop step, so its temp should equal the
plain kernel's within a few percent (tests/layers/test_flash_softcap_aot.py).

Run:  .venv/bin/python benchmarks/flash_softcap_memory.py [--target h200] [--tokens 8192] [--json]
      (--json: one JSON document on stdout, for tests; run it as a compile process)
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from spillway.recipes.plan.subprocess_runner import prepare_compile_process, serve_compile_process  # noqa: E402
from spillway.recipes.targets import DEFAULT_GPU

MiB = 2**20
VARIANTS = {"plain": dict(), "softcap": dict(softcap=50.0), "softcap_window": dict(softcap=50.0, traced_window=4096),
            "static_window": dict(sliding_window=4096)}


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmarks/flash_softcap_memory.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=DEFAULT_GPU)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block", type=int, default=512)
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


def compile_variants(args: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp

    from spillway.layers.flash_attention import flash_attention
    from spillway.recipes.plan.compile import abstract_array, compile_only_mesh, compile_report

    mesh = compile_only_mesh(args.target, {"data": 1})
    q = abstract_array((1, args.tokens, args.heads, args.head_dim), jnp.bfloat16, mesh)
    kv = abstract_array((1, args.tokens, args.kv_heads, args.head_dim), jnp.bfloat16, mesh)
    window_arg = abstract_array((), jnp.int32, mesh)
    rows = {}
    for name, variant in VARIANTS.items():
        def loss(q, k, v, window, variant=variant):
            window = window if "traced_window" in variant else variant.get("sliding_window")
            o = flash_attention(q, k, v, sliding_window=window, softcap=variant.get("softcap"),
                                block_q=args.block, block_k=args.block)
            return jnp.sum(o.astype(jnp.float32) ** 2)

        report = compile_report(jax.jit(jax.grad(loss, (0, 1, 2))), q, kv, kv, window_arg)
        rows[name] = {"temp_bytes": report.temp_bytes, "hbm_bytes": report.hbm_bytes,
                      "compile_seconds": round(report.compile_seconds, 2)}
    return {"target": args.target, "tokens": args.tokens, "heads": args.heads, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim, "block": args.block, "rows": rows}


def main(argv: list[str]) -> dict:
    return compile_variants(_parse_args(argv))


def _print_table(result: dict) -> None:
    print(f"flash attention forward + backward, {result['tokens']} tokens, {result['heads']}/{result['kv_heads']} "
          f"heads, head_dim {result['head_dim']}, bf16, blocks {result['block']}, target {result['target']}")
    print(f"{'variant':<16}{'temp MiB':>10}{'HBM MiB':>10}{'compile s':>11}")
    for name, row in result["rows"].items():
        print(f"{name:<16}{row['temp_bytes'] / MiB:>10.1f}{row['hbm_bytes'] / MiB:>10.1f}{row['compile_seconds']:>11.2f}")


if __name__ == "__main__":
    if "--json" in sys.argv[1:]:
        serve_compile_process(main)
    prepare_compile_process()
    _print_table(main(sys.argv[1:]))
