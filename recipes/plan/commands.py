"""The planner's entry points: `spillway plan`, `spillway train --plan auto`, and the benchmarks' predictions."""

from __future__ import annotations

import json
import math
import sys

import jax

from spillway.recipes.config import Recipe
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.plan.chart import draw_plan
from spillway.recipes.plan.planner import plan
from spillway.recipes.plan.preflight import check_image_path
from spillway.recipes.plan.render import ms_text, render
from spillway.recipes.plan.result import GiB, choose
from spillway.recipes.registry import get_recipe
from spillway.recipes.targets import DEFAULT_GPU, HBM_HEADROOM
from spillway.recipes.user_recipes import load_recipe


# `--set` lines naming a placement the user wants priced: the table holds it beside the candidates.
OWN_PLAN_SETTINGS = ("offload.", "optimizer.update_on_host")


def plan_command(args) -> int:
    """`spillway plan`: print the table (or --json), and draw it with --png.

    Nothing fits: the table, then ValueError naming why (exit 2), so a script sees it; under --hbm-budget, which
    asks for a plan, the same.
    """
    recipe = load_recipe(args.recipe, args.set)   # a registered name, a recipe.json, or module:function
    if getattr(args, "png", None) is not None:   # (an empty one too: an unset shell variable, said)
        check_image_path(args.png, "--png")   # its folder and its format, before minutes of compiles
    budget = getattr(args, "hbm_budget", None)
    result = plan(recipe, args.gpu, args.devices, headroom=args.headroom, host_ram_gb=args.host_ram_gb,
                  hbm_budget_gib=budget, host_update_rate=getattr(args, "host_update_rate", None),
                  host_cores_per_gpu=getattr(args, "host_cores", None), search=args.search, workers=args.workers,
                  prune=not getattr(args, "all_plans", False), cache=not getattr(args, "no_cache", False),
                  with_own=any(item.strip().startswith(OWN_PLAN_SETTINGS) for item in args.set))
    result.recipe_ref, result.user_sets = args.recipe, list(args.set)   # for the command that trains the pick
    if args.json:
        json.dump(result.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render(result))
    if getattr(args, "png", None):
        drawn = draw_plan(result, args.png)
        print(f"plan chart: {drawn}", file=sys.stderr if args.json else sys.stdout)   # --json: stdout is JSON
    choose(result)   # no pick (under a budget, or at all) is an error naming why, after the table
    return 0


def apply_plan(recipe: Recipe, how: str = "auto", *, gpu: str = DEFAULT_GPU, devices: int | None = None,
               headroom: float = HBM_HEADROOM, host_ram_gb: float | None = None, echo=print) -> Recipe:
    """The recipe with the picked plan's offload settings, or ValueError with the numbers if none fits."""
    if how != "auto":
        raise ValueError(f"--plan must be 'auto', got {how!r}")
    if devices is None:
        devices = default_devices(recipe)
    result = plan(recipe, gpu, devices, headroom=headroom, host_ram_gb=host_ram_gb)
    picked = choose(result)
    r = picked.report
    echo(f"plan auto: {picked.candidate.label}: HBM {r['hbm_bytes'] / GiB:.2f} GiB of "
         f"{result.hbm_limit_bytes / GiB:.2f} GiB, host {r['host_bytes'] / GiB:.2f} GiB per GPU, "
         f"estimated step {ms_text(picked.step_s)} ms on {devices} x {result.target.display_name} "
         f"({result.timing['compiles']} compiles, {result.timing['total_s']:.0f} s)")
    for warning in result.warnings:
        echo(f"plan auto: warning: {warning}")
    return picked.candidate.applied_to(recipe)


def default_devices(recipe: Recipe) -> int:
    """The mesh's GPU count when fully given; else every device this process sees."""
    sizes = recipe.mesh.sizes().values()
    if all(size > 0 for size in sizes):
        return math.prod(sizes)
    return jax.device_count()


def predict_cases(cases: dict[str, tuple[str, list[str]]], gpu: str = DEFAULT_GPU, devices: int = 1) -> dict:
    """Deviceless figures for named (recipe, --set overrides) cases, each compiled with its own plan.

    For benchmarks/gpu_suite.py: the predictions a GPU run is compared with.
    """
    out = {}
    for name, (recipe_name, overrides) in cases.items():
        recipe = get_recipe(recipe_name, overrides)
        row = plan(recipe, gpu, devices, plans=[Candidate.of_recipe(recipe)]).rows[0]
        out[name] = {"error": row.error} if row.report is None else {
            "hbm_bytes": row.report["hbm_bytes"], "host_bytes": row.report["host_bytes"],
            "fits": row.fits, "compute_s": row.compute_s, "transfer_s": row.transfer_s, "step_s": row.step_s}
    return out
