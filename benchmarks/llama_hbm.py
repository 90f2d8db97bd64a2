#!/usr/bin/env python
"""HBM and host memory of the Llama 3.1 8B train step on one H200, compiled without a GPU.

The project's first HBM figures. The train step is the real one
(spillway.recipes.train.make_train_step through spillway.recipes.train.abstract_setup: the
recipe's shardings and donation), compiled for the target by XLA's GPU
compiler running deviceless (docs/DESIGN.md section 5); nothing is allocated.
Sections (--sections, comma-separated):

  presets     every activation preset (layers/offload.py), optimizer state on
              device: HBM, host bytes, host<->device traffic, compile time.
  optimizer   optimizer state on device vs in pinned host memory, streamed a
              layer at a time (recipes/optim/host_streaming.py), vs in host memory
              but copied whole into HBM for the update (every leaf updated in
              one piece: the design docs/DESIGN.md section 6 warns about). The HBM
              saved is compared with the state's own bytes.
  search      the longest sequence (multiple of 1024, up to --max-seq) that
              fits --headroom x HBM, for the plans without any offload and for
              the offloading ones (recipes/planner_child.search_one).
  codegen     one plan compiled with the planner's fast code generation and
              exactly as for a run: the memory figures must agree.
  devices     per-GPU bytes as the GPU count grows (--device-counts) with one
              sequence per GPU, FSDP mesh, save_all, 4 layers to keep it
              quick: temp must stay flat (activations split by batch), args
              must shrink (weights and state split over fsdp).

Run:  .venv/bin/python benchmarks/llama_hbm.py [--recipe llama3_8b] [--gpu h200]
          [--seq 8192] [--batch 1] [--sections presets,optimizer,search,codegen]

GiB = 2^30 bytes, per GPU. HBM = argument + output - alias + temp bytes in
device memory; host = the same in pinned host memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from spillway.recipes.plan.subprocess_runner import prepare_compile_process  # noqa: E402  (imports no JAX)
from spillway.recipes.targets import DEFAULT_GPU

GiB = 2**30
GB = 10**9
SECTIONS = ("presets", "optimizer", "search", "codegen", "devices")
SEARCH_HEADER = (f"{'activations / optimizer state':40s} {'longest':>8s} {'HBM there':>9s} {'compiles':>8s} "
                 f"{'seconds':>8s}   [seq:HBM GiB of each compile]")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="llama3_8b")
    parser.add_argument("--gpu", default=DEFAULT_GPU)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], metavar="A.B=VALUE")
    parser.add_argument("--sections", default="presets,optimizer,search,codegen")
    parser.add_argument("--headroom", type=float, default=0.9)
    parser.add_argument("--max-seq", type=int, default=131072, help="search cap (sets model.max_seq_len)")
    parser.add_argument("--search-plans", default="save_all/device,recompute_all/device,recompute_all/host,"
                        "offload_inputs/host,offload_dots/host,offload_dots/device",
                        help="ACTIVATIONS/OPTIMIZER_STATE pairs to search")
    parser.add_argument("--device-counts", default="1,2,4,8", help="GPU counts for the devices section")
    parser.add_argument("--full-codegen", action="store_true",
                        help="compile exactly as for a run (default: the planner's fast code generation)")
    args = parser.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    return args


def with_offload(recipe, activations: str, optimizer_state: str):
    from spillway.recipes.config import OffloadConfig
    return dataclasses.replace(recipe, offload=OffloadConfig(activations=activations,
                                                             optimizer_state=optimizer_state))


def optimizer_state_bytes(recipe) -> int:
    """Bytes of AdamW state as recipes/optim/optimizer.py stores it: fp32 mu and nu, fp32 master for non-fp32 params."""
    import jax
    from flax import nnx

    from spillway.recipes.optim.layouts import keeps_master_copy

    model = nnx.eval_shape(lambda: recipe.build_model(nnx.Rngs(0)))
    total = 0
    for x in jax.tree.leaves(nnx.state(model, nnx.Param)):
        total += x.size * (12 if keeps_master_copy(recipe.optimizer, x.dtype) else 8)
    return total


def compile_whole_state_variant(recipe, mesh, options):
    """Host-resident state, but every host leaf copied into HBM in one piece for its update.

    The same train step with the optimizer's layouts marked not stacked: each
    leaf then visits HBM whole (recipes/optim/host_streaming.update_outside_stack
    without a stream axis). A variant for comparison only; training never
    builds it.
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from spillway.recipes.plan.compile import CompileReport
    from spillway.recipes.optim.layouts import LeafLayout
    from spillway.recipes.optim.optimizer import Optimizer
    from spillway.recipes.train.step import abstract_setup, abstract_step_arguments, make_train_step

    s = abstract_setup(recipe, mesh, platform="cuda")
    layouts = jax.tree.map(lambda layout: dataclasses.replace(layout, stacked=False, stream_axis=None),
                           s.optimizer.layout_tree,
                           is_leaf=lambda x: isinstance(x, LeafLayout))
    optimizer = Optimizer(s.optimizer.cfg, layouts, total_steps=s.optimizer.total_steps)
    opt_sh = optimizer.state_shardings(s.param_shardings)
    step = jax.jit(make_train_step(s.graphdef, optimizer, recipe.train.grad_accum, recipe.train.loss_chunk,
                                   mesh, recipe.aux_loss),
                   in_shardings=(s.param_shardings, opt_sh, s.batch_sharding),
                   out_shardings=(s.param_shardings, opt_sh, NamedSharding(mesh, PartitionSpec())),
                   donate_argnums=(0, 1))
    s = dataclasses.replace(s, optimizer=optimizer, opt_state_shardings=opt_sh, train_step=step)
    arguments = abstract_step_arguments(s)
    started = time.perf_counter()
    lowered = step.lower(*arguments)
    lowered_at = time.perf_counter()
    compiled = lowered.compile(compiler_options=options)
    return CompileReport.from_compiled(compiled, lower_seconds=lowered_at - started,
                                       compile_seconds=time.perf_counter() - lowered_at)


