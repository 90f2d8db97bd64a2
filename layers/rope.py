"""Rotary position embeddings (RoFormer), with Llama 3.1 frequency scaling.

Uses the "rotate half" layout of Hugging Face Llama checkpoints: the first and
second halves of each head dimension form the rotated pairs.

`inverse_frequencies` takes a static base (NumPy, constant-folded into the
program); `traced_inverse_frequencies` the same for a traced base and linear
scale (a layer's LayerValues, layers/layer_values.py), in float32 as Hugging
Face computes them.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from spillway.layers.errors import ConfigError, require_positive


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 scaling: long wavelengths are slowed by `factor`, short ones kept,
    and the band between is interpolated smoothly."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        require_positive("rope_scaling", factor=self.factor, low_freq_factor=self.low_freq_factor,
                         high_freq_factor=self.high_freq_factor, original_max_position=self.original_max_position)
        if not self.high_freq_factor > self.low_freq_factor:   # the interpolation divides by their difference
            raise ConfigError(f"rope_scaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                              f"low_freq_factor ({self.low_freq_factor})")


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv_freq.astype(np.float32)
    return _llama3_scaled(inv_freq, scaling, np).astype(np.float32)


def _llama3_scaled(inv_freq, scaling: RopeScaling, xp):
    """Llama 3.1's frequency-dependent scaling of `inv_freq`, in NumPy (xp=np) or traced (xp=jnp)."""
    low_freq_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = xp.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    is_medium = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
    return xp.where(is_medium, interpolated, scaled)


def traced_inverse_frequencies(head_dim: int, theta: jax.Array, linear_scale: jax.Array | float = 1.0,
                               scaling: RopeScaling | None = None) -> jax.Array:
    """`inverse_frequencies` for a traced base, divided by a (traced) linear scale: Hugging Face's "linear"
    rope scaling (inv_freq / factor, i.e. positions / factor). A static Llama 3.1 `scaling` applies too."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    inv_freq = 1.0 / (jnp.asarray(theta, jnp.float32) ** exponents)
    if scaling is not None:
        inv_freq = _llama3_scaled(inv_freq, scaling, jnp)
    return inv_freq / jnp.asarray(linear_scale, jnp.float32)


def apply_rope(x_btnh: jax.Array, positions_bt: jax.Array, inv_freq_h2: np.ndarray | jax.Array) -> jax.Array:
    """Rotate x [batch, seq, heads, head_dim] by its positions [batch, seq]."""
    angles_bth2 = positions_bt[..., None].astype(jnp.float32) * jnp.asarray(inv_freq_h2)
    cos = jnp.cos(angles_bth2)[:, :, None, :]
    sin = jnp.sin(angles_bth2)[:, :, None, :]
    x32 = x_btnh.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_btnh.dtype)
