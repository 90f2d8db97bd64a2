"""The GPU recipes' planner picks, run for real: each one-H200 recipe's own micro-batch and offload settings,
its measured peak HBM and step time beside the deviceless plan's figures. One call, a few minutes on one H200.

    python -m benchmarks.recipe_picks --predict   # here, on a CPU machine: the plan's figures for each case
                                                  #   -> benchmarks/recipe_picks_predicted.json (commit it)
    python -m benchmarks.recipe_picks             # on the GPU machine: measure every case, print the table

A recipe's offload settings are what `spillway plan NAME` picks on its GPUs
(tests/recipes/test_gpu_recipes.py checks that deviceless); this checks that
the pick fits and what it costs on the GPU itself. Cases: every recipe whose
offload.target_gpu is one H200. Each step runs two micro-batches of the
recipe's size (global_batch / grad_accum sequences) instead of all of its
accumulation: memory is that of one micro-batch either way, and the time of a
full step is grad_accum / 2 times the measured one. Tokens are random (the
GPU machine has no corpus; data does not change step time or memory); each
case runs in its own process (benchmarks/gpu_suite.py `measure_case`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from spillway.recipes.targets import DEFAULT_GPU

PREDICTIONS = Path(__file__).with_name("recipe_picks_predicted.json")
MICRO_BATCHES = 2


def cases() -> dict[str, tuple[str, list[str]]]:
    """recipe name -> (recipe, the overrides that make its step two of its own micro-batches)."""
    from spillway.recipes.registry import get_recipe, recipe_names

    out = {}
    for name in recipe_names():
        recipe = get_recipe(name)
        if recipe.offload.target_gpu != DEFAULT_GPU or recipe.offload.target_devices != 1:
            continue
        micro = recipe.train.global_batch // recipe.train.grad_accum
        out[name] = (name, [f"train.global_batch={MICRO_BATCHES * micro}", f"train.grad_accum={MICRO_BATCHES}"])
    return out


def does_not_fit_the_gpu_machine(name: str) -> str | None:
    """Why a case cannot run on the GPU machine (one H200, 128 GiB of host RAM), judged from shapes before any
    process takes the GPU, or None: the host memory its state creation holds (recipes/train/host_memory.py,
    with the process's assumed footprint), by benchmarks/gpu_suite.py's host check. qwen3_30b_a3b's state
    alone is 341 GiB; a case started anyway would die of host memory without a word, as the 8B host-state
    cases once did."""
    import dataclasses

    from benchmarks.gpu_suite import host_fit
    from spillway.recipes.registry import get_recipe
    from spillway.recipes.train.host_memory import ASSUMED_GPU_FOOTPRINT_BYTES, phases_of_recipe

    recipe_name, overrides = cases()[name]
    phases = dataclasses.replace(phases_of_recipe(get_recipe(recipe_name, overrides)),
                                 footprint=ASSUMED_GPU_FOOTPRINT_BYTES)
    return host_fit(phases.by_phase(), judged=("state creation",))[2] or None


def predict() -> None:
    from spillway.recipes.plan.commands import predict_cases
    PREDICTIONS.write_text(json.dumps(predict_cases(cases(), gpu=DEFAULT_GPU), indent=2, sort_keys=True) + "\n")
    print(f"wrote {PREDICTIONS}")


def measure(name: str) -> dict:
    """Child process: the case's step on this GPU (benchmarks/gpu_suite.py measure_case)."""
    from benchmarks.gpu_suite import Case, measure_case
    from spillway.recipes.registry import get_recipe

    recipe_name, overrides = cases()[name]
    recipe = get_recipe(recipe_name, overrides)
    case = Case(recipe_name, recipe.offload.activations, recipe.offload.optimizer_state, recipe.data.seq_len)
    result = measure_case(name, warmup=1, timed=3, case=case,
                          extra_overrides=(*overrides, f"model.max_seq_len={recipe.model.max_seq_len}"))
    return {**result, "plan": f"{recipe.offload.activations} / opt state {recipe.offload.optimizer_state}",
            "micro_batch": recipe.train.global_batch // MICRO_BATCHES}


def render(rows: list[dict], predictions: dict) -> str:
    gib = 2**30
    lines = [f"\n{'recipe':14s} {'plan':34s} {'micro':>5s} {'pred HBM':>9s} {'peak HBM':>9s} {'peak/pred':>9s} "
             f"{'step ms':>8s} {'pred ms':>8s} {'MFU':>6s}"]
    for r in rows:
        pred = predictions.get(r["case"], {})
        if "error" in r:
            lines.append(f"{r['case']:14s} {r['error']} {r.get('detail', '')[:100]}")
            continue
        peak, hbm = r["peak_bytes_in_use"], pred.get("hbm_bytes")
        lines.append(f"{r['case']:14s} {r['plan']:34s} {r['micro_batch']:5d} {(hbm or float('nan')) / gib:8.2f}G "
                     f"{(peak or float('nan')) / gib:8.2f}G {(peak / hbm if peak and hbm else float('nan')):9.3f} "
                     f"{r['step_s'] * 1e3:8.1f} {(pred.get('step_s') or float('nan')) * 1e3:8.1f} {r['mfu']:6.1%}")
    return "\n".join(lines)


def main() -> int:
    from benchmarks.gpu_suite import run_child

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--predict", action="store_true", help="the plan's figures (CPU machine)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--timeout-s", type=float, default=150.0, help="per case")
    args = parser.parse_args()
    if args.predict:
        predict()
        return 0
    if args.child:
        print(json.dumps(measure(args.child)), flush=True)
        return 0
    predictions = json.loads(PREDICTIONS.read_text()) if PREDICTIONS.exists() else {}
    rows = []
    for name in cases():
        why_not = does_not_fit_the_gpu_machine(name)
        if why_not:
            rows.append({"case": name, "error": f"skipped: does not fit ({why_not})"})
            continue
        rows.append(run_child(name, timeout_s=args.timeout_s, module="benchmarks.recipe_picks"))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(render(rows, predictions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
