"""LayerValues: the per-layer scalars a block stack scans beside the weights.

Gemma 2 alternates sliding-window and global attention layer by layer; Gemma 3
repeats five local layers and one global one, each kind with its own RoPE base
(and, on the larger models, a linear position scaling on the global layers).
Those layers have the same weights' shapes, so the stack stays one uniform
scan over [L, ...] weights, and what differs rides along as traced data:

    LayerValues(sliding_window=int32 [], rope_theta=float32 [], rope_scale=float32 [])

one scalar each per layer (a stack scans [L]-shaped arrays of them as xs and
hands each layer its slice through `BlockContext.layer_values`). When a block
is given LayerValues they replace its static `BlockConfig.sliding_window` and
`rope_theta`, and `rope_scale` divides the positions RoPE rotates by
(Hugging Face's "linear" rope scaling: inv_freq / factor); a static
`BlockConfig.rope_scaling` (Llama 3.1) still applies on top. When it is not
(None), the block uses its static config and compiles to the program it always
did.

`layer_values(...)` builds one layer's values from Python numbers (validated);
`stack_layer_values([...])` stacks several into [L] arrays for a scan.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spillway.layers.errors import ConfigError


class LayerValues(NamedTuple):
    """Per-layer scalars the block stack scans beside the weights."""

    sliding_window: jax.Array   # int32 scalar; 0 means global attention (no window)
    rope_theta: jax.Array       # float32 scalar: the RoPE base of this layer
    rope_scale: jax.Array       # float32 scalar: linear position scaling (positions / scale); 1.0 = none


def layer_values(sliding_window: int | None = None, rope_theta: float = 10000.0,
                 rope_scale: float = 1.0) -> LayerValues:
    """One layer's values from Python numbers: a window of w >= 1 tokens (None or 0: global), a RoPE base
    > 0 and a linear position scale > 0. Bad values are a one-line ConfigError."""
    window = 0 if sliding_window is None else sliding_window
    if not isinstance(window, numbers.Integral) or isinstance(window, bool) or window < 0:
        raise ConfigError(f"layer values: sliding_window must be None, 0 (global) or a positive int, "
                          f"got {sliding_window!r}")
    for name, value in (("rope_theta", rope_theta), ("rope_scale", rope_scale)):
        if (not isinstance(value, numbers.Real) or isinstance(value, bool) or not np.isfinite(value)
                or value <= 0):
            raise ConfigError(f"layer values: {name} must be a positive finite number, got {value!r}")
    return LayerValues(jnp.asarray(window, jnp.int32), jnp.asarray(rope_theta, jnp.float32),
                       jnp.asarray(rope_scale, jnp.float32))


def stack_layer_values(per_layer: Sequence[LayerValues]) -> LayerValues:
    """[L]-shaped arrays of several layers' values (the xs of a scan over layers)."""
    if not per_layer:
        raise ConfigError("layer values: a stack needs at least one layer's values")
    return LayerValues(*(jnp.stack(field) for field in zip(*per_layer)))
