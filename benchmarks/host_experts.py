#!/usr/bin/env python
"""HBM and host memory of a Qwen3-30B-A3B-shaped model on one H200, by where the weights and state live.

Deviceless (docs/DESIGN.md section 5): the planner (recipes/plan/planner.plan,
its compile processes, cost model and host-peak model) compiles the real train
step for an H200 once per placement, the activation plan fixed:

    all_device     weights, gradients and optimizer state in HBM
    state_host     optimizer state in pinned host memory (streamed), weights in HBM
    experts_host   the routed experts' weights too (offload.params=experts): attention,
                   norms and router in HBM
    params_host    every block weight too (offload.params=host)

The shape is Qwen3-30B-A3B's (Hugging Face Qwen/Qwen3-30B-A3B config.json): d
2048, 48 layers, 32 query heads and 4 KV heads of head_dim 128 with q/k norms
(the qwen3 family's block), vocab 151936 with an untied head, every block's MLP
an MoE of 128 experts, top-8, expert hidden 768, renormalised
(benchmarks/moe_blocks.py). It is the qwen3_8b recipe (bf16 weights and
compute, AdamW with float32 master weights, sequences of 4096) reshaped, with
`model.mlp_hidden` = 8 x 768 so that the planner's FLOP count (models/flops.py
reads the dense spec) is the experts' active FLOPs (the router's are left out).
The layer stack is one scanned body, so 48 layers compile as fast as 4; no
extrapolation. Each dispatch is its own block class (--dispatch); the default
is dropless by blocks (dropless by ragged_dot expands to [tokens x 8, 128, 2048]
on a GPU: BENCHMARKS.md "MoE dispatches").

Run:  .venv/bin/python benchmarks/host_experts.py [--layers 48] [--dispatch dropless_blocked]
      [--micro-batch 1] [--grad-accum 1] [--activations recompute_all] [--placements A,B] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from spillway.recipes.targets import DEFAULT_GPU

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

GiB = 2**30
# placement -> (optimizer_state, params)
PLACEMENTS = {
    "all_device": ("device", "device"),
    "state_host": ("host", "device"),
    "experts_host": ("host", "experts"),
    "params_host": ("host", "host"),
}


def qwen3_30b_a3b_shaped(layers: int, dispatch: str, micro_batch: int, grad_accum: int, activations: str):
    from benchmarks.moe_blocks import block_path
    from spillway.recipes.registry import get_recipe
    return get_recipe("qwen3_8b", [
        "model.d_model=2048", f"model.num_layers={layers}", "model.num_heads=32", "model.num_kv_heads=4",
        "model.head_dim=128", "model.vocab_size=151936", "model.tie_embeddings=false",
        f"model.mlp_hidden={8 * 768}", f"block={block_path('qwen3_30b_a3b', dispatch)}",
        f"train.global_batch={micro_batch * grad_accum}", f"train.grad_accum={grad_accum}",
        f"offload.activations={activations}"])


def parameter_bytes(recipe) -> dict[str, int]:
    """Bytes of the routed experts' weights and of every other parameter (the recipe's param dtype)."""
    import jax
    from flax import nnx

    from spillway.layers.host_weights import is_expert_weight
    from spillway.recipes.train.step import abstract_model
    found = {"experts": 0, "other": 0, "expert_params": 0, "params": 0}
    for var in jax.tree.leaves(abstract_model(recipe)[1], is_leaf=lambda x: isinstance(x, nnx.Variable)):
        value = var.get_value()
        key = "experts" if is_expert_weight(var.get_metadata().get("logical_axes")) else "other"
        found[key] += value.size * value.dtype.itemsize
        found["params"] += value.size
        found["expert_params"] += value.size if key == "experts" else 0
    return found


def measure(args) -> dict:
    from spillway.recipes.plan import planner
    from spillway.recipes.plan.candidates import Candidate

    recipe = qwen3_30b_a3b_shaped(args.layers, args.dispatch, args.micro_batch, args.grad_accum, args.activations)
    names = args.placements.split(",") if args.placements else list(PLACEMENTS)
    plans = [Candidate.of(args.activations, *PLACEMENTS[name]) for name in names]
    result = planner.plan(recipe, DEFAULT_GPU, 1, plans=plans, prune=False, workers=args.workers)
    rows = {}
    for name, row in zip(names, result.rows, strict=True):
        entry = row.to_dict()
        entry.pop("report", None)
        entry.pop("flops", None)
        rows[name] = entry
    return {"recipe": {"layers": args.layers, "dispatch": args.dispatch, "micro_batch": args.micro_batch,
                       "seq_len": recipe.data.seq_len, "grad_accum": args.grad_accum,
                       "activations": args.activations},
            "parameters": parameter_bytes(recipe), "hbm_limit_bytes": result.hbm_limit_bytes,
            "host_ram_bytes": result.host_ram_bytes, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--dispatch", default="dropless_blocked", choices=("dropless", "dropless_blocked", "capacity"))
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences of 4096 tokens per micro-batch")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--activations", default="recompute_all")
    parser.add_argument("--placements", default=None, help=f"comma-separated of {list(PLACEMENTS)}")
    parser.add_argument("--workers", type=int, default=1, help="compile processes at once")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(args)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    p = result["parameters"]
    print(f"Qwen3-30B-A3B-shaped, {args.layers} layers, {args.dispatch}, {args.micro_batch} x 4096 tokens per "
          f"micro-batch, grad_accum {args.grad_accum}, {args.activations}: {p['params'] / 1e9:.2f} B parameters "
          f"({p['expert_params'] / 1e9:.2f} B in experts); weights {p['experts'] / GiB:.1f} GiB experts + "
          f"{p['other'] / GiB:.1f} GiB rest")
    print(f"limits: HBM {result['hbm_limit_bytes'] / GiB:.1f} GiB, host RAM {result['host_ram_bytes'] / GiB:.1f} GiB")
    for name, row in result["rows"].items():
        if row["error"]:
            print(f"{name:13s} ERROR {row['error'][:200]}")
            continue
        peak = row["host_peak"]
        print(f"{name:13s} HBM {row['hbm_bytes'] / GiB:7.1f} GiB  step host {row['host_bytes'] / GiB:7.1f} GiB  "
              f"host peak {peak['bytes'] / GiB:7.1f} GiB ({peak['phase']})  step {row['step_s']:.2f} s "
              f"(fwd {row['forward_s']:.2f}, bwd {row['backward_s']:.2f}, update {row['update_s']:.2f})  "
              f"{'fits' if row['fits'] else 'does not fit: ' + row['why_not']}")


if __name__ == "__main__":
    main()
