"""Parameter creation with the metadata every spillway layer attaches.

`param(rngs, init, shape, logical_axes, dtype)` makes an `nnx.Param` whose
`logical_axes` metadata names each dimension (layers/names.py). Sharding rules
(layers/sharding.py) and the optimizer (recipes/optim/optimizer.py) read this
metadata. Two optional keys concern the optimizer: `optimizer_memory`
("device" or "host": where this parameter's state lives, overriding the
recipe) and `weight_decay` (False for norms, biases and embeddings, which the
layers that make them set; the optimizer decays what does not say otherwise).
Layers never decide placement themselves.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx


def param(rngs: nnx.Rngs, init, shape: Sequence[int], logical_axes: Sequence[str | None],
          dtype=jnp.float32, **metadata) -> nnx.Param:
    if len(shape) != len(logical_axes):
        raise ValueError(f"shape {tuple(shape)} and logical_axes {tuple(logical_axes)} differ in rank")
    value = init(rngs.params(), tuple(shape), dtype)
    return nnx.Param(value, logical_axes=tuple(logical_axes), **metadata)


def normal(stddev: float):
    return jax.nn.initializers.normal(stddev)


def ones(key, shape, dtype):
    del key
    return jnp.ones(shape, dtype)


def zeros(key, shape, dtype):
    del key
    return jnp.zeros(shape, dtype)
