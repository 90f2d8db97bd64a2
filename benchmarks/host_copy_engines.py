#!/usr/bin/env python
"""Which host-row moves in a loop XLA's GPU compiler makes DMA memcpys, and which kernels: by the row's offset.

The streamed optimizer update moves a layer's state rows between pinned host memory and HBM inside loops
(recipes/optim/host_streaming.py, recipes/optim/update_in_forward.py). XLA turns each dynamic-slice of a
host buffer, and each dynamic-update-slice into one, into an async fusion, and then either addresses it as
"byte offset + loop iteration x byte stride" and issues a memcpy (a copy engine moves the row), or runs it
as a kernel whose threads read or write host memory over PCIe (it takes SMs, like compute). Which one
depends on the row's offset; this compiles one small loop per offset form, deviceless for a GPU target,
and reads the answer from the compiled program (recipes/plan/hlo.py host_copy_engines):

    fori i / i                   fori_loop counter: read row i, write row i
    fori i+1 / i                 read the next row, write this one (the streamed update's prefetch)
    fori min(i+1,L-1) / max(i-1,0)  clamped offsets (the update in the next forward pass, before a fix)
    scan xs / xs                 the index from a scan's xs (jnp.arange): not the loop's counter
    scan carried counter         a counter carried through a scan from 0 by 1
    fori 2i / 2i+1               an offset with a stride the loop does not step by one row (mod L)

Each loop has L-1 iterations over a stack of L rows, a row in and a row out per iteration, beside a
matmul. Printed: MiB moved by memcpys and by kernels per form; then the same for the GPU link probe's row
loops (benchmarks/link_overlap_probe.py row_programs, L rows), with the MiB the schedule moves in both
directions at once and beside a matmul (memcpys only: hlo.host_copies_beside_compute counts no kernel
there), the premise of what the probe times.

Run:  .venv/bin/python benchmarks/host_copy_engines.py [--target h200] [--layers 8] [--width 1024]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from spillway.recipes.plan.subprocess_runner import served_or_measured  # noqa: E402
from spillway.recipes.targets import DEFAULT_GPU  # noqa: E402

MiB = 2**20
FORMS = ("fori i / i", "fori i+1 / i", "fori min(i+1,L-1) / max(i-1,0)", "scan xs / xs", "scan carried counter",
         "fori 2i / 2i+1")


def loop_program(form: str, layers: int):
    """(host stack, weight, activations) -> (host stack, activations): L-1 iterations, each reading one row
    of the host stack into HBM and writing one back, at the offsets of `form`."""
    import jax.numpy as jnp
    from jax import lax

    from spillway.recipes.optim.host_streaming import to_device, to_host   # the streamed update's own moves
    offsets = {
        "fori i / i": (lambda i: i, lambda i: i),
        "fori i+1 / i": (lambda i: i + 1, lambda i: i),
        "fori min(i+1,L-1) / max(i-1,0)": (lambda i: jnp.minimum(i + 1, layers - 1), lambda i: jnp.maximum(i - 1, 0)),
        "scan xs / xs": (lambda i: i, lambda i: i),
        "scan carried counter": (lambda i: i, lambda i: i),
        "fori 2i / 2i+1": (lambda i: 2 * i % layers, lambda i: (2 * i + 1) % layers),
    }
    read_at, write_at = offsets[form]

    def iteration(i, stack, w, a):
        row = to_device(lax.dynamic_index_in_dim(stack, read_at(i), keepdims=True))
        stack = lax.dynamic_update_index_in_dim(stack, to_host(row * 0.9 + 1.0), write_at(i), 0)
        return stack, jnp.tanh(a @ w)

    def program(stack, w, a):
        if form == "scan xs / xs":
            return lax.scan(lambda c, i: (iteration(i, *c[:1], w, c[1]), None), (stack, a),
                            jnp.arange(layers - 1))[0]
        if form == "scan carried counter":
            def step(c, _):
                stack, a, i = c
                stack, a = iteration(i, stack, w, a)
                return (stack, a, i + 1), None
            return lax.scan(step, (stack, a, jnp.int32(0)), None, length=layers - 1)[0][:2]
        return lax.fori_loop(0, layers - 1, lambda i, c: iteration(i, c[0], w, c[1]), (stack, a))
    return program


def measure(args) -> dict:
    import jax
    import jax.numpy as jnp

    from spillway.recipes.plan import compile as aot
    from spillway.recipes.plan import hlo
    from spillway.recipes.train.xla_settings import step_compiler_options

    mesh = aot.compile_only_mesh(args.target, {"data": 1})
    stack = aot.abstract_array((args.layers, args.width, args.width), jnp.float32, mesh, memory_kind="pinned_host")
    weight = aot.abstract_array((args.width, args.width), jnp.bfloat16, mesh)
    rows = {}
    for form in FORMS:
        compiled = jax.jit(loop_program(form, args.layers), donate_argnums=0).lower(stack, weight, weight) \
            .compile(compiler_options=step_compiler_options("cuda"))
        engines = hlo.host_copy_engines(compiled.as_text())
        rows[form] = {"dma_bytes": engines.dma_bytes, "kernel_bytes": engines.kernel_bytes}
    # The GPU link probe's row loops (benchmarks/link_overlap_probe.py), compiled the same way: which engine
    # each moves its rows with, and whether the schedule has the two directions and the matmuls beside them.
    from benchmarks.link_overlap_probe import row_programs

    row_stack = aot.abstract_array((args.layers, args.width * args.width), jnp.float32, mesh,
                                   memory_kind="pinned_host")
    row = aot.abstract_array((1, args.width * args.width), jnp.float32, mesh)
    probe = {}
    for name, fn in row_programs(args.layers).items():
        text = jax.jit(fn, donate_argnums=(0, 1, 2, 3)).lower(row_stack, row_stack, row, weight, weight) \
            .compile(compiler_options=step_compiler_options("cuda")).as_text()
        engines = hlo.host_copy_engines(text)
        beside = hlo.host_copies_beside_compute(text)
        probe[name] = {"dma_bytes": engines.dma_bytes, "kernel_bytes": engines.kernel_bytes,
                       "both_directions_bytes": hlo.overlapping_host_copies(text).overlapped_bytes,
                       "beside_matmul_bytes": sum(beside.beside_compute_by_pass.values())}
    return {"rows": rows, "probe_rows": probe, "jax": jax.__version__, "target": args.target}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=DEFAULT_GPU)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON (a compile process)")
    args = parser.parse_args(argv)
    if args.layers < 3 or args.width < 1:
        parser.error("--layers must be at least 3 and --width positive")
    return args


def main() -> None:
    args = parse_args()
    result = served_or_measured(args, parse_args, measure)
    print(f"{args.layers - 1} iterations, a {args.width}x{args.width} float32 row in and out each; {args.target}, "
          f"jax {result['jax']}, deviceless")
    print(f"{'row offsets (read / write)':32s} {'memcpy MiB':>10s} {'kernel MiB':>10s}")
    for form, row in result["rows"].items():
        print(f"{form:32s} {row['dma_bytes'] / MiB:10.0f} {row['kernel_bytes'] / MiB:10.0f}")
    print(f"\nthe GPU link probe's row loops, compiled alike: {'memcpy MiB':>10s} {'kernel MiB':>10s} "
          f"{'both ways':>10s} {'by a matmul':>11s}")
    for name, row in result["probe_rows"].items():
        print(f"{name:47s} {row['dma_bytes'] / MiB:10.0f} {row['kernel_bytes'] / MiB:10.0f} "
              f"{row['both_directions_bytes'] / MiB:10.0f} {row['beside_matmul_bytes'] / MiB:11.0f}")


if __name__ == "__main__":
    main()
