"""Token embedding and the output head (tied to the embedding or separate)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from layers import names
from layers.params import normal, param


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, d_model: int, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 init_std: float = 0.02, rngs: nnx.Rngs):
        self.vocab_size = vocab_size
        self.dtype = dtype
        self.table = param(rngs, normal(init_std), (vocab_size, d_model), (names.VOCAB, names.EMBED), param_dtype)

    def __call__(self, tokens_bt: jax.Array) -> jax.Array:
        return jnp.take(self.table[...], tokens_bt, axis=0).astype(self.dtype)

    def attend(self, x_btd: jax.Array) -> jax.Array:
        """Tied output head: logits = x @ table^T."""
        return x_btd.astype(self.dtype) @ self.table[...].astype(self.dtype).T


class LMHead(nnx.Module):
    def __init__(self, d_model: int, vocab_size: int, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 init_std: float = 0.02, rngs: nnx.Rngs):
        self.dtype = dtype
        self.w = param(rngs, normal(init_std), (d_model, vocab_size), (names.EMBED, names.VOCAB), param_dtype)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        return x_btd.astype(self.dtype) @ self.w[...].astype(self.dtype)
