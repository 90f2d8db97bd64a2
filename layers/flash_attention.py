"""Blockwise (flash-style) attention in plain JAX, with its own backward pass.

`flash_attention(q_btnh, k_bskh, v_bskh, ...)` computes
softmax(scale * q k^T + mask) v without ever holding the [t, s] score matrix:
memory is linear in the sequence length. It uses only standard lax ops
(`lax.fori_loop`, `einsum`, dynamic slices), so it compiles on every backend,
including XLA's GPU compiler run deviceless (docs/DESIGN.md section 5), where
cuDNN and Pallas attention cannot be traced.

Algorithm (FlashAttention-2, Dao 2023):

  forward   for each query block i (fori_loop, writing o_i in place):
              for each key block j (fori_loop), online softmax in fp32:
                s    = scale * q_i k_j^T, masked to -inf
                m'   = max(m, rowmax(s));  p = exp(s - m')
                l    = exp(m - m') l + rowsum(p)
                acc  = exp(m - m') acc + p v_j
              o_i = acc / l;  lse_i = m + log(l)
  backward  residuals are only q, k, v, o and lse ([b, n, t], fp32).
            D = rowsum(dO * O). For each key block j (fori_loop):
              for each query block i (fori_loop), recompute
                p   = exp(scale * q_i k_j^T - lse_i)      (0 where masked)
                dv_j += p^T dO_i
                ds  = p * (dO_i v_j^T - D_i)
                dk_j += scale * ds^T q_i
                dq_i += scale * ds k_j                    (dq kept in fp32)

Blocks that the mask hides entirely (the upper triangle under `causal`, blocks
left of a `sliding_window`) are never computed: each loop runs over the range
of blocks that may hold a visible entry, with traced bounds (`_visited_range`),
in both passes. The range comes from the actual positions (their min/max per
block), so it is exact for sorted positions and safe for any: a block inside
the range that sees nothing is computed fully masked. (A `lax.cond` per block
did the same skipping but, under grad of a scan over layers, made XLA keep
per-block residuals: memory quadratic in the sequence.)

Memory: besides inputs and outputs the kernel holds an fp32 dq buffer, dO and
a few [b, n, block_q, block_k] fp32 score blocks; whole arrays are never
transposed or repeated (GQA heads are folded per block). docs/DESIGN.md
section 5 has the measurement against XLA's dense attention.

Conventions:
  * Grouped-query attention: query head i reads kv head i // (n // kv), the same
    grouping as `jax.nn.dot_product_attention`; k and v are never repeated.
  * Masks come from positions (default `arange`, for queries and keys alike):
      causal          key j visible to query i iff pos_k[j] <= pos_q[i]
      sliding_window  w: additionally pos_q[i] - w < pos_k[j], i.e. the query
                      sees itself and the w - 1 keys before it. This equals
                      `jax.nn.dot_product_attention(..., is_causal=True,
                      local_window_size=(w - 1, 0))`.
    With t != s and default positions the mask is aligned top-left (query i at
    position i), as in `jax.nn.dot_product_attention`; for decoding with a cache
    pass `q_positions_bt` (e.g. cache_len + arange(t)).
  * A query row that sees no key at all gets output 0 (not NaN) and
    logsumexp -inf; its gradients are 0.
  * Softmax statistics and all accumulators are fp32 whatever the input dtype;
    matmul operands stay in the input dtype (bf16 inputs run bf16 matmuls with
    fp32 accumulation, as FlashAttention does). The output has q's dtype.
  * v may have a different head_dim from q and k (as in MLA); q and k must match.

Remat: the forward rule tags both of its residuals, the output and the
logsumexp, as `names.ATTN_CONTEXT`: the backward pass needs both, so one name
covers them. Under `jax.checkpoint` with a policy that saves (or offloads)
ATTN_CONTEXT, the backward pass reuses them and does not rerun the attention
forward; with any other policy the forward is recomputed, which is always
correct.
"""

from __future__ import annotations

import functools
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from spillway.layers import names



class _Config(NamedTuple):
    """Static (hashable) settings of one call; nondiff argument of the custom_vjp.

    A traced window is not here: it is an operand of the custom_vjp (`window`), and
    `sliding_window` is then None.
    """

    causal: bool
    sliding_window: int | None
    block_q: int
    block_k: int
    scale: float
    softcap: float | None = None


