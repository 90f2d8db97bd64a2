"""RMSNorm (Zhang & Sennrich, 2019), computed in float32 whatever the input dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from layers import names
from layers.params import ones, param


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float = 1e-5, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = param(rngs, ones, (dim,), (names.NORM,), param_dtype)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        # Statistics in fp32: bf16 mean-of-squares loses too much precision.
        x32 = x_btd.astype(jnp.float32)
        inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * inv_rms * self.scale[...].astype(jnp.float32)).astype(x_btd.dtype)