def print_search(label: str, result: dict) -> None:
    best = result["best"]
    at = result["points"].get(str(best), {}).get("hbm_bytes") if best else None
    note = " (cap)" if result["at_cap"] else ("" if result["resolved"] else
                                             f" (unresolved below {result['first_fail']})")
    points = " ".join(f"{k}:{v['hbm_bytes'] / GiB:.1f}" for k, v in result["points"].items())
    print(f"{label:40s} {best if best else 'none':>8} {'-' if at is None else f'{at / GiB:.1f}':>9s} "
          f"{result['compiles']:8d} {result['seconds']:8.1f}{note}   [{points}]", flush=True)


def report_line(label: str, r, width: int = 40) -> str:
    return (f"{label:{width}s} {r.hbm_bytes / GiB:8.2f} {r.argument_bytes / GiB:8.2f} {r.temp_bytes / GiB:8.2f} "
            f"{r.host_bytes / GiB:8.2f} {r.host_temp_bytes / GiB:8.2f} {r.host_buffer_count:6d} "
            f"{r.host_to_device_bytes / GB:8.2f} {r.device_to_host_bytes / GB:8.2f} "
            f"{r.lower_seconds:6.1f} {r.compile_seconds:7.1f}")


def report_header(first: str, width: int = 40) -> str:
    header = (f"{first:{width}s} {'HBM':>8s} {'args':>8s} {'temp':>8s} {'host':>8s} {'host tmp':>8s} "
              f"{'S(5)':>6s} {'H->D GB':>8s} {'D->H GB':>8s} {'lower':>6s} {'compile':>7s}")
    return header + "\n" + "-" * len(header)


