#!/usr/bin/env python
"""Host link time of a recipe's train step with host-resident optimizer state, read from its compiled HLO.

Compiles the real train step (the planner's path: abstract_setup, compile-only
GPUs, the planner's fast code generation) for one activation plan with the
optimizer state in pinned host memory, deviceless, and prints what the
schedule does with the host link:

    H->D, D->H     bytes the step moves each way (recipes/plan/hlo.py host_traffic)
    overlapped     bytes moved in one direction while the other is busy too
                   (hlo.overlapping_host_copies: opposite async copy windows in flight together)
    link serial    (H->D + D->H) / link: the two directions taking turns
    link overlap   (H->D + D->H - overlapped) / link
    update         the planner's update phase: 2 x state / link, less the
                   overlapped bytes (at most the state)
    beside compute per autodiff pass, the async copy bytes whose window in the
                   schedule holds a matmul (hlo.host_copies_beside_compute):
                   what can hide under that pass's compute
    host temp / alias  the compiled step's host temporaries and the host bytes
                   written over donated arguments (in place: alias = arguments)
    DMA / kernels  of the bytes moved both ways, those a GPU moves as memcpys and those moved
                   by kernels reading or writing pinned host memory (hlo.host_copy_engines)

--update next_forward compiles the update run in the next forward pass
(offload.update), --set train.grad_accum=8 the accumulating step.

Run:  .venv/bin/python benchmarks/update_overlap.py [--recipe llama3_8b] [--gpu h200]
      [--plan recompute_all] [--state host|host:N] [--update after_backward|next_forward] [--pending-gradients host|device]
      [--set key=value ...]
      [--xla option=value ...] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from spillway.recipes.plan.subprocess_runner import serve_compile_process  # noqa: E402
from spillway.recipes.targets import DEFAULT_GPU

GiB = 2**30


def _xla_option(text: str) -> tuple[str, object]:
    """"name=value" as a compile option: true/false as booleans, digits as an integer, else the text."""
    name, _, value = text.partition("=")
    if value.lower() in ("true", "false"):
        return name, value.lower() == "true"
    return name, int(value) if value.lstrip("-").isdigit() else value


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="llama3_8b")
    parser.add_argument("--gpu", default=DEFAULT_GPU)
    parser.add_argument("--plan", default="recompute_all")
    parser.add_argument("--update", default="after_backward")
    parser.add_argument("--state", default="host",
                        help="offload.optimizer_state: host, or a split host:N / host:F (default host)")
    parser.add_argument("--pending-gradients", default="host", choices=("host", "device"),
                        help="with --update next_forward: where the pending gradients wait (offload.pending_gradients)")
    parser.add_argument("--hlo-out", help="write the compiled step's HLO text here")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--xla", action="append", default=[], metavar="OPTION=VALUE",
                        help="an XLA compile option on top of the step's own (xla_settings.py), e.g. "
                             "xla_gpu_experimental_parallel_async_compute_limit=2 to compile as before")
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


def measured_recipe(args: argparse.Namespace):
    """The recipe the step is compiled from: --recipe with --set, the placement and update of the arguments;
    ConfigError (one line) for a setting it cannot take."""
    from spillway.recipes.config import OffloadConfig
    from spillway.recipes.registry import get_recipe

    recipe = get_recipe(args.recipe, args.set)
    return dataclasses.replace(recipe, offload=OffloadConfig(activations=args.plan, optimizer_state=args.state,
                                                             update=args.update,
                                                             pending_gradients=args.pending_gradients))


def measure(argv: list[str]) -> dict:
    args = parse_args(argv)

    from spillway.layers.sharding import make_mesh
    from spillway.recipes.plan import hlo
    from spillway.recipes.plan.candidates import planned_recipe
    from spillway.recipes.plan.toolchain import compiler_options
    from spillway.recipes.plan.compile import gpu_topology
    from spillway.recipes.targets import get_target
    from spillway.recipes.train.step import abstract_setup, abstract_step_arguments

    recipe, _ = planned_recipe(measured_recipe(args))
    target = get_target(args.gpu)
    topology = gpu_topology(target, 1)
    mesh = make_mesh(recipe.mesh, devices=topology.devices)
    started = time.perf_counter()
    s = abstract_setup(recipe, mesh, platform="cuda")
    options = {**(compiler_options() or {}), **dict(_xla_option(text) for text in args.xla)}
    compiled = s.train_step.lower(*abstract_step_arguments(s)).compile(compiler_options=options or None)
    seconds = time.perf_counter() - started
    text = compiled.as_text()
    if args.hlo_out:
        with open(args.hlo_out, "w") as out:
            out.write(text)
    stats = compiled.memory_analysis()
    traffic = hlo.host_traffic(text)
    copies = hlo.overlapping_host_copies(text)
    beside = hlo.host_copies_beside_compute(text)
    engines = hlo.host_copy_engines(text)
    link = target.host_link_bytes_per_s
    state = min(stats.host_argument_size_in_bytes, traffic.device_to_host_bytes, traffic.host_to_device_bytes)
    moved = traffic.device_to_host_bytes + traffic.host_to_device_bytes
    return {
        "recipe": recipe.name, "plan": args.plan, "state": args.state, "xla": args.xla, "update": args.update,
        "pending_gradients": args.pending_gradients, "target": target.display_name,
        "host_link": target.host_link, "link_bytes_per_s": link, "compile_s": seconds,
        "hbm_bytes": (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
                      + stats.temp_size_in_bytes),
        "hbm_parts": {"argument": stats.argument_size_in_bytes, "output": stats.output_size_in_bytes,
                      "alias": stats.alias_size_in_bytes, "temp": stats.temp_size_in_bytes},
        "host_state_bytes": stats.host_argument_size_in_bytes,
        "host_temp_bytes": stats.host_temp_size_in_bytes,
        "host_alias_bytes": stats.host_alias_size_in_bytes,
        "async_copy_bytes_by_pass": beside.moved_by_pass, "beside_compute_by_pass": beside.beside_compute_by_pass,
        "transfer_bytes_by_pass": hlo.traffic_by_pass(text), "overlapped_bytes_by_pass": copies.overlapped_by_pass,
        "host_to_device_bytes": traffic.host_to_device_bytes,
        "device_to_host_bytes": traffic.device_to_host_bytes,
        "dma_bytes": engines.dma_bytes, "kernel_bytes": engines.kernel_bytes,
        "overlapped_bytes": copies.overlapped_bytes, "overlapping_pairs": copies.overlapping_pairs,
        "link_serial_s": moved / link, "link_overlap_s": (moved - copies.overlapped_bytes) / link,
        "update_serial_s": 2 * state / link,
        "update_s": (2 * state - min(copies.overlapped_bytes, state)) / link,
    }


def print_table(r: dict) -> None:
    print(f"{r['recipe']}, activations {r['plan']}, optimizer state {r['state']}, update {r['update']}; {r['target']} "
          f"(deviceless compile, {r['compile_s']:.0f} s{', ' + ' '.join(r['xla']) if r['xla'] else ''}); "
          f"{r['host_link']} "
          f"{r['link_bytes_per_s'] / 1e9:.0f} GB/s per direction")
    parts = r["hbm_parts"]
    print(f"  HBM {r['hbm_bytes'] / GiB:.2f} GiB (arguments {parts['argument'] / GiB:.2f} + outputs "
          f"{parts['output'] / GiB:.2f} - alias {parts['alias'] / GiB:.2f} + temp {parts['temp'] / GiB:.2f}); "
          f"pending gradients in {r['pending_gradients']} memory")
    print(f"  host state {r['host_state_bytes'] / GiB:.2f} GiB, "
          f"host temp {r['host_temp_bytes'] / GiB:.2f} GiB, host alias {r['host_alias_bytes'] / GiB:.2f} GiB")
    print("  async copies beside a matmul, per pass: " + ", ".join(
        f"{kind} {r['beside_compute_by_pass'][kind] / GiB:.2f} of {moved / GiB:.2f} GiB"
        for kind, moved in r["async_copy_bytes_by_pass"].items()))
    print(f"  H->D {r['host_to_device_bytes'] / GiB:.2f} GiB, D->H {r['device_to_host_bytes'] / GiB:.2f} GiB, "
          f"overlapped {r['overlapped_bytes'] / GiB:.2f} GiB ({r['overlapping_pairs']} overlapping window pairs)")
    print(f"  moved by DMA memcpys {r['dma_bytes'] / GiB:.2f} GiB, by kernels over PCIe {r['kernel_bytes'] / GiB:.2f} "
          f"GiB (hlo.host_copy_engines)")
    print(f"  link time: serial {r['link_serial_s'] * 1e3:.0f} ms, as scheduled {r['link_overlap_s'] * 1e3:.0f} ms; "
          f"planner update phase: {r['update_serial_s'] * 1e3:.0f} ms serial, {r['update_s'] * 1e3:.0f} ms "
          f"with the overlap credited")


if __name__ == "__main__":
    if "--json" in sys.argv[1:]:
        serve_compile_process(measure)
    from spillway.recipes.plan.subprocess_runner import run_in_compile_process
    try:   # a setting the recipe cannot take is one line here, before any compile process starts
        measured_recipe(parse_args(sys.argv[1:]))
    except ValueError as error:   # a setting (ConfigError), or a recipe name, it cannot take
        sys.exit(f"update_overlap.py: {error}")
    print_table(run_in_compile_process("benchmarks.update_overlap", ["--json", *sys.argv[1:]], timeout_s=1800))
