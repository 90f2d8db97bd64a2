#!/usr/bin/env python
"""How much of a LoRA run's state the adapters are: parameters and AdamW moments, counted from shapes.

    .venv/bin/python -m benchmarks.lora_share [--recipe llama3_8b] [--rank 16] [--targets q_proj,...]

Builds the recipe's model abstractly with the adapters (nothing is allocated)
and counts the base weights, the adapters, and the float32 moments AdamW keeps
for the adapters against those a full fine-tune keeps for every weight
(BENCHMARKS.md "LoRA").
"""

from __future__ import annotations

import argparse

import jax

ALL_PROJECTIONS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def share(recipe_name: str, rank: int, targets: str) -> dict:
    from spillway.recipes.registry import get_recipe
    from spillway.recipes.train.lora_step import split
    from spillway.recipes.train.step import abstract_model

    recipe = get_recipe(recipe_name, [f"lora.rank={rank}", f"lora.alpha={2 * rank}", f"lora.targets={targets}",
                                      "checkpoint.init_from=hf:BASE"])
    adapters, base = split(abstract_model(recipe)[1])
    count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))  # noqa: E731
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    return {"base_params": count(base), "base_bytes": nbytes(base), "adapter_params": count(adapters),
            "adapter_moments_bytes": 8 * count(adapters), "full_moments_bytes": 8 * count(base)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="llama3_8b")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default=ALL_PROJECTIONS)
    args = parser.parse_args()
    s = share(args.recipe, args.rank, args.targets)
    gib = 2**30
    print(f"{args.recipe}, rank {args.rank} on {args.targets}: base {s['base_params'] / 1e9:.3f}B parameters "
          f"({s['base_bytes'] / gib:.2f} GiB), adapters {s['adapter_params'] / 1e6:.2f}M "
          f"({s['adapter_params'] / s['base_params']:.3%} of the base); AdamW moments (float32) "
          f"{s['adapter_moments_bytes'] / gib:.3f} GiB against {s['full_moments_bytes'] / gib:.1f} GiB for a "
          f"full fine-tune")


if __name__ == "__main__":
    main()
