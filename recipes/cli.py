"""The `spillway` command: list recipes, train, sample from a checkpoint, plan memory for a GPU.

    spillway recipes
    spillway train tiny [--set train.steps=100 ...] [--plan auto --gpu h200]
    spillway generate runs/tiny --prompt "def " [--tokens 100 --temperature 0.8 --top-p 0.95]
    spillway plan llama3_8b --gpu h200 [--devices N] [--hbm-budget GIB] [--png PATH] [--json]
"""

from __future__ import annotations

import argparse
import sys


def _cmd_recipes(args) -> int:
    from spillway.recipes.registry import get_recipe, recipe_names
    for name in recipe_names():
        recipe = get_recipe(name)
        print(f"{name:20s} {recipe.family:8s} {recipe.num_params() / 1e6:9.1f}M  {recipe.description}")
    return 0


def _cmd_train(args) -> int:
    from spillway.recipes.registry import get_recipe
    recipe = get_recipe(args.recipe, args.set)
    if args.plan:
        from spillway.recipes.plan.planner import apply_plan
        recipe = apply_plan(recipe, args.plan, gpu=args.gpu, devices=args.devices)
    from spillway.recipes.train.loop import train
    train(recipe, stop_after=args.stop_after)
    return 0


def _cmd_generate(args) -> int:
    from spillway.recipes.generate import generate_from_checkpoint
    text = generate_from_checkpoint(args.checkpoint, args.prompt, max_new_tokens=args.tokens,
                                    temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    print(text)
    return 0


def _cmd_plan(args) -> int:
    from spillway.recipes.plan.planner import plan_command
    return plan_command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spillway", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("recipes", help="list the registered recipes")
    p.set_defaults(fn=_cmd_recipes)

    p = sub.add_parser("train", help="train a recipe")
    p.add_argument("recipe")
    p.add_argument("--set", action="append", default=[], metavar="A.B=VALUE", help="override a recipe field")
    p.add_argument("--plan", choices=["auto"], help="pick the offload plan with `spillway plan` first")
    p.add_argument("--gpu", default="h200", help="target GPU for --plan auto")
    p.add_argument("--devices", type=int, default=None, help="GPUs for --plan auto (default: the mesh's)")
    p.add_argument("--stop-after", type=int, default=None, metavar="N",
                   help="save and leave after N steps of this invocation (time-limited jobs); rerun to resume")
    p.set_defaults(fn=_cmd_train)

    p = sub.add_parser("generate", help="sample text from a checkpoint")
    p.add_argument("checkpoint", help="a run directory (latest step) or a checkpoint step directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=_cmd_generate)

    p = sub.add_parser("plan", help="HBM, host memory and transfer cost of a recipe on a GPU, without the GPU")
    p.add_argument("recipe")
    p.add_argument("--gpu", default="h200")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--set", action="append", default=[], metavar="A.B=VALUE")
    p.add_argument("--host-ram-gb", type=float, default=None, help="host RAM available for pinned memory")
    p.add_argument("--headroom", type=float, default=0.9, help="fraction of HBM a plan may use")
    p.add_argument("--hbm-budget", type=float, default=None, metavar="GIB",
                   help="HBM per GPU a plan may use, in GiB (with the headroom, the lower limit wins); "
                        "picks the fastest plan under it, or fails naming the smallest plan")
    p.add_argument("--host-update-rate", type=float, default=None, metavar="PARAMS_PER_S",
                   help="host CPU optimizer-update rate per core for host_compute plans (default: the file "
                        "benchmarks/host_update_rate.py wrote, else a measured default)")
    p.add_argument("--host-cores", type=float, default=None, metavar="N",
                   help="host CPU cores per GPU for the host update (default 8)")
    p.add_argument("--png", default=None, metavar="PATH",
                   help="also draw the plan table (HBM, host bytes, limits, step time) to PATH")
    p.add_argument("--search", choices=["seq_len", "batch"], default=None,
                   help="also find the longest sequence / largest batch that fits per plan")
    p.add_argument("--json", action="store_true")
    p.add_argument("--workers", type=int, default=None,
                   help="compile processes at once (default: one per core, at most 4)")
    p.set_defaults(fn=_cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"spillway {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
