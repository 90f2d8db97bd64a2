#!/usr/bin/env python
"""One plan compiled for a GPU without the GPU, and the planner's turn search on it: the recipe's own offload
settings (with --set) as the only candidate, then, when it streams block weights, the same plan with some of
them kept in HBM across the turn (offload.params_keep; recipes/plan/turn_search.py). A few compiles instead
of a whole `spillway plan`, for a plan already picked.

Run:  .venv/bin/python benchmarks/plan_turn.py RECIPE [--gpu h200] [--devices 1] [--set A.B=VALUE ...] [--json PATH]
e.g.  .venv/bin/python benchmarks/plan_turn.py llama3_8b_offload --set train.global_batch=8 \\
          --set train.grad_accum=8 --set offload.activations=save_all \\
          --set offload.optimizer_state=host:25 --set offload.params=host:25
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from spillway.recipes.targets import DEFAULT_GPU  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("--gpu", default=DEFAULT_GPU)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], metavar="A.B=VALUE")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the plan's JSON there")
    args = parser.parse_args(argv)

    from spillway.recipes.plan.candidates import Candidate
    from spillway.recipes.plan.planner import plan
    from spillway.recipes.plan.render import render
    from spillway.recipes.user_recipes import load_recipe

    recipe = load_recipe(args.recipe, args.set)
    result = plan(recipe, args.gpu, args.devices, plans=[Candidate.of_recipe(recipe)], cache=False, turn=True)
    result.recipe_ref, result.user_sets = args.recipe, list(args.set)   # for the command that trains the pick
    print(render(result))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result.to_dict(), out, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
