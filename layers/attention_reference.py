"""The reference ("xla") attention for what jax.nn.dot_product_attention cannot express: soft-capped logits
and masks built from a traced (per-layer) sliding window.

    masked_attention(q_btnh, k_bskh, v_bskh, mask_b1ts, scale=None, softcap=None)

computes softmax(mask(cap * tanh(scale * q k^T / cap))) v with the whole
[t, s] score matrix per head (memory quadratic in the sequence: the flash
kernel is the linear one). The soft-cap comes before the mask, as in Gemma 2.
Scores and softmax are float32; the output has q's dtype. Grouped-query
attention reads kv head i // (n // kv) for query head i, as
jax.nn.dot_product_attention does; k and v are never repeated.

`causal_mask(q_positions_bt, kv_positions_bs, sliding_window)` is the
boolean [b, 1, t, s] mask every non-flash path uses: causal by position, and
windowed by a static int (None: no window) or a traced int32 scalar (0: no
window), i.e. key j is visible to query i iff
pos_q - w < pos_k <= pos_q.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def soft_cap(scores: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(scores / cap) (Gemma's logit soft-capping); the scores unchanged when cap is None."""
    return scores if cap is None else cap * jnp.tanh(scores / cap)


def causal_mask(q_positions_bt: jax.Array, kv_positions_bs: jax.Array, sliding_window) -> jax.Array:
    """Boolean [b, 1, t, s] mask: causal by position, windowed by a static int or a traced scalar (0: global)."""
    q = q_positions_bt[:, None, :, None]
    k = kv_positions_bs[:, None, None, :]
    mask = k <= q
    if isinstance(sliding_window, jax.Array):
        mask &= (sliding_window <= 0) | (k > q - sliding_window)
    elif sliding_window is not None:
        mask &= k > q - sliding_window
    return mask


def masked_attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, mask_b1ts: jax.Array, *,
                     scale: float | None = None, softcap: float | None = None) -> jax.Array:
    """softmax(mask(soft_cap(scale * q k^T))) v through the full score matrix; [b, t, n, hv] in q's dtype."""
    b, t, n, h = q_btnh.shape
    kv = k_bskh.shape[2]
    scale = h ** -0.5 if scale is None else scale
    q_btkgh = q_btnh.reshape(b, t, kv, n // kv, h)
    s_bkgts = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh, preferred_element_type=jnp.float32) * scale
    s_bkgts = soft_cap(s_bkgts, softcap)
    # The mask's head axis is 1: it broadcasts over (kv, g). A fully masked row (never in causal
    # self-attention: a query sees itself) averages the values instead of giving NaN.
    s_bkgts = jnp.where(mask_b1ts[:, :, None], s_bkgts, jnp.finfo(jnp.float32).min)
    p_bkgts = jax.nn.softmax(s_bkgts, axis=-1)
    o_btkgh = jnp.einsum("bkgts,bskh->btkgh", p_bkgts.astype(v_bskh.dtype), v_bskh,
                         preferred_element_type=jnp.float32)
    return o_btkgh.reshape(b, t, n, v_bskh.shape[-1]).astype(q_btnh.dtype)