# ----------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------


def flash_attention(q_btnh, k_bskh, v_bskh, *, causal: bool = True, sliding_window: int | jax.Array | None = None,
                    q_positions_bt=None, kv_positions_bs=None, block_q: int = 512, block_k: int = 512,
                    scale: float | None = None, softcap: float | None = None, q_segment_ids_bt=None,
                    kv_segment_ids_bs=None) -> jax.Array:
    """Blockwise attention, memory linear in sequence length; see the module docstring.

    Args:
      q_btnh: queries [batch, t, num_heads, head_dim].
      k_bskh: keys [batch, s, num_kv_heads, head_dim]; num_heads % num_kv_heads == 0.
      v_bskh: values [batch, s, num_kv_heads, head_dim_v].
      causal: mask keys whose position is after the query's position.
      sliding_window: w >= 1; the query sees keys with q_pos - w < k_pos <= q_pos.
        A Python int (static), or an integer array of shape [] (traced: one
        layer's window in a scan over layers), where 0 means no window.
        Requires causal=True.
      q_positions_bt, kv_positions_bs: integer positions, [batch, t] / [batch, s]
        (or [t] / [s], shared by the batch). Default arange.
      block_q, block_k: tile sizes; clipped to the sequence lengths. Lengths need
        not be multiples of them.
      scale: score scale, a static Python float; default 1 / sqrt(head_dim).
      softcap: c > 0 caps the scaled scores as c * tanh(s / c) before the mask
        (Gemma 2), a static Python float; None: no cap.
      q_segment_ids_bt, kv_segment_ids_bs: integer [batch, t] / [batch, s]: a
        query sees only keys of its own segment (packed examples); both or
        neither. Key blocks holding no segment of a query block are skipped
        when the ids are sorted along the sequence (as packing writes them).

    Returns:
      o_btnh: [batch, t, num_heads, head_dim_v], dtype of q.
    """
    o_btnh, _ = flash_attention_with_lse(
        q_btnh, k_bskh, v_bskh, causal=causal, sliding_window=sliding_window,
        q_positions_bt=q_positions_bt, kv_positions_bs=kv_positions_bs,
        block_q=block_q, block_k=block_k, scale=scale, softcap=softcap,
        q_segment_ids_bt=q_segment_ids_bt, kv_segment_ids_bs=kv_segment_ids_bs)
    return o_btnh


def flash_attention_with_lse(q_btnh, k_bskh, v_bskh, *, causal: bool = True,
                             sliding_window: int | jax.Array | None = None, q_positions_bt=None,
                             kv_positions_bs=None, block_q: int = 512, block_k: int = 512,
                             scale: float | None = None, softcap: float | None = None, q_segment_ids_bt=None,
                             kv_segment_ids_bs=None):
    """As `flash_attention`, also returning the per-row logsumexp lse_bnt ([b, n, t], fp32).

    Both outputs are differentiable (the lse cotangent enters as ds += p * dlse),
    so partial attentions over disjoint key sets can be merged exactly, e.g. for
    a split KV cache or sequence-parallel attention. Rows that see no key have
    lse = -inf.
    """
    q_btnh, k_bskh, v_bskh = jnp.asarray(q_btnh), jnp.asarray(k_bskh), jnp.asarray(v_bskh)
    window = _traced_window(sliding_window, causal)
    cfg = _check_inputs(q_btnh, k_bskh, v_bskh, causal, None if window is not None else sliding_window,
                        block_q, block_k, scale, softcap)
    b, t = q_btnh.shape[:2]
    s = k_bskh.shape[1]
    q_pos_bt = _positions(q_positions_bt, b, t, "q_positions_bt")
    kv_pos_bs = _positions(kv_positions_bs, b, s, "kv_positions_bs")
    if (q_segment_ids_bt is None) != (kv_segment_ids_bs is None):
        raise ValueError("flash_attention: give both q_segment_ids_bt and kv_segment_ids_bs, or neither")
    segments = None if q_segment_ids_bt is None else (_positions(q_segment_ids_bt, b, t, "q_segment_ids_bt"),
                                                      _positions(kv_segment_ids_bs, b, s, "kv_segment_ids_bs"))
    return _flash(cfg, q_btnh, k_bskh, v_bskh, q_pos_bt, kv_pos_bs, window, segments)


