"""Tests for layers/flash_attention.py: values, gradients, masks, dtypes, remat, memory.

Every check compares against an independent reference written here (full
[t, s] scores + softmax) and, where its conventions apply, against
jax.nn.dot_product_attention(implementation="xla"). Shapes are small and odd
(37 tokens, blocks of 16) so padding and partial blocks are always exercised.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spillway.layers import names
from spillway.layers.flash_attention import flash_attention, flash_attention_with_lse

RTOL = ATOL = 1e-5  # float32


# ----------------------------------------------------------------------------
# references
# ----------------------------------------------------------------------------


def reference_attention(q_btnh, k_bskh, v_bskh, do_btnh, dlse_bnt=None, *, causal=True, sliding_window=None,
                        q_positions_bt=None, kv_positions_bs=None, scale=None):
    """Float64 NumPy attention with the whole [t, s] score matrix, and its textbook backward.

    Returns o_btnh, lse_bnt and the gradients of sum(o * do) + sum(lse * dlse)
    wrt q, k, v. Rows that see no key give o = 0, lse = -inf, no gradient.
    NumPy, so no compile: the tests stay fast. jax.nn.dot_product_attention
    (autodiff) cross-checks the same cases where its conventions apply.
    """
    q, k, v, do = (np.asarray(x, np.float64) for x in (q_btnh, k_bskh, v_bskh, do_btnh))
    b, t, n, h = q.shape
    s, kv = k.shape[1], k.shape[2]
    g = n // kv
    scale = h ** -0.5 if scale is None else scale
    q_pos = np.broadcast_to(np.arange(t) if q_positions_bt is None else np.asarray(q_positions_bt), (b, t))
    kv_pos = np.broadcast_to(np.arange(s) if kv_positions_bs is None else np.asarray(kv_positions_bs), (b, s))
    mask_bts = np.ones((b, t, s), bool)
    if causal:
        mask_bts &= kv_pos[:, None, :] <= q_pos[:, :, None]
    if sliding_window is not None:
        mask_bts &= kv_pos[:, None, :] > q_pos[:, :, None] - sliding_window
    mask = mask_bts[:, None]                                   # [b, 1, t, s]
    k_n, v_n = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # head i reads kv head i // g
    s_bnts = np.einsum("btnh,bsnh->bnts", q, k_n) * scale
    s_bnts = np.where(mask, s_bnts, -np.inf)
    seen = mask.any(-1)                                        # [b, 1, t]
    m = np.where(seen, s_bnts.max(-1, initial=-np.inf), 0.0)
    p = np.exp(s_bnts - m[..., None])
    l_bnt = p.sum(-1)
    p = p / np.where(seen, l_bnt, 1.0)[..., None]
    o = np.einsum("bnts,bsnh->btnh", p, v_n)
    lse = np.where(seen, m + np.log(np.where(seen, l_bnt, 1.0)), -np.inf)

    dlse = np.zeros((b, n, t)) if dlse_bnt is None else np.asarray(dlse_bnt, np.float64)
    dv_n = np.einsum("bnts,btnh->bsnh", p, do)
    dp = np.einsum("btnh,bsnh->bnts", do, v_n)
    # softmax backward: ds = p * (dp - sum_s p * dp); lse adds p * dlse.
    ds = p * (dp - (p * dp).sum(-1, keepdims=True) + dlse[..., None])
    dq = np.einsum("bnts,bsnh->btnh", ds, k_n) * scale
    dk_n = np.einsum("bnts,btnh->bsnh", ds, q) * scale
    group_sum = lambda x: x.reshape(b, s, kv, g, -1).sum(3)
    return o, lse, (dq, group_sum(dk_n), group_sum(dv_n))


def naive_attention(q_btnh, k_bskh, v_bskh):
    """JAX causal attention through the full score matrix (for the memory test)."""
    h = q_btnh.shape[-1]
    s_bnts = jnp.einsum("btnh,bsnh->bnts", q_btnh, k_bskh) * h ** -0.5
    t, s = s_bnts.shape[-2:]
    s_bnts = jnp.where(jnp.tril(jnp.ones((t, s), bool)), s_bnts, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s_bnts, axis=-1), v_bskh)


def dpa_attention(q_btnh, k_bskh, v_bskh, *, causal=True, sliding_window=None):
    window = None if sliding_window is None else (sliding_window - 1, 0)
    return jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, is_causal=causal,
                                        local_window_size=window, implementation="xla")


def output_and_grads(attn, q, k, v, ct):
    """Jitted (o, (dq, dk, dv)) of sum(o * ct): one compile per call."""
    def run(q, k, v, ct):
        o, vjp = jax.vjp(attn, q, k, v)
        return o, vjp(ct.astype(o.dtype))
    return jax.jit(run)(q, k, v, ct)


def random_inputs(seed, b, t, s, n, kv, h, hv=None, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    hv = h if hv is None else hv
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), dtype)
    k = jnp.asarray(rng.standard_normal((b, s, kv, h)), dtype)
    v = jnp.asarray(rng.standard_normal((b, s, kv, hv)), dtype)
    ct = jnp.asarray(rng.standard_normal((b, t, n, hv)), jnp.float32)  # random weights of the summed output
    return q, k, v, ct


def assert_close(actual, expected, rtol=RTOL, atol=ATOL):
    actual, expected = jax.tree.leaves(actual), jax.tree.leaves(expected)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64), rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------
# values and gradients
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    b: int = 2
    t: int = 37
    s: int = 37
    n: int = 4
    kv: int = 2
    h: int = 16
    hv: int | None = None
    causal: bool = True
    window: int | None = None
    q_positions: tuple | None = None          # nested tuple, [b, t] or [t]
    kv_positions: tuple | None = None
    block_q: int = 16
    block_k: int = 16
    scale: float | None = None
    vs_dpa: bool = False                      # also cross-check jax.nn.dot_product_attention


def _arange(start, n):
    return tuple(range(start, start + n))


CASES = {
    # t != s, both odd, not multiples of the blocks; MHA.
    "mha_noncausal": Case(t=37, s=29, n=2, kv=2, causal=False, vs_dpa=True),
    "gqa_causal": Case(n=4, kv=2, vs_dpa=True),
    "mqa_causal_custom_scale": Case(n=4, kv=1, block_q=8, block_k=16, scale=0.3),
    # key j visible to query i iff i - 8 < j <= i  ==  local_window_size=(7, 0)
    "mqa_sliding_window": Case(n=4, kv=1, window=8, vs_dpa=True),
    # Keys in shuffled order: block skipping must not assume sorted positions.
    "gqa_window_shuffled_keys": Case(n=4, kv=2, window=20, block_q=8, block_k=8,
                                     kv_positions=tuple(int(i) for i in np.random.default_rng(7).permutation(37))),
    # Decoding a 5-token chunk against a 37-entry cache: batch row 0 ends the
    # cache (offset s - t), row 1 sits earlier (its later keys are masked).
    # Also a v head_dim different from q/k's, and the default 512 blocks
    # clipped to t and s.
    "decode_offset_positions": Case(t=5, s=37, q_positions=(_arange(32, 5), _arange(10, 5)), hv=8,
                                    block_q=512, block_k=512),
    # Keys start at position 8 (1-D positions, shared by the batch): queries
    # 0..7 see no key at all.
    "fully_masked_rows": Case(kv_positions=_arange(8, 37)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name):
    case = CASES[name]
    q, k, v, ct = random_inputs(0, case.b, case.t, case.s, case.n, case.kv, case.h, case.hv)
    mask_kw = dict(causal=case.causal, sliding_window=case.window,
                   q_positions_bt=None if case.q_positions is None else jnp.asarray(case.q_positions),
                   kv_positions_bs=None if case.kv_positions is None else jnp.asarray(case.kv_positions))

    o, grads = output_and_grads(
        lambda q, k, v: flash_attention(q, k, v, **mask_kw, block_q=case.block_q, block_k=case.block_k,
                                        scale=case.scale), q, k, v, ct)
    o_ref, _, grads_ref = reference_attention(q, k, v, ct, **mask_kw, scale=case.scale)
    assert o.dtype == q.dtype and o.shape == (case.b, case.t, case.n, case.hv or case.h)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves((o, grads)))
    assert_close(o, o_ref)
    assert_close(grads, grads_ref)

    if case.vs_dpa:
        o_dpa, grads_dpa = output_and_grads(
            lambda q, k, v: dpa_attention(q, k, v, causal=case.causal, sliding_window=case.window), q, k, v, ct)
        assert_close(o, o_dpa)
        assert_close(grads, grads_dpa)

    if name == "fully_masked_rows":
        # Rows that see nothing: output exactly 0, and no gradient flows into q there.
        assert np.all(np.asarray(o[:, :8]) == 0)
        assert np.all(np.asarray(grads[0][:, :8]) == 0)


def test_bf16_inputs():
    q, k, v, ct = random_inputs(1, 2, 37, 37, 4, 2, 16, dtype=jnp.bfloat16)
    # Default blocks (512) are clipped to the 37-token sequences.
    o, grads = output_and_grads(lambda q, k, v: flash_attention(q, k, v), q, k, v, ct)
    assert o.dtype == jnp.bfloat16
    assert [g.dtype for g in grads] == [jnp.bfloat16] * 3
    # Reference in float64 on the same (bf16-rounded) inputs; bf16 matmul
    # operands (p, ds) and bf16 outputs bound the error.
    o_ref, _, grads_ref = reference_attention(q, k, v, ct)
    assert_close(o, o_ref, rtol=2e-2, atol=2e-2)
    assert_close(grads, grads_ref, rtol=5e-2, atol=5e-2)


def test_with_lse_values_and_grads():
    q, k, v, ct = random_inputs(2, 2, 37, 37, 4, 2, 16)
    ct_lse = jnp.asarray(np.random.default_rng(3).standard_normal((2, 4, 37)), jnp.float32)

    def loss(q, k, v):
        o, lse = flash_attention_with_lse(q, k, v, block_q=16, block_k=16)
        return jnp.sum(o * ct) + jnp.sum(lse * ct_lse), (o, lse)

    (_, (o, lse)), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    o_ref, lse_ref, grads_ref = reference_attention(q, k, v, ct, ct_lse)
    assert lse.shape == (2, 4, 37) and lse.dtype == jnp.float32
    assert_close((o, lse), (o_ref, lse_ref))
    assert_close(grads, grads_ref)


# ----------------------------------------------------------------------------
# remat
# ----------------------------------------------------------------------------


def _count_prims(closed_jaxpr, name):
    """Occurrences of a primitive, counting every nested sub-jaxpr where it is used."""
    def walk(jaxpr):
        count = 0
        for eqn in jaxpr.eqns:
            count += eqn.primitive.name == name
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        count += walk(sub)
        return count
    return walk(closed_jaxpr.jaxpr)


def test_under_checkpoint():
    q, k, v, ct = random_inputs(5, 2, 37, 37, 4, 2, 16)
    loss = lambda q, k, v: jnp.sum(flash_attention(q, k, v, block_q=16, block_k=16) * ct)
    _, _, grads_ref = reference_attention(q, k, v, ct)
    save_names = jax.checkpoint_policies.save_only_these_names(names.ATTN_CONTEXT)
    for policy in (None, save_names):
        grads = jax.jit(jax.grad(jax.checkpoint(loss, policy=policy), (0, 1, 2)))(q, k, v)
        assert_close(grads, grads_ref)

    # Dots traced: forward 2 per block step, backward 4. Saving the two named
    # residuals keeps the attention forward out of the backward pass;
    # recompute-everything reruns it.
    def dots(fn):
        return _count_prims(jax.make_jaxpr(jax.grad(fn, (0, 1, 2)))(q, k, v), "dot_general")
    plain = dots(loss)
    assert dots(jax.checkpoint(loss, policy=save_names)) == plain
    assert dots(jax.checkpoint(loss, policy=jax.checkpoint_policies.nothing_saveable)) == plain + 2


def test_residuals_are_q_k_v_o_lse(capsys):
    q, k, v, _ = random_inputs(6, 1, 37, 29, 4, 2, 16)
    jax.ad_checkpoint.print_saved_residuals(
        lambda q, k, v: flash_attention(q, k, v, block_q=16, block_k=16), q, k, v)
    lines = capsys.readouterr().out.strip().splitlines()
    shapes = sorted(line.split()[0] for line in lines)
    assert shapes == sorted(["f32[1,37,4,16]", "f32[1,29,2,16]", "f32[1,29,2,16]",  # q, k, v
                             "f32[1,37,4,16]", "f32[1,4,37]"]), lines             # o, lse
    # Both o and lse carry the ATTN_CONTEXT tag, so one policy name keeps both.
    assert sum(names.ATTN_CONTEXT in line for line in lines) == 2, lines


# ----------------------------------------------------------------------------
# memory
# ----------------------------------------------------------------------------


def test_memory_is_linear_in_sequence_length():
    b, t, n, h = 1, 2048, 4, 64
    x = jax.ShapeDtypeStruct((b, t, n, h), jnp.float32)
    score_bytes = b * n * t * t * 4  # one fp32 [b, n, t, s] matrix: 64 MiB

    def temp_bytes(attn):
        loss = lambda q, k, v: jnp.sum(attn(q, k, v) ** 2)
        compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(x, x, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    flash = temp_bytes(lambda q, k, v: flash_attention(q, k, v, block_q=256, block_k=256))
    naive = temp_bytes(naive_attention)
    assert flash < score_bytes / 4, (flash, score_bytes)
    assert naive > score_bytes, (naive, score_bytes)


# Slow: test_flash_softcap.py's memory test compiles the same grad-of-scan at both lengths with the block-skip
# of a traced window, and the plain kernel (no cap) at 4096 beside it, in the default suite.
@pytest.mark.slow
def test_memory_stays_linear_inside_a_scan_over_layers():
    # Regression: a lax.cond block-skip inside the kernel made grad-of-scan keep
    # per-(query block, key block) residuals: 120 -> 400 MiB from t=2048 to 4096
    # (quadratic); now 32 -> 61 MiB.
    def temp_bytes(t, b=1, n=4, h=64, layers=2):
        x = jax.ShapeDtypeStruct((b, t, n, h), jnp.float32)
        w = jax.ShapeDtypeStruct((layers, h, h), jnp.float32)

        def loss(w, x):
            def layer(x, w_hh):
                q = x @ w_hh
                return flash_attention(q, x[:, :, :2], x[:, :, :2], block_q=256, block_k=256), None
            return jnp.sum(jax.lax.scan(layer, x, w)[0] ** 2)

        return jax.jit(jax.grad(loss)).lower(w, x).compile().memory_analysis().temp_size_in_bytes

    short, long = temp_bytes(2048), temp_bytes(4096)
    assert long / short < 2.5, (short, long)          # linear growth, not 4x
    assert long < 1 * 4 * 4096 * 4096 * 4 / 2, long   # well below one fp32 score matrix


# ----------------------------------------------------------------------------
# input validation
# ----------------------------------------------------------------------------


_x = jnp.zeros((1, 8, 4, 16))
_kv = jnp.zeros((1, 8, 2, 16))


@pytest.mark.parametrize("args, kwargs, match", [
    ((_x[0], _kv, _kv), {}, "rank 4"),
    ((_x, _kv, _kv[..., None]), {}, "rank 4"),
    ((_x, jnp.zeros((1, 8, 3, 16)), jnp.zeros((1, 8, 3, 16))), {}, "multiple of num_kv_heads"),
    ((_x, jnp.zeros((1, 8, 2, 8)), _kv), {}, "head_dim"),
    ((_x, _kv, jnp.zeros((1, 7, 2, 16))), {}, "k and v must agree"),
    ((_x, jnp.zeros((2, 8, 2, 16)), jnp.zeros((2, 8, 2, 16))), {}, "batch"),
    ((_x, _kv, _kv), {"block_q": 0}, "block_q"),
    ((_x, _kv, _kv), {"block_k": -4}, "block_k"),
    ((_x, _kv, _kv), {"sliding_window": 0}, "sliding_window"),
    ((_x, _kv, _kv), {"sliding_window": 4, "causal": False}, "requires causal"),
    ((_x, _kv, _kv), {"q_positions_bt": jnp.zeros((1, 7), jnp.int32)}, "q_positions_bt"),
    ((_x, _kv, _kv), {"kv_positions_bs": jnp.zeros((1, 8))}, "integer"),
    ((_x.astype(jnp.int32), _kv, _kv), {}, "floating"),
])
def test_invalid_inputs(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        flash_attention(*args, **kwargs)
