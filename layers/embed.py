"""Token embedding, learned absolute position embedding (GPT-2), and the output head (tied or separate)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from spillway.layers import names
from spillway.layers.names import RESIDUAL_AXES
from spillway.layers.params import normal, param
from spillway.layers.sharding import constrain

_LOGITS_AXES = (names.BATCH, names.SEQ, names.ACT_VOCAB)


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, d_model: int, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 init_std: float = 0.02, rngs: nnx.Rngs):
        self.vocab_size = vocab_size
        self.dtype = dtype
        self.table = param(rngs, normal(init_std), (vocab_size, d_model), (names.VOCAB, names.EMBED), param_dtype,
                           weight_decay=False)

    def __call__(self, tokens_bt: jax.Array) -> jax.Array:
        return constrain(jnp.take(self.table[...], tokens_bt, axis=0).astype(self.dtype), RESIDUAL_AXES)

    def attend(self, x_btd: jax.Array) -> jax.Array:
        """Tied output head: logits = x @ table^T."""
        return constrain(x_btd.astype(self.dtype) @ self.table[...].astype(self.dtype).T, _LOGITS_AXES)


class PositionEmbedding(nnx.Module):
    """A learned vector per absolute position, added to the token embedding (GPT-2's wpe)."""

    def __init__(self, max_positions: int, d_model: int, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 init_std: float = 0.02, rngs: nnx.Rngs):
        self.dtype = dtype
        # Positions are few: the table is not split over the vocabulary axis.
        self.table = param(rngs, normal(init_std), (max_positions, d_model), (None, names.EMBED), param_dtype,
                           weight_decay=False)

    def __call__(self, positions_bt: jax.Array) -> jax.Array:
        return constrain(jnp.take(self.table[...], positions_bt, axis=0).astype(self.dtype), RESIDUAL_AXES)


class LMHead(nnx.Module):
    def __init__(self, d_model: int, vocab_size: int, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 init_std: float = 0.02, rngs: nnx.Rngs):
        self.dtype = dtype
        self.w = param(rngs, normal(init_std), (d_model, vocab_size), (names.EMBED, names.VOCAB), param_dtype)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        return constrain(x_btd.astype(self.dtype) @ self.w[...].astype(self.dtype), _LOGITS_AXES)
