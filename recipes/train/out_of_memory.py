"""Running out of memory with the user's own settings: a RunError naming those settings and the bytes.

An allocation XLA cannot make (`RESOURCE_EXHAUSTED: Out of memory allocating
N bytes`, on a GPU or on the host) or a host allocation numpy cannot make
(MemoryError) is not a bug to report: the recipe asks for more than the
machine has. The message names what decides the memory (parameters and the
model fields behind them, the batch and sequence, the micro-batches, the
offload plan), the bytes asked for, and `spillway plan`, which prices a
setting on the target GPU without running it.
"""

from __future__ import annotations

import re

from spillway.recipes.config import Recipe
from spillway.recipes.train.errors import RunError


class OutOfMemoryError(RunError):
    """The recipe's settings need more memory than the machine has."""


def is_out_of_memory(error: BaseException) -> bool:
    from spillway.layers.errors import SpillwayError

    if isinstance(error, SpillwayError):   # already says what to do (e.g. HostMemoryError's breakdown)
        return False
    if isinstance(error, MemoryError):
        return True
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text and "memory" in text.lower()


def out_of_memory_error(recipe: Recipe, error: BaseException, platform: str) -> OutOfMemoryError:
    asked = re.search(r"(\d{3,}) bytes", str(error))
    amount = f"{int(asked.group(1)):,} bytes ({int(asked.group(1)) / 2**30:.1f} GiB) asked for" if asked \
        else "an allocation failed"
    model, train, data, offload = recipe.model, recipe.train, recipe.data, recipe.offload
    fields = [f"{name}={getattr(model, name)}" for name in ("num_layers", "d_model", "vocab_size")
              if hasattr(model, name)]
    where = "the host" if isinstance(error, MemoryError) or platform == "cpu" else f"the {platform} device"
    return OutOfMemoryError(
        f"out of memory on {where} ({amount}): this recipe's own settings need more than it has: "
        f"{recipe.num_params() / 1e6:,.1f}M parameters ({', '.join(fields)}), train.global_batch="
        f"{train.global_batch} x data.seq_len={data.seq_len} in train.grad_accum={train.grad_accum} "
        f"micro-batches, offload.activations={offload.activations}, offload.optimizer_state="
        f"{offload.optimizer_state}; lower them (or offload more), and price a setting before running it with "
        f"`spillway plan {recipe.name} --set ...`")