# ----------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------


def _traced_window(sliding_window, causal):
    """An array window as an int32 scalar operand (0: no window), or None for a static (or no) window."""
    if sliding_window is None or isinstance(sliding_window, numbers.Number):
        return None   # static: checked by _check_inputs
    window = jnp.asarray(sliding_window)
    if window.shape != () or not jnp.issubdtype(window.dtype, jnp.integer):
        raise ValueError(f"flash_attention: a traced sliding_window must be an integer scalar, "
                         f"got {window.dtype}{list(window.shape)}")
    if not causal:
        raise ValueError("flash_attention: sliding_window requires causal=True")
    return window.astype(jnp.int32)


def _check_inputs(q, k, v, causal, sliding_window, block_q, block_k, scale, softcap) -> _Config:
    for name, x in (("q_btnh", q), ("k_bskh", k), ("v_bskh", v)):
        if x.ndim != 4:
            raise ValueError(f"flash_attention: {name} must have rank 4 [batch, seq, heads, head_dim], "
                             f"got shape {x.shape}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"flash_attention: {name} must be floating point, got {x.dtype}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"flash_attention: k and v must agree in [batch, s, num_kv_heads], "
                         f"got k {k.shape} and v {v.shape}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"flash_attention: batch sizes differ: q {q.shape[0]}, k/v {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"flash_attention: head_dim of q ({q.shape[3]}) and k ({k.shape[3]}) must match")
    num_heads, num_kv_heads = q.shape[2], k.shape[2]
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"flash_attention: num_heads ({num_heads}) must be a multiple of "
                         f"num_kv_heads ({num_kv_heads})")
    for name, blk in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(blk, numbers.Integral) or isinstance(blk, bool) or blk <= 0:
            raise ValueError(f"flash_attention: {name} must be a positive int, got {blk!r}")
    if sliding_window is not None:
        if (not isinstance(sliding_window, numbers.Integral) or isinstance(sliding_window, bool)
                or sliding_window < 1):
            raise ValueError(f"flash_attention: sliding_window must be a positive int or None, "
                             f"got {sliding_window!r}")
        if not causal:
            # A look-back window without the causal bound would let a query see
            # every future key; no model we know wants that, so refuse it.
            raise ValueError("flash_attention: sliding_window requires causal=True")
    for name, value in (("scale", scale), ("softcap", softcap)):
        if value is not None and (not isinstance(value, numbers.Real) or isinstance(value, bool)
                                  or not 0 < value < float("inf")):
            raise ValueError(f"flash_attention: {name} must be a positive finite float or None, got {value!r}")
    if scale is None:
        scale = q.shape[3] ** -0.5
    # Clip blocks to the lengths so short sequences are not padded to 512.
    t, s = q.shape[1], k.shape[1]
    return _Config(causal=bool(causal), sliding_window=None if sliding_window is None else int(sliding_window),
                   block_q=max(1, min(int(block_q), t)), block_k=max(1, min(int(block_k), s)),
                   scale=float(scale), softcap=None if softcap is None else float(softcap))


def _positions(pos, b, n, name):
    # None stays None (an empty pytree through the custom_vjp): the default
    # arange is rebuilt inside, so it is not saved as a residual.
    if pos is None:
        return None
    pos = jnp.asarray(pos)
    if not jnp.issubdtype(pos.dtype, jnp.integer):
        raise ValueError(f"flash_attention: {name} must be integer, got {pos.dtype}")
    if pos.shape not in ((n,), (b, n)):
        raise ValueError(f"flash_attention: {name} must have shape ({b}, {n}) or ({n},), got {pos.shape}")
    return jnp.broadcast_to(pos.astype(jnp.int32), (b, n))


# ----------------------------------------------------------------------------
# layout: "rows"
# ----------------------------------------------------------------------------
#
# Inside a block the g = n // kv query heads that share a kv head are folded
# into the query axis: per kv head a block of bq tokens is R = bq * g rows
# (row = token * g + group). Grouped-query attention is then plain attention
# with g times more rows, and every einsum has (b, kv) as leading batch dims.
# Only blocks are transposed into this layout, never whole arrays, so the kernel
# makes no full-size copy of q, k, v or dO beyond zero-padding them to whole
# blocks when the lengths require it.


