#!/usr/bin/env python
"""HBM and host bytes of an optimizer update with its state on device or in pinned host memory.

Deviceless compile for a GPU target (default H200; no GPU needed, see
docs/DESIGN.md section 5) of a train-step-like function

    step(params, grads, opt_state) -> recipes.optimizer.Optimizer.update(...)

on a toy of 16 stacked layers of 4096 x 14336 (bf16 params and grads), for
each placement of the optimizer state. Prints, per variant, what XLA's buffer
assignment says one device needs:

    HBM  = argument + output - alias + temp   (device memory)
    host = the same sum over host memory      (pinned_host buffers)

plus the host<->device bytes one step moves and whether the prefetch of the
next layer is in flight while the current one is updated (both read from the
compiled HLO). The variants:

    device               state in HBM, updated whole (the optax way)
    host, one piece      state in host memory, whole leaf copied to HBM for the
                         update (LeafLayout.stacked=False): the naive design
    host, streamed       state in host memory, streamed one layer at a time,
                         double-buffered (LeafLayout.stacked=True)
    ..., no prefetch     streamed without double buffering
    host, host compute   update_on_host=True: the host CPU updates the state

each without and with an fp32 master copy (bf16 params). The "init" column
compiles Optimizer.init with the same shardings, so set-up cost shows too.

Run:  .venv/bin/python benchmarks/optimizer_state_toy.py [--target h200] [--layers 16]
      [--variants device,host_streamed]   (keys: see VARIANTS)
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

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Variant:
    label: str
    state_memory: str
    stacked: bool
    master: bool
    update_on_host: bool = False
    prefetch: bool = True


VARIANTS = {
    "device": Variant("device", "device", True, False),
    "host_one_piece": Variant("host, one piece (whole state to HBM)", "host", False, False),
    "host_streamed": Variant("host, streamed per layer", "host", True, False),
    "host_streamed_no_prefetch": Variant("host, streamed, no prefetch", "host", True, False, prefetch=False),
    "host_compute": Variant("host, host compute (compute_on)", "host", True, False, update_on_host=True),
    "device_master": Variant("device + fp32 master", "device", True, True),
    "host_streamed_master": Variant("host, streamed + fp32 master", "host", True, True),
    "host_streamed_no_prefetch_master": Variant("host, streamed, no prefetch + master", "host", True, True,
                                                prefetch=False),
    "host_compute_master": Variant("host, host compute + fp32 master", "host", True, True, update_on_host=True),
}


def _elements(shape) -> int:
    """Elements of the largest array in an HLO shape (an ArrayShape or a tuple of shapes)."""
    if isinstance(shape, tuple):
        return max((_elements(s) for s in shape), default=0)
    size = 1
    for d in shape.dims:
        size *= d
    return size


def prefetch_overlap(hlo_text: str) -> tuple[int, int]:
    """(overlapped, total) host->device slice copies, in every computation of the compiled program.

    A copy overlaps the update when a fusion at least as large as the copied
    slice (the AdamW update of a layer) is scheduled between its async start
    and its done; in scheduled HLO the printed order is the order the stream
    runs them. Loop bodies and the unrolled first and last layers both count.
    """
    from spillway.recipes.plan import hlo

    computations, _ = hlo.parse_computations(hlo_text)
    overlapped = total = 0
    for name in computations:
        in_flight: dict[str, list] = {}  # start name -> [slice elements, overlapped?]
        for instr in computations.get(name, []):
            if instr.opcode == "fusion-start" and "dynamic-slice-start" in instr.name:
                output = instr.shape[1] if isinstance(instr.shape, tuple) else instr.shape
                in_flight[instr.name] = [_elements(output), False]
            elif instr.opcode == "fusion-done" and instr.operands and instr.operands[0] in in_flight:
                total += 1
                overlapped += in_flight.pop(instr.operands[0])[1]
            elif instr.opcode == "fusion":
                for entry in in_flight.values():
                    entry[1] = entry[1] or _elements(instr.shape) >= entry[0]
    return overlapped, total


def compile_variant(variant: Variant, mesh, shape) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from spillway.recipes.plan import compile as aot
    from spillway.recipes.plan import hlo
    from spillway.recipes.optim.config import OptimizerConfig
    from spillway.recipes.optim.layouts import LeafLayout
    from spillway.recipes.optim.optimizer import Optimizer

    cfg = OptimizerConfig(master_weights=variant.master, update_on_host=variant.update_on_host)
    layouts = {"w": LeafLayout(stacked=variant.stacked, state_memory=variant.state_memory,
                               decay=True, master=variant.master)}
    opt = Optimizer(cfg, layouts, total_steps=1000, stream_prefetch=variant.prefetch)
    # Concrete shardings for params and grads give the compile its devices;
    # state_shardings moves host leaves onto the abstract mesh by itself.
    param_sh = {"w": NamedSharding(mesh, PartitionSpec())}
    state_sh = opt.state_shardings(param_sh)
    params = {"w": jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=param_sh["w"])}
    grads = params
    abstract_state = jax.tree.map(lambda s, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                  state_sh, jax.eval_shape(opt.init, params))

    def step(params, grads, opt_state):
        return opt.update(grads, opt_state, params)

    jitted = jax.jit(step, donate_argnums=(0, 2), out_shardings=(param_sh, state_sh, None))
    report = aot.compile_report(jitted, params, grads, abstract_state, keep_hlo_text=True)
    init_report = aot.compile_report(jax.jit(opt.init, out_shardings=state_sh), params)
    overlapped, prefetches = prefetch_overlap(report.hlo_text)
    copies = hlo.overlapping_host_copies(report.hlo_text)
    return {"label": variant.label, "report": report.to_dict(), "init_hbm_bytes": init_report.hbm_bytes,
            "overlapped_prefetches": overlapped, "loop_prefetches": prefetches,
            "copy_overlap": dataclasses.asdict(copies)}


def measure(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=DEFAULT_GPU)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--d-ff", type=int, default=14336)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")

    prepare_compile_process()
    import jax

    from spillway.recipes.plan import compile as aot
    from spillway.recipes.targets import get_target

    target = get_target(args.target)
    mesh = aot.compile_only_mesh(target, {"data": 1, "fsdp": 1, "tensor": 1})
    shape = (args.layers, args.d_model, args.d_ff)
    rows = {}
    for key in args.variants.split(","):
        try:
            rows[key] = compile_variant(VARIANTS[key], mesh, shape)
        except Exception as error:  # report and go on: one broken variant should not hide the rest
            rows[key] = {"label": VARIANTS[key].label,
                         "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    return {"jax": jax.__version__, "device_kind": mesh.devices.flat[0].device_kind,
            "host_link": target.host_link, "host_link_bytes_per_s": target.host_link_bytes_per_s,
            "hbm_bandwidth": target.hbm_bandwidth, "shape": shape, "rows": rows}


def print_table(result: dict) -> None:
    layers, d_model, d_ff = result["shape"]
    n = layers * d_model * d_ff
    link = result["host_link_bytes_per_s"]
    print(f"jax {result['jax']}; target {result['device_kind']} (deviceless compile); "
          f"host link {result['host_link']} {link / 1e9:.0f} GB/s per direction")
    print(f"toy: {layers} stacked layers of {d_model}x{d_ff}; bf16 params + grads {2 * 2 * n / GiB:.2f} GiB, "
          f"fp32 mu+nu {2 * 4 * n / GiB:.2f} GiB, fp32 master {4 * n / GiB:.2f} GiB\n")
    header = (f"{'optimizer state':38s} {'HBM':>6s} {'args':>6s} {'temp':>6s} {'host':>6s} "
              f"{'h.temp':>6s} {'H->D':>6s} {'D->H':>6s} {'link s':>6s} {'init':>6s} {'overlap':>7s} "
              f"{'compile':>7s}")
    print(header)
    print("-" * len(header))
    for row in result["rows"].values():
        if "error" in row:
            print(f"{row['label']:38s} FAILED: {row['error']}")
            continue
        r = row["report"]
        link_seconds = (r["host_to_device_bytes"] + r["device_to_host_bytes"]) / link
        overlap = f"{row['overlapped_prefetches']}/{row['loop_prefetches']}"
        print(f"{row['label']:38s} {r['hbm_bytes'] / GiB:6.2f} {r['argument_bytes'] / GiB:6.2f} "
              f"{r['temp_bytes'] / GiB:6.2f} {r['host_bytes'] / GiB:6.2f} {r['host_temp_bytes'] / GiB:6.2f} "
              f"{r['host_to_device_bytes'] / GiB:6.2f} {r['device_to_host_bytes'] / GiB:6.2f} "
              f"{link_seconds:6.2f} {row['init_hbm_bytes'] / GiB:6.2f} {overlap:>7s} "
              f"{r['compile_seconds']:6.1f}s")
    # AdamW reads grad, param, mu, nu and writes param, mu, nu (bf16 params, fp32 state).
    update_bytes = n * (2 + 2 + 8 + 2 + 8)
    print("GiB per device. HBM = argument + output - alias + temp (device memory); host = the same over "
          "pinned_host; h.temp: host temp.\n"
          "H->D / D->H: bytes one step moves over the host link (from the compiled HLO); link s: "
          "(H->D + D->H) / link bandwidth,\nthe two directions serialised as the streamed loop schedules them. "
          "init: HBM of Optimizer.init compiled with the same shardings.\n"
          "overlap: host->device slice copies in the layer loop whose start..done window holds the update, "
          "of all of them.\n"
          f"For scale: the AdamW update itself moves ~{update_bytes / GiB:.0f} GiB through HBM, "
          f"~{update_bytes / result['hbm_bandwidth'] * 1e3:.0f} ms at {result['hbm_bandwidth'] / 1e12:.1f} TB/s. "
          "Params and opt_state donated (GPU target).")


if __name__ == "__main__":
    if "--json" in sys.argv[1:]:
        serve_compile_process(measure)
    print_table(measure(sys.argv[1:]))
