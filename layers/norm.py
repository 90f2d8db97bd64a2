"""Normalisation layers: RMSNorm (Llama, Mistral, Qwen), Gemma's RMSNorm with a (1 + w) scale, and
LayerNorm with bias (GPT-2).

All compute their statistics in float32 whatever the input dtype (a bf16
mean of squares loses too much precision) and return the input's dtype.
`make_norm(kind, ...)` is the factory blocks and models use, so a config names
the kind ("rms" | "rms_plus_one" | "layer") instead of a class.

"rms_plus_one" is Gemma's RMSNorm (transformers' Gemma2RMSNorm / Gemma3RMSNorm):
x / rms(x) * (1 + w) with w initialised to zeros (so a fresh layer is the
identity scale), the normalisation and the (1 + w) product both in float32 and
the cast to the input dtype last, as Hugging Face does it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from spillway.layers import names
from spillway.layers.params import param, zeros, ones

NORM_KINDS = ("rms", "rms_plus_one", "layer")


class RMSNorm(nnx.Module):
    """x / rms(x) * scale over the last axis; `plus_one`: * (1 + scale) with scale initialised to zeros (Gemma)."""

    def __init__(self, dim: int, *, eps: float = 1e-5, plus_one: bool = False, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.eps = eps
        self.plus_one = plus_one
        self.scale = param(rngs, zeros if plus_one else ones, (dim,), (names.NORM,), param_dtype,
                           weight_decay=False)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        x32 = x_btd.astype(jnp.float32)
        inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        if self.plus_one:
            scale = 1.0 + scale
        return (x32 * inv_rms * scale).astype(x_btd.dtype)


class LayerNorm(nnx.Module):
    """(x - mean) / std * scale + bias over the last axis (Ba et al., 2016)."""

    def __init__(self, dim: int, *, eps: float = 1e-5, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = param(rngs, ones, (dim,), (names.NORM,), param_dtype, weight_decay=False)
        self.bias = param(rngs, zeros, (dim,), (names.NORM,), param_dtype, weight_decay=False)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        x32 = x_btd.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        centred = x32 - mean
        inv_std = jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + self.eps)
        out = centred * inv_std * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return out.astype(x_btd.dtype)


def make_norm(kind: str, dim: int, *, eps: float, param_dtype=jnp.float32, rngs: nnx.Rngs) -> nnx.Module:
    """The norm layer a config names: "rms", "rms_plus_one" or "layer"."""
    if kind in ("rms", "rms_plus_one"):
        return RMSNorm(dim, eps=eps, plus_one=kind == "rms_plus_one", param_dtype=param_dtype, rngs=rngs)
    if kind == "layer":
        return LayerNorm(dim, eps=eps, param_dtype=param_dtype, rngs=rngs)
    raise ValueError(f"unknown norm kind {kind!r}; known: {NORM_KINDS}")