def _pad_axis(x, axis, size):
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _to_rows(x_btnh, kv):
    """[b, t, n, h] -> [b, kv, t * g, h]."""
    b, t, n, h = x_btnh.shape
    return jnp.transpose(x_btnh.reshape(b, t, kv, n // kv, h), (0, 2, 1, 3, 4)).reshape(b, kv, t * (n // kv), h)


def _from_rows(x_bkrh, g):
    """[b, kv, t * g, h] -> [b, t, kv * g, h]."""
    b, kv, r, h = x_bkrh.shape
    return jnp.transpose(x_bkrh.reshape(b, kv, r // g, g, h), (0, 2, 1, 3, 4)).reshape(b, r // g, kv * g, h)


def _stat_to_rows(x_bnt, kv):
    """Per-row statistic [b, n, t] -> [b, kv, t * g]."""
    b, n, t = x_bnt.shape
    return jnp.transpose(x_bnt.reshape(b, kv, n // kv, t), (0, 1, 3, 2)).reshape(b, kv, t * (n // kv))


def _stat_from_rows(x_bkr, g):
    """[b, kv, t * g] -> [b, kv * g, t]."""
    b, kv, r = x_bkr.shape
    return jnp.transpose(x_bkr.reshape(b, kv, r // g, g), (0, 1, 3, 2)).reshape(b, kv * g, r // g)


def _kv_heads_first(x_bskh):
    return jnp.transpose(x_bskh, (0, 2, 1, 3))


def _slice(x, start, size, axis):
    return lax.dynamic_slice_in_dim(x, start, size, axis)


class _Layout(NamedTuple):
    """Padded inputs and mask data shared by the forward and backward passes."""

    q_btnh: jax.Array         # [b, Tp, n, h], zero-padded to whole blocks
    k_bskh: jax.Array         # [b, Sp, kv, h]
    v_bskh: jax.Array         # [b, Sp, kv, hv]
    q_pos_bt: jax.Array       # [b, Tp] int32
    q_valid_bt: jax.Array     # [b, Tp] bool, False on padding
    kv_pos_bs: jax.Array      # [b, Sp] int32
    kv_valid_bs: jax.Array    # [b, Sp] bool
    visit_ij: jax.Array       # [nq, nk] bool: block (i, j) may hold a visible entry
    window: jax.Array | None  # traced int32 window (0: none), or None (static cfg.sliding_window)
    segments: tuple | None    # ([b, Tp], [b, Sp]) int32 segment ids (padding is masked by the valid flags), or None
    num_q_blocks: int
    num_k_blocks: int


def _in_window(cfg: _Config, window, k_pos_bj, q_pos_bi):
    """[b, i, j]: k_pos > q_pos - w for the static or traced window (True everywhere for a traced 0);
    None without a window (and no op traced then: a windowless call is the program it always was)."""
    if cfg.sliding_window is not None:
        return k_pos_bj[:, None, :] > q_pos_bi[:, :, None] - cfg.sliding_window
    if window is not None:
        return (window <= 0) | (k_pos_bj[:, None, :] > q_pos_bi[:, :, None] - window)
    return None


def _layout(cfg: _Config, q_btnh, k_bskh, v_bskh, q_pos_bt, kv_pos_bs, window, segments=None) -> _Layout:
    b, t = q_btnh.shape[:2]
    s = k_bskh.shape[1]
    bq, bk = cfg.block_q, cfg.block_k
    nq, nk = -(-t // bq), -(-s // bk)
    tp, sp = nq * bq, nk * bk
    if q_pos_bt is None:
        q_pos_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if kv_pos_bs is None:
        kv_pos_bs = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    q_valid_bt = jnp.broadcast_to(jnp.arange(tp) < t, (b, tp))
    kv_valid_bs = jnp.broadcast_to(jnp.arange(sp) < s, (b, sp))
    q_pos_bt = _pad_axis(q_pos_bt, 1, tp)
    kv_pos_bs = _pad_axis(kv_pos_bs, 1, sp)

    # Which blocks may hold a visible entry: per block, the range of valid
    # positions; a block is skipped only if no batch row can see into it.
    if cfg.causal:
        big = jnp.iinfo(jnp.int32).max
        q_max_bi = jnp.where(q_valid_bt, q_pos_bt, -big).reshape(b, nq, bq).max(-1)
        q_min_bi = jnp.where(q_valid_bt, q_pos_bt, big).reshape(b, nq, bq).min(-1)
        k_min_bj = jnp.where(kv_valid_bs, kv_pos_bs, big).reshape(b, nk, bk).min(-1)
        k_max_bj = jnp.where(kv_valid_bs, kv_pos_bs, -big).reshape(b, nk, bk).max(-1)
        visit_bij = k_min_bj[:, None, :] <= q_max_bi[:, :, None]
        # q_min is +big on an all-padding block: big - w (w >= 0) cannot overflow.
        in_window_bij = _in_window(cfg, window, k_max_bj, q_min_bi)
        if in_window_bij is not None:
            visit_bij &= in_window_bij
        visit_ij = visit_bij.any(0)
    else:
        visit_ij = jnp.ones((nq, nk), bool)
    if segments is not None:
        q_seg_bt, kv_seg_bs = _pad_axis(segments[0], 1, tp), _pad_axis(segments[1], 1, sp)
        segments = (q_seg_bt, kv_seg_bs)
        visit_ij &= _segments_meet(q_seg_bt, kv_seg_bs, q_valid_bt, kv_valid_bs, nq, nk)

    return _Layout(
        q_btnh=_pad_axis(q_btnh, 1, tp), k_bskh=_pad_axis(k_bskh, 1, sp), v_bskh=_pad_axis(v_bskh, 1, sp),
        q_pos_bt=q_pos_bt, q_valid_bt=q_valid_bt, kv_pos_bs=kv_pos_bs, kv_valid_bs=kv_valid_bs,
        visit_ij=visit_ij, window=window, segments=segments, num_q_blocks=nq, num_k_blocks=nk)


def _segments_meet(q_seg_bt, kv_seg_bs, q_valid_bt, kv_valid_bs, nq, nk):
    """[nq, nk]: the segment-id ranges of query block i and key block j overlap in some row (exact for
    sorted ids, a superset otherwise: a visited block that sees nothing is computed fully masked)."""
    b = q_seg_bt.shape[0]
    big = jnp.iinfo(jnp.int32).max
    q_lo = jnp.where(q_valid_bt, q_seg_bt, big).reshape(b, nq, -1).min(-1)
    q_hi = jnp.where(q_valid_bt, q_seg_bt, -big).reshape(b, nq, -1).max(-1)
    k_lo = jnp.where(kv_valid_bs, kv_seg_bs, big).reshape(b, nk, -1).min(-1)
    k_hi = jnp.where(kv_valid_bs, kv_seg_bs, -big).reshape(b, nk, -1).max(-1)
    return ((k_lo[:, None, :] <= q_hi[:, :, None]) & (q_lo[:, :, None] <= k_hi[:, None, :])).any(0)


def _block_mask(cfg: _Config, lay: _Layout, g, q0, k0):
    """[b, 1, bq * g, bk] visibility of the rows of tokens q0.. against keys k0.."""
    bq, bk = cfg.block_q, cfg.block_k
    q_pos_br = jnp.repeat(_slice(lay.q_pos_bt, q0, bq, 1), g, axis=1)
    q_valid_br = jnp.repeat(_slice(lay.q_valid_bt, q0, bq, 1), g, axis=1)
    k_pos_bs = _slice(lay.kv_pos_bs, k0, bk, 1)
    mask_brs = q_valid_br[:, :, None] & _slice(lay.kv_valid_bs, k0, bk, 1)[:, None, :]
    if cfg.causal:
        mask_brs &= k_pos_bs[:, None, :] <= q_pos_br[:, :, None]
    in_window_brs = _in_window(cfg, lay.window, k_pos_bs, q_pos_br)
    if in_window_brs is not None:
        mask_brs &= in_window_brs
    if lay.segments is not None:
        q_seg_br = jnp.repeat(_slice(lay.segments[0], q0, bq, 1), g, axis=1)
        mask_brs &= q_seg_br[:, :, None] == _slice(lay.segments[1], k0, bk, 1)[:, None, :]
    return mask_brs[:, None]


def _visited_range(visit_n):
    """[lo, hi) covering every True entry of a block-visibility row (lo = hi = 0 if none).

    The loops run over this range with traced bounds (a while loop) instead of
    testing each block with lax.cond: under jax.grad of a lax.scan over layers,
    a cond inside this kernel made XLA keep per-(query block, key block)
    residuals, memory quadratic in the sequence. Blocks inside the range that
    see nothing (only possible with unsorted positions) are computed fully
    masked, which is correct.
    """
    n = visit_n.shape[0]
    any_visible = visit_n.any()
    lo = jnp.argmax(visit_n)
    hi = n - jnp.argmax(visit_n[::-1])
    return jnp.where(any_visible, lo, 0), jnp.where(any_visible, hi, 0)


# ----------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------


def _capped(cfg: _Config, s_bkrs):
    """The scores after soft-capping: (c * tanh(s / c), tanh(s / c)), or (s, None) without a cap."""
    if cfg.softcap is None:
        return s_bkrs, None
    tanh_bkrs = jnp.tanh(s_bkrs / cfg.softcap)
    return cfg.softcap * tanh_bkrs, tanh_bkrs


def _forward(cfg: _Config, q_btnh, k_bskh, v_bskh, q_pos_bt, kv_pos_bs, window, segments=None):
    b, t, n, _ = q_btnh.shape
    kv, hv = v_bskh.shape[2], v_bskh.shape[3]
    g = n // kv
    bq, bk = cfg.block_q, cfg.block_k
    lay = _layout(cfg, q_btnh, k_bskh, v_bskh, q_pos_bt, kv_pos_bs, window, segments)
    rows = bq * g

    def q_block(i, carry):
        o_btnh, lse_bnt = carry
        q0 = i * bq
        q_bkrh = _to_rows(_slice(lay.q_btnh, q0, bq, 1), kv)

        def k_step(j, carry):
            m_bkr, l_bkr, acc_bkrh = carry
            k0 = j * bk
            k_bksh = _kv_heads_first(_slice(lay.k_bskh, k0, bk, 1))
            v_bksh = _kv_heads_first(_slice(lay.v_bskh, k0, bk, 1))
            s_bkrs = jnp.einsum("bkrh,bksh->bkrs", q_bkrh, k_bksh,
                                preferred_element_type=jnp.float32) * cfg.scale
            s_bkrs, _ = _capped(cfg, s_bkrs)   # soft-cap first, then the mask
            s_bkrs = jnp.where(_block_mask(cfg, lay, g, q0, k0), s_bkrs, -jnp.inf)
            m_new = jnp.maximum(m_bkr, s_bkrs.max(-1))
            # A row with nothing visible yet has m = -inf; shift by 0 there
            # so exp() sees -inf - 0 = -inf (-> 0), never -inf - -inf (NaN).
            m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
            p_bkrs = jnp.exp(s_bkrs - m_safe[..., None])
            alpha_bkr = jnp.exp(m_bkr - m_safe)
            l_bkr = alpha_bkr * l_bkr + p_bkrs.sum(-1)
            pv_bkrh = jnp.einsum("bkrs,bksh->bkrh", p_bkrs.astype(v_bksh.dtype), v_bksh,
                                 preferred_element_type=jnp.float32)
            return m_new, l_bkr, alpha_bkr[..., None] * acc_bkrh + pv_bkrh

        init = (jnp.full((b, kv, rows), -jnp.inf, jnp.float32),
                jnp.zeros((b, kv, rows), jnp.float32),
                jnp.zeros((b, kv, rows, hv), jnp.float32))
        k_lo, k_hi = _visited_range(lay.visit_ij[i])
        m_bkr, l_bkr, acc_bkrh = lax.fori_loop(k_lo, k_hi, k_step, init)
        seen = l_bkr > 0
        l_safe = jnp.where(seen, l_bkr, 1.0)
        o_bkrh = (acc_bkrh / l_safe[..., None]).astype(q_btnh.dtype)
        lse_bkr = jnp.where(seen, m_bkr + jnp.log(l_safe), -jnp.inf)
        # Write each block straight into the output: no stacked copy of o.
        o_btnh = lax.dynamic_update_slice_in_dim(o_btnh, _from_rows(o_bkrh, g), q0, 1)
        lse_bnt = lax.dynamic_update_slice_in_dim(lse_bnt, _stat_from_rows(lse_bkr, g), q0, 2)
        return o_btnh, lse_bnt

    tp = lay.num_q_blocks * bq
    init = (jnp.zeros((b, tp, n, hv), q_btnh.dtype), jnp.zeros((b, n, tp), jnp.float32))
    o_btnh, lse_bnt = lax.fori_loop(0, lay.num_q_blocks, q_block, init)
    return o_btnh[:, :t], lse_bnt[:, :, :t]


# ----------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------


def _backward(cfg: _Config, q_btnh, k_bskh, v_bskh, q_pos_bt, kv_pos_bs, window, o_btnh, lse_bnt, do_btnh,
              dlse_bnt, segments=None):
    b, t, n, h = q_btnh.shape
    s, kv, hv = v_bskh.shape[1], v_bskh.shape[2], v_bskh.shape[3]
    g = n // kv
    bq, bk = cfg.block_q, cfg.block_k
    lay = _layout(cfg, q_btnh, k_bskh, v_bskh, q_pos_bt, kv_pos_bs, window, segments)
    tp, sp = lay.num_q_blocks * bq, lay.num_k_blocks * bk

    # D = rowsum(dO * O): the softmax-Jacobian term, fp32. An lse cotangent adds
    # p * dlse to ds, i.e. it enters as D - dlse. Padded rows get dO = 0, D = 0.
    d_bnt = jnp.einsum("btnh,btnh->bnt", do_btnh.astype(jnp.float32), o_btnh.astype(jnp.float32))
    if dlse_bnt is not None:
        d_bnt = d_bnt - dlse_bnt.astype(jnp.float32)
    d_bnt = _pad_axis(d_bnt, 2, tp)
    # Fully-masked rows have lse = -inf; use 0 there (p is masked to 0 anyway)
    # so exp(s - lse) never evaluates -inf - -inf.
    lse_bnt = _pad_axis(jnp.where(jnp.isneginf(lse_bnt), 0.0, lse_bnt), 2, tp)
    do_btnh = _pad_axis(do_btnh, 1, tp)

    def k_block(j, carry):
        dq_btnh, dk_bskh, dv_bskh = carry
        k0 = j * bk
        k_bksh = _kv_heads_first(_slice(lay.k_bskh, k0, bk, 1))
        v_bksh = _kv_heads_first(_slice(lay.v_bskh, k0, bk, 1))

        def q_step(i, carry):
            dq_btnh, dk_bksh, dv_bksh = carry
            q0 = i * bq
            q_bkrh = _to_rows(_slice(lay.q_btnh, q0, bq, 1), kv)
            do_bkrh = _to_rows(_slice(do_btnh, q0, bq, 1), kv)
            lse_bkr = _stat_to_rows(_slice(lse_bnt, q0, bq, 2), kv)
            d_bkr = _stat_to_rows(_slice(d_bnt, q0, bq, 2), kv)
            s_bkrs = jnp.einsum("bkrh,bksh->bkrs", q_bkrh, k_bksh,
                                preferred_element_type=jnp.float32) * cfg.scale
            s_bkrs, tanh_bkrs = _capped(cfg, s_bkrs)
            p_bkrs = jnp.where(_block_mask(cfg, lay, g, q0, k0), jnp.exp(s_bkrs - lse_bkr[..., None]), 0.0)
            dv_bksh = dv_bksh + jnp.einsum("bkrs,bkrh->bksh", p_bkrs.astype(do_bkrh.dtype), do_bkrh,
                                           preferred_element_type=jnp.float32)
            dp_bkrs = jnp.einsum("bkrh,bksh->bkrs", do_bkrh, v_bksh, preferred_element_type=jnp.float32)
            # Fold the score scale into ds once rather than into both grads. Under a soft-cap
            # the chain rule adds d(c tanh(s / c))/ds = 1 - tanh(s / c)^2, from the capped scores.
            if tanh_bkrs is None:
                ds_bkrs = p_bkrs * (dp_bkrs - d_bkr[..., None]) * cfg.scale
            else:
                ds_bkrs = p_bkrs * (dp_bkrs - d_bkr[..., None]) * (1.0 - tanh_bkrs * tanh_bkrs) * cfg.scale
            dk_bksh = dk_bksh + jnp.einsum("bkrs,bkrh->bksh", ds_bkrs.astype(q_bkrh.dtype), q_bkrh,
                                           preferred_element_type=jnp.float32)
            dq_bkrh = jnp.einsum("bkrs,bksh->bkrh", ds_bkrs.astype(k_bksh.dtype), k_bksh,
                                 preferred_element_type=jnp.float32)
            # dq lives in one fp32 buffer for all of t: read-add-write the
            # block in place (FlashAttention-2's atomic add, serialised).
            dq_btnh = lax.dynamic_update_slice_in_dim(
                dq_btnh, _slice(dq_btnh, q0, bq, 1) + _from_rows(dq_bkrh, g), q0, 1)
            return dq_btnh, dk_bksh, dv_bksh

        init = (dq_btnh, jnp.zeros((b, kv, bk, h), jnp.float32), jnp.zeros((b, kv, bk, hv), jnp.float32))
        q_lo, q_hi = _visited_range(lay.visit_ij[:, j])
        dq_btnh, dk_bksh, dv_bksh = lax.fori_loop(q_lo, q_hi, q_step, init)
        # dk, dv of a key block are complete after its q loop: cast and store.
        dk_bskh = lax.dynamic_update_slice_in_dim(dk_bskh, _kv_heads_first(dk_bksh).astype(dk_bskh.dtype), k0, 1)
        dv_bskh = lax.dynamic_update_slice_in_dim(dv_bskh, _kv_heads_first(dv_bksh).astype(dv_bskh.dtype), k0, 1)
        return dq_btnh, dk_bskh, dv_bskh

    init = (jnp.zeros((b, tp, n, h), jnp.float32),
            jnp.zeros((b, sp, kv, h), k_bskh.dtype),
            jnp.zeros((b, sp, kv, hv), v_bskh.dtype))
    dq_btnh, dk_bskh, dv_bskh = lax.fori_loop(0, lay.num_k_blocks, k_block, init)
    return dq_btnh[:, :t].astype(q_btnh.dtype), dk_bskh[:, :s], dv_bskh[:, :s]


# ----------------------------------------------------------------------------
# custom_vjp wiring
# ----------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q_btnh, k_bskh, v_bskh, q_pos_bt, kv_pos_bs, window, segments):
    return _forward(cfg, q_btnh, k_bskh, v_bskh, q_pos_bt, kv_pos_bs, window, segments)


def _flash_fwd(cfg, q_btnh, k_bskh, v_bskh, q_pos_bt, kv_pos_bs, window, segments):
    o_btnh, lse_bnt = _forward(cfg, q_btnh, k_bskh, v_bskh, q_pos_bt, kv_pos_bs, window, segments)
    # Both share one name so a remat policy keeps (or offloads) them together:
    # the backward needs both, or it reruns the forward (module docstring).
    o_btnh = checkpoint_name(o_btnh, names.ATTN_CONTEXT)
    lse_bnt = checkpoint_name(lse_bnt, names.ATTN_CONTEXT)
    residuals = (q_btnh, k_bskh, v_bskh, q_pos_bt, kv_pos_bs, window, o_btnh, lse_bnt, segments)
    return (o_btnh, lse_bnt), residuals


def _flash_bwd(cfg, residuals, cotangents):
    q_btnh, k_bskh, v_bskh, q_pos_bt, kv_pos_bs, window, o_btnh, lse_bnt, segments = residuals
    do_btnh, dlse_bnt = cotangents
    dq, dk, dv = _backward(cfg, q_btnh, k_bskh, v_bskh, q_pos_bt, kv_pos_bs, window, o_btnh, lse_bnt,
                           do_btnh, dlse_bnt, segments)
    # Positions, the window and the segment ids are integers: no cotangent.
    return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
