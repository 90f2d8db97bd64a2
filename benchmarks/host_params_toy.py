#!/usr/bin/env python
"""HBM of the real train step with the block weights on device or in pinned host memory (offload.params).

Deviceless compile for a GPU target (default H200; docs/DESIGN.md section 5)
of the `tiny` recipe's train step (recipes/train/step.py: the step training
runs) reshaped to a small scanned Llama whose stacked block weights are most
of the model, once per placement:

    device_params   weights and gradients in HBM, optimizer state on host (streamed)
    host_params     weights in pinned host memory (offload.params=host), streamed
                    into HBM a layer per scan iteration, gradients back to host,
                    optimizer state on host, the update streamed through HBM
    host_params_host_update   the same, the update run by the host CPU
    split_params    the last half of the layers' weights and state in pinned host memory, the first
                    half in HBM (offload.params=host:0.5, offload.optimizer_state=host:0.5)
    host_params_keep, split_params_keep   host_params and split_params with the last 2 streamed layers'
                    weights kept in HBM from the forward pass to the backward pass (offload.params_keep=2):
                    2 layers' weights fewer into HBM per micro-batch, about 2 layers more HBM
    device_params_update_in_forward   weights in HBM, optimizer state on host, each layer's
                    update run in the next step's forward pass just before the layer
                    (offload.update=next_forward), the pending gradients in host memory
                    (grad_accum 1 only)
    device_params_update_in_forward_pending_device   the same with the pending gradients in HBM
                    (offload.pending_gradients=device): no gradient crosses the link; with
                    --grad-accum > 1 the first micro-batch's forward pass takes the update
    host_experts    with an MoE block (--block, e.g. benchmarks.moe_blocks:ToyMoEBlock) only the
                    routed experts' weights in pinned host memory (offload.params=experts),
                    streamed like host_params; attention, norms and router in HBM
    host_experts_host_update   the same, the update run by the host CPU

Reports per placement: HBM (argument + output - alias + temp), host bytes, the
largest device-memory arrays of the compiled program (recipes/plan/hlo.py
largest_device_arrays: no HBM buffer is larger than the first), one
layer's weight bytes (and its experts' bytes, with an MoE block), so a reader
can see how many layers HBM holds at most,
and the host link bytes per autodiff pass (hlo.traffic_by_pass: forward,
backward, other), which the planner's weight-stream model is checked against;
and the start-up: HBM of the program that creates the weights in their
memories (host-resident ones a layer at a time).

Run:  .venv/bin/python benchmarks/host_params_toy.py [--target h200] [--layers 8] [--d-model 512]
      [--mesh DATAxFSDPxTENSOR, default 1x1x1] [--param-dtype float32|bfloat16] [--placements A,B]
      [--block benchmarks.moe_blocks:ToyMoEBlock]   an MoE block: adds the host_experts placements
      [--json]   one JSON document on stdout, for tests (run it as a compile process)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from spillway.recipes.plan.subprocess_runner import prepare_compile_process, serve_compile_process  # noqa: E402
from spillway.recipes.targets import DEFAULT_GPU

MiB = 2**20
PLACEMENTS = {
    "device_params": ["offload.params=device", "optimizer.update_on_host=false"],
    "host_params": ["offload.params=host", "optimizer.update_on_host=false"],
    "host_params_host_update": ["offload.params=host", "optimizer.update_on_host=true"],
    "device_params_update_in_forward": ["offload.params=device", "optimizer.update_on_host=false",
                                        "offload.update=next_forward"],
    "device_params_update_in_forward_pending_device": ["offload.params=device", "optimizer.update_on_host=false",
                                                       "offload.update=next_forward",
                                                       "offload.pending_gradients=device"],
    # The last half of the layers' weights and state on host, the first half in HBM (offload.params=host:N).
    "split_params": ["offload.params=host:0.5", "offload.optimizer_state=host:0.5", "optimizer.update_on_host=false"],
    # The weights across the turn: the last 2 streamed layers keep their fetched weights for the backward pass.
    "host_params_keep": ["offload.params=host", "offload.params_keep=2", "optimizer.update_on_host=false"],
    "split_params_keep": ["offload.params=host:0.5", "offload.optimizer_state=host:0.5", "offload.params_keep=2",
                          "optimizer.update_on_host=false"],
    "host_experts": ["offload.params=experts", "optimizer.update_on_host=false"],
    "host_experts_host_update": ["offload.params=experts", "optimizer.update_on_host=true"],
}
# Placements that need an MoE block (--block): left out without one.
EXPERT_PLACEMENTS = ("host_experts", "host_experts_host_update")
# Left out of the default list with --grad-accum > 1: the next_forward placements (the one with its pending
# gradients in host memory takes one batch per step; the one in HBM compiles when --placements names it,
# as tests/recipes/plan/test_accumulate_in_forward_aot.py does, and is no default so that the callers'
# compiles stay as they were).
ONE_BATCH_PLACEMENTS = ("device_params_update_in_forward", "device_params_update_in_forward_pending_device")


def mesh_shape(text: str) -> dict[str, int]:
    """{"data": ., "fsdp": ., "tensor": .} from "DATAxFSDPxTENSOR"; an error naming the bad text.

    ArgumentTypeError, not ValueError: argparse prints only the former's message
    (for a ValueError it says "invalid mesh_shape value").
    """
    parts = text.split("x")
    if len(parts) != 3 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(
            f"--mesh must be DATAxFSDPxTENSOR with positive sizes (e.g. 1x2x1), got {text!r}")
    return dict(zip(("data", "fsdp", "tensor"), map(int, parts)))


def recipe_for(args, placement: str):
    from spillway.recipes.registry import get_recipe
    return get_recipe("tiny", [
        "model.vocab_size=256", f"model.d_model={args.d_model}", f"model.num_layers={args.layers}",
        "model.num_heads=8", "model.num_kv_heads=2", f"model.mlp_hidden={4 * args.d_model}",
        "model.max_seq_len=64", "data.seq_len=32", "train.global_batch=4", f"train.grad_accum={args.grad_accum}",
        "train.steps=10", "optimizer.warmup_steps=2", f"offload.activations={args.activations}",
        f"execution.param_dtype={getattr(args, 'param_dtype', 'float32')}",
        *([f"block={args.block}"] if getattr(args, "block", None) else []),
        "offload.optimizer_state=host", *PLACEMENTS[placement]])


def layer_weight_bytes(recipe, experts_only: bool = False) -> tuple[int, int]:
    """(bytes of one layer of all stacked weights, bytes of the largest one-layer weight) of `recipe`'s model;
    `experts_only`: of the routed experts' weights alone ((0, 0) without any)."""
    import jax
    from flax import nnx

    from spillway.layers.host_weights import is_expert_weight
    from spillway.recipes.train.step import abstract_model
    _, state = abstract_model(recipe)
    per_layer = [math.prod(var.get_value().shape[1:]) * var.get_value().dtype.itemsize
                 for path, var in jax.tree_util.tree_flatten_with_path(
                     state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
                 if "blocks" in jax.tree_util.keystr(path)
                 and (not experts_only or is_expert_weight(var.get_metadata().get("logical_axes")))]
    return sum(per_layer), max(per_layer, default=0)


def measure(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=DEFAULT_GPU)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--activations", default="recompute_all")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="bfloat16: with float32 master weights in the optimizer state")
    parser.add_argument("--placements", default=None, help="comma-separated; default: every placement the "
                        "grad_accum allows")
    parser.add_argument("--mesh", default="1x1x1", type=mesh_shape)
    parser.add_argument("--block", default=None, help="a TransformerBlock class path for the model's blocks "
                        "(an MoE block adds the host_experts placements)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    prepare_compile_process()

    import jax

    from spillway.layers.sharding import init_program
    from spillway.recipes.plan import compile as aot
    from spillway.recipes.optim.param_placement import whole_shardings
    from spillway.recipes.plan import hlo
    from spillway.recipes.train.step import abstract_setup, abstract_step_arguments, model_maker

    rows = {}
    placements = args.placements.split(",") if args.placements else [
        p for p in PLACEMENTS if (args.grad_accum == 1 or p not in ONE_BATCH_PLACEMENTS)
        and (args.block or p not in EXPERT_PLACEMENTS)]
    for placement in placements:
        recipe = recipe_for(args, placement)
        try:
            mesh = aot.compile_only_mesh(args.target, args.mesh)
            s = abstract_setup(recipe, mesh, platform="cuda")
            compiled = s.train_step.lower(*abstract_step_arguments(s)).compile()   # with `pending` if deferred
            report = aot.CompileReport.from_compiled(compiled, keep_hlo_text=True)
            largest = hlo.largest_device_arrays(report.hlo_text, 5)
            layer_bytes, largest_layer_leaf = layer_weight_bytes(recipe)
            expert_bytes, largest_expert_leaf = layer_weight_bytes(recipe, experts_only=True)
            # Start-up: the program that creates the weights, in their memories.
            whole = whole_shardings(s.param_shardings)   # split weights are made whole on host, then cut
            _, init = init_program(model_maker(recipe, 0, whole), mesh, shardings=whole)
            init_report = aot.CompileReport.from_compiled(init.lower().compile(), keep_hlo_text=True)
            state_init = jax.jit(s.optimizer.init, out_shardings=s.opt_state_shardings).lower(s.params)
            state_init_report = aot.CompileReport.from_compiled(state_init.compile())
            rows[placement] = {"report": report.to_dict(), "layer_weight_bytes": layer_bytes,
                               "largest_layer_leaf_bytes": largest_layer_leaf,
                               "layer_expert_bytes": expert_bytes, "largest_layer_expert_leaf_bytes": largest_expert_leaf,
                               "largest_device_arrays": [dataclasses.asdict(a) for a in largest],
                               "traffic_by_pass": hlo.traffic_by_pass(report.hlo_text),
                               "overlapped_by_pass": hlo.overlapping_host_copies(report.hlo_text).overlapped_by_pass,
                               "init": {"report": init_report.to_dict(), "largest_device_arrays": [
                                   dataclasses.asdict(a) for a in hlo.largest_device_arrays(init_report.hlo_text, 3)]},
                               "optimizer_init": {"report": state_init_report.to_dict()}}
        except Exception as error:  # report and go on: one broken placement should not hide the rest
            rows[placement] = {"error": f"{type(error).__name__}: {str(error)[:2000]}"}
    return {"rows": rows}


def main() -> None:
    result = measure(sys.argv[1:])
    for key, row in result["rows"].items():
        if "error" in row:
            print(f"{key:26s} ERROR {row['error'][:200]}")
            continue
        r = row["report"]
        big = row["largest_device_arrays"][0]
        print(f"{key:26s} HBM {r['hbm_bytes'] / MiB:8.1f} MiB (temp {r['temp_bytes'] / MiB:7.1f})  "
              f"host {r['host_bytes'] / MiB:8.1f} MiB  largest HBM array {big['nbytes'] / MiB:6.1f} MiB "
              f"{big['dims']} ({big['opcode']}); one layer of weights {row['layer_weight_bytes'] / MiB:.1f} MiB")
        passes = row["traffic_by_pass"]
        print(f"{'':26s} host->device MiB by pass: " + ", ".join(
            f"{kind} {moved['host_to_device_bytes'] / MiB:.1f}" for kind, moved in passes.items()))
        init = row["init"]["report"]
        print(f"{'':26s} start-up (creating the weights): HBM {init['hbm_bytes'] / MiB:8.1f} MiB "
              f"(temp {init['temp_bytes'] / MiB:7.1f})  host {init['host_bytes'] / MiB:8.1f} MiB")
        state = row["optimizer_init"]["report"]
        print(f"{'':26s} start-up (optimizer state):        HBM {state['hbm_bytes'] / MiB:8.1f} MiB "
              f"(temp {state['temp_bytes'] / MiB:7.1f})  host {state['host_bytes'] / MiB:8.1f} MiB")


if __name__ == "__main__":
    if "--json" in sys.argv[1:]:
        serve_compile_process(measure)
    main()
