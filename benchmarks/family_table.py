#!/usr/bin/env python
"""One row per model family at a published size: HBM and host memory of its train step on one GPU, deviceless.

For each family's GPU recipe (one sequence of 8192 tokens; 1024 for GPT-2,
the length of its learned position table) the planner (recipes/plan/planner.py)
compiles the real train step for the target GPU with XLA's GPU compiler and
no GPU (docs/DESIGN.md section 5), once per candidate plan, and judges each
against 0.9 x the GPU's memory. The table sets two of those compiles side by
side:

    baseline   recompute_all with the optimizer state in HBM: what a run
               without offload support would use to save memory;
    pick       the plan the planner picks: the fastest estimated step among
               the candidates that fit (it may keep more in HBM than the
               baseline when that is faster and still fits).

Columns: parameters (counted from the shapes), HBM and host GiB per GPU
(argument + output - alias + temp bytes of the compiled step), the
planner's estimated step time (compute at peak and host-link transfers,
a lower bound), and the `spillway plan` command that shows the row's full
candidate table. Nothing is allocated and no GPU is needed; the compiles take
about a minute per family on an idle 2-core machine.

Run:  .venv/bin/python benchmarks/family_table.py [--gpu h200] [--recipes gpt2_124m,qwen3_0_6b] [--workers N]

GiB = 2^30 bytes.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

from spillway.recipes.targets import DEFAULT_GPU

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

GiB = 2**30
BASELINE = ("recompute_all", "device")

# (recipe, published model, sequence length): one family per row, at a published size.
ROWS = (
    ("gpt2_124m", "GPT-2 124M", 1024),        # 1024 learned positions: its longest sequence
    ("llama3_1b", "Llama 3.2 1B", 8192),
    ("llama3_8b", "Llama 3.1 8B", 8192),
    ("mistral_7b", "Mistral 7B v0.3", 8192),
    ("qwen2_5_1_5b", "Qwen2.5 1.5B", 8192),
    ("qwen3_0_6b", "Qwen3 0.6B", 8192),
    ("qwen3_8b", "Qwen3 8B", 8192),
    ("gemma2_2b", "Gemma 2 2B", 8192),
    ("gemma3_1b", "Gemma 3 1B", 8192),
    ("qwen3_30b_a3b", "Qwen3-30B-A3B", 8192),   # mixture of experts: 30.5B parameters, 3.4B active
    ("mixtral_8x7b", "Mixtral 8x7B", 8192),     # 46.7B parameters, 12.9B active (one GPU: nothing fits)
)
HEADER = ("| family | model | params | recompute_all / opt device: HBM GiB | step ms | picked plan | HBM GiB "
          "| host GiB | step ms | HBM saved | command |")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpu", default=DEFAULT_GPU)
    parser.add_argument("--recipes", default=",".join(name for name, _, _ in ROWS),
                        help="comma-separated subset of the rows' recipes")
    parser.add_argument("--workers", type=int, default=None, help="compile processes at once (planner default)")
    args = parser.parse_args(argv)
    known = {name for name, _, _ in ROWS}
    args.recipes = [name.strip() for name in args.recipes.split(",") if name.strip()]
    unknown = set(args.recipes) - known
    if unknown:
        parser.error(f"unknown recipes {sorted(unknown)}; the rows are {sorted(known)}")
    return args


def row_overrides(seq_len: int) -> list[str]:
    # model.max_seq_len too: the Qwen recipes train at 4096 tokens, and their models take 8192 (RoPE).
    return ["train.global_batch=1", "train.grad_accum=1", f"data.seq_len={seq_len}", f"model.max_seq_len={seq_len}"]


def plan_row(recipe_name: str, model: str, seq_len: int, gpu: str, workers: int | None) -> str:
    """Plan one recipe at batch 1 x seq_len on one GPU; its markdown row."""
    from spillway.recipes.plan.planner import plan
    from spillway.recipes.registry import get_recipe

    overrides = row_overrides(seq_len)
    started = time.perf_counter()
    result = plan(get_recipe(recipe_name, overrides), gpu, 1, workers=workers)
    print(f"{recipe_name}: {result.timing['compiles']} compiles in {time.perf_counter() - started:.0f} s",
          file=sys.stderr, flush=True)
    baseline = next(row for row in result.rows
                    if (row.candidate.activations, row.candidate.optimizer_state) == BASELINE)
    picked = result.picked
    command = f"`spillway plan {recipe_name} --gpu {gpu} " + " ".join(f"--set {o}" for o in overrides) + "`"
    base_hbm = _gib(baseline.report and baseline.report["hbm_bytes"])
    if not baseline.fits:
        base_hbm += f" (does not fit: {baseline.why_not})"
    cells = [result.recipe.family, f"{model} (`{recipe_name}`)", f"{result.recipe.num_params() / 1e9:.3f} B",
             base_hbm, _ms(baseline.step_s)]
    if picked is None:
        cells += ["none fits", "-", "-", "-", "-"]
    else:
        saved = (baseline.report["hbm_bytes"] - picked.report["hbm_bytes"]) / GiB if baseline.report else None
        cells += [f"{picked.candidate.activations} / opt {picked.candidate.optimizer_state}",
                  _gib(picked.report["hbm_bytes"]), _gib(picked.report["host_bytes"]), _ms(picked.step_s),
                  "-" if saved is None else f"{saved:.2f}"]
    return "| " + " | ".join(cells + [command]) + " |"


def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def main(argv=None) -> int:
    args = parse_args(argv)
    by_name = {name: (model, seq) for name, model, seq in ROWS}
    started = time.perf_counter()
    rows = [plan_row(name, *by_name[name], args.gpu, args.workers) for name in args.recipes]
    print(f"Families on one {args.gpu.upper()}, batch 1, deviceless compiles "
          f"({datetime.date.today().isoformat()}, {time.perf_counter() - started:.0f} s)\n")
    print(HEADER)
    print("|" + "---|" * HEADER.count(" | ") + "---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
