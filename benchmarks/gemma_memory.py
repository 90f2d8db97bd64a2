#!/usr/bin/env python
"""Gemma 2 9B and Gemma 3 12B at 8192 tokens on one H200, deviceless: HBM and host memory per plan.

For each model, the real train step (one 8192-token sequence per micro-batch,
grad_accum 8, bf16 weights with fp32 master copies, flash attention) is
compiled by the planner (recipes/plan/planner.py) for one H200 under a few
activation plans, each with the optimizer state in HBM and in pinned host
memory; then the longest sequence that fits is searched for recompute_all
with the state on device and in host memory, and for offload_inputs with the
state in host memory; then the compile seconds of the step at two depths (the
preset's, and a quarter of it), which the one-body scan keeps about equal.

    .venv/bin/python -m benchmarks.gemma_memory [--models gemma2_9b,gemma3_12b] [--no-search] [--json]

The models are the `gemma2_2b` recipe reshaped to the 9B preset and the
`gemma3_12b` recipe, both at 8192 tokens (`MODELS` lists the --set overrides,
so each row can be reproduced with `spillway plan ... --set ...`).
"""

from __future__ import annotations

import argparse
import json
import sys

from spillway.recipes.targets import DEFAULT_GPU

GiB = 2**30
STEP = ["data.seq_len=8192", "train.global_batch=8", "train.grad_accum=8", "model.max_seq_len=131072"]
MODELS = {
    "gemma2_9b": ("gemma2_2b", ["model.d_model=3584", "model.num_layers=42", "model.num_heads=16",
                                "model.num_kv_heads=8", "model.mlp_hidden=14336", *STEP]),
    "gemma3_12b": ("gemma3_12b", STEP),
}
PLANS = [("save_dots", "device"), ("recompute_all", "device"), ("offload_inputs", "device"),
         ("save_dots", "host"), ("recompute_all", "host"), ("offload_inputs", "host"), ("offload_dots", "host")]
SEARCHED = [("recompute_all", "device"), ("recompute_all", "host"), ("offload_inputs", "host")]


def _recipe(name: str, extra=()):
    from spillway.recipes.registry import get_recipe
    base, overrides = MODELS[name]
    return get_recipe(base, [*overrides, *extra])


def measure(names: list[str], search: bool) -> dict:
    from spillway.recipes.plan import planner
    from spillway.recipes.plan.candidates import Candidate

    out = {}
    for name in names:
        recipe = _recipe(name)
        table = planner.plan(recipe, DEFAULT_GPU, 1, workers=1, prune=False,
                             plans=[Candidate.of(a, o) for a, o in PLANS])
        rows = [{"plan": f"{r.candidate.activations} / opt {r.candidate.optimizer_state}",
                 "hbm_gib": None if r.report is None else r.report["hbm_bytes"] / GiB,
                 "host_gib": None if r.report is None else r.report["host_bytes"] / GiB,
                 "fits": r.fits, "error": r.error} for r in table.rows]
        entry = {"params": recipe.num_params(), "layers": recipe.model.num_layers, "rows": rows,
                 "pick": None if table.picked is None else table.picked.candidate.label}
        if search:
            searched = planner.plan(recipe, DEFAULT_GPU, 1, workers=1, prune=False, search="seq_len",
                                    plans=[Candidate.of(a, o) for a, o in SEARCHED])
            entry["longest_seq_len"] = {f"{r['activations']} / opt {r['optimizer_state']}": r["best"]
                                        for r in searched.search["results"]}
        seconds = {}
        for layers in (recipe.model.num_layers // 4, recipe.model.num_layers):
            shallow = _recipe(name, [f"model.num_layers={layers}"])
            timed = planner.plan(shallow, DEFAULT_GPU, 1, workers=1, prune=False,
                                 plans=[Candidate.of("recompute_all", "device")])
            seconds[layers] = timed.rows[0].compile_s
        entry["compile_seconds"] = seconds
        out[name] = entry
    return out


def render(result: dict) -> str:
    lines = []
    for name, entry in result.items():
        lines.append(f"{name}: {entry['params'] / 1e9:.3f}B params, {entry['layers']} layers; 8192 tokens x 1 "
                     f"per micro-batch, one H200 (126.9 GiB usable); pick: {entry['pick']}")
        lines.append("| plan | HBM GiB | host GiB | fits |")
        lines.append("|---|---|---|---|")
        for row in entry["rows"]:
            if row["error"]:
                lines.append(f"| {row['plan']} | error: {row['error'][:80]} | | |")
                continue
            lines.append(f"| {row['plan']} | {row['hbm_gib']:.2f} | {row['host_gib']:.2f} | "
                         f"{'yes' if row['fits'] else 'no'} |")
        for plan, best in entry.get("longest_seq_len", {}).items():
            lines.append(f"longest sequence that fits, {plan}: {best}")
        lines.append("compile seconds of the step (recompute_all / opt device): " + ", ".join(
            f"{layers} layers {s:.1f} s" for layers, s in entry["compile_seconds"].items()))
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--no-search", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(args.models.split(","), not args.no_search)
    print(json.dumps(result, indent=2) if args.json else render(result))


if __name__ == "__main__":
    sys.exit(main())