def main(argv=None) -> int:
    args = parse_args(argv)
    prepare_compile_process()
    import jax

    from spillway.layers.offload import PRESETS
    from spillway.layers.mesh import MeshConfig
    from spillway.layers.sharding import make_mesh
    from spillway.recipes.plan.candidates import planned_recipe
    from spillway.recipes.plan.toolchain import compiler_options
    from spillway.recipes.plan.compile import gpu_topology
    from spillway.recipes.targets import get_target
    from spillway.recipes.plan.child import _measure, compile_step, search_one
    from spillway.recipes.registry import get_recipe

    started = time.perf_counter()
    target = get_target(args.gpu)
    overrides = [f"model.max_seq_len={max(args.max_seq, args.seq)}", f"data.seq_len={args.seq}",
                 f"train.global_batch={args.batch}", "train.grad_accum=1", *args.set]   # one micro-batch
    recipe, warnings = planned_recipe(get_recipe(args.recipe, overrides))
    mesh = make_mesh(recipe.mesh,
                     devices=gpu_topology(target, 1).devices)
    options = None if args.full_codegen else compiler_options()
    state_bytes = optimizer_state_bytes(recipe)
    m = recipe.model
    print(f"jax {jax.__version__}; {target.display_name} ({target.hbm_bytes / GiB:.1f} GiB HBM), deviceless "
          f"compile, {'full' if options is None else 'fast'} code generation")
    print(f"recipe {recipe.name}: {m.num_params() / 1e9:.3f}B params, {m.num_layers} layers, {m.param_dtype} "
          f"weights, {m.dtype} compute, attention {m.attention_impl}; batch {args.batch} x seq {args.seq}")
    print(f"optimizer state (AdamW, fp32 mu + nu + fp32 master of non-fp32 params): {state_bytes / GiB:.2f} GiB "
          f"({state_bytes / m.num_params():.2f} bytes/param); params {m.num_params() * 2 / GiB:.2f} GiB bf16")
    for w in warnings:
        print(f"warning: {w}")

    if "presets" in args.sections:
        print("\n[presets] activation presets, optimizer state on device (GiB per GPU; seconds)")
        print(report_header("activations"))
        for name in PRESETS:
            report, _ = compile_step(with_offload(recipe, name, "device"), mesh, options)
            print(report_line(name, report), flush=True)

    if "optimizer" in args.sections:
        print("\n[optimizer] optimizer state placement, activations recompute_all (GiB per GPU; seconds)")
        print(report_header("optimizer state"))
        device, _ = compile_step(with_offload(recipe, "recompute_all", "device"), mesh, options)
        print(report_line("device", device), flush=True)
        streamed, _ = compile_step(with_offload(recipe, "recompute_all", "host"), mesh, options)
        print(report_line("host, streamed in pieces", streamed), flush=True)
        try:
            whole = compile_whole_state_variant(with_offload(recipe, "recompute_all", "host"), mesh, options)
            print(report_line("host, whole leaves copied to HBM", whole), flush=True)
        except Exception as error:   # a variant for comparison; report and go on
            print(f"{'host, whole leaves copied to HBM':40s} FAILED: {type(error).__name__}: {error}"[:300])
        saved = device.hbm_bytes - streamed.hbm_bytes
        print(f"HBM saved by streaming the state from host: {saved / GiB:.2f} GiB = {saved / state_bytes:.1%} of "
              f"the {state_bytes / GiB:.2f} GiB state (target >= 90%); host holds "
              f"{streamed.host_argument_bytes / GiB:.2f} GiB of it")

    if "search" in args.sections:
        limits = {"hbm_bytes": args.headroom * target.hbm_bytes,
                  "host_bytes_per_device": target.default_host_ram_bytes}
        print(f"\n[search] longest sequence that fits {args.headroom:g} x HBM = {limits['hbm_bytes'] / GiB:.1f} GiB "
              f"(multiples of 1024, cap {args.max_seq}), batch {args.batch}")
        header = SEARCH_HEADER
        print(header + "\n" + "-" * len(header))
        found = {}
        for pair in args.search_plans.split(","):
            activations, state = pair.split("/")
            planned = with_offload(recipe, activations, state)
            result = search_one(_measure(planned, mesh, "seq_len", options), args.seq, None, limits,
                                step=1024, cap=args.max_seq, max_compiles=10)
            found[pair] = result
            print_search(pair, result)
        baseline = max((r["best"] or 0 for p, r in found.items()
                        if p.endswith("/device") and p.split("/")[0] in ("save_all", "recompute_all")), default=0)
        best_pair = max(found, key=lambda p: found[p]["best"] or 0)
        if baseline:
            print(f"longest without offload: {baseline}; best plan {best_pair}: {found[best_pair]['best']} "
                  f"= {(found[best_pair]['best'] or 0) / baseline:.1f}x (target >= 4x)")

    if "codegen" in args.sections:
        print("\n[codegen] offload_dots / host compiled with fast and with full code generation")
        print(report_header("code generation"))
        planned = with_offload(recipe, "offload_dots", "host")
        fast, _ = compile_step(planned, mesh, compiler_options())
        print(report_line("fast (LLVM -O0, no ptxas)", fast), flush=True)
        full, _ = compile_step(planned, mesh, None)
        print(report_line("full (as for a run)", full), flush=True)
        same = all(getattr(fast, k) == getattr(full, k) for k in (
            "hbm_bytes", "host_bytes", "temp_bytes", "host_temp_bytes", "device_to_host_bytes",
            "host_to_device_bytes"))
        print(f"memory figures identical: {same}")

    if "devices" in args.sections:
        counts = [int(n) for n in args.device_counts.split(",")]
        print(f"\n[devices] save_all, 4 layers, one {args.seq}-token sequence per GPU, fsdp over all GPUs "
              "(GiB per GPU; seconds)")
        print(report_header("GPUs"))
        for n in counts:
            per_gpu = get_recipe(args.recipe, overrides + ["model.num_layers=4", f"train.global_batch={n}",
                                                           "mesh.data=1", "mesh.fsdp=-1", "mesh.tensor=1"])
            per_gpu, _ = planned_recipe(per_gpu)
            gpus = make_mesh(MeshConfig(1, -1, 1), devices=gpu_topology(target, n).devices)
            report, _ = compile_step(with_offload(per_gpu, "save_all", "device"), gpus, options)
            print(report_line(f"{n} x {target.name}", report), flush=True)

    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
