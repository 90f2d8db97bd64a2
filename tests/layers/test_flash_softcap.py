"""Soft-capped scores and traced (per-layer) windows in the flash kernel and the reference ("xla") attention.

Every check compares against a float64 NumPy attention written here with the
whole [t, s] score matrix and its textbook backward through the cap
(d(c tanh(s / c))/ds = 1 - tanh(s / c)^2). Inputs are scaled up so the cap
bends the scores (the tests assert it does), sizes are odd (37 and 29 tokens,
blocks of 16 and 8) so padding and partial blocks are exercised, and float32
tolerances are tight.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spillway.layers.attention_reference import causal_mask, masked_attention
from spillway.layers.flash_attention import _Config, _layout, flash_attention

RTOL = ATOL = 1e-5  # float32


def reference(q_btnh, k_bskh, v_bskh, do_btnh, *, softcap=None, window=None, scale=None, kv_positions=None):
    """Float64 o and (dq, dk, dv) of sum(o * do) for causal GQA attention, capped and windowed (0/None: none)."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q_btnh, k_bskh, v_bskh, do_btnh))
    b, t, n, h = q.shape
    s, kv = k.shape[1], k.shape[2]
    g = n // kv
    scale = h ** -0.5 if scale is None else scale
    q_pos = np.arange(t)
    kv_pos = np.arange(s) if kv_positions is None else np.asarray(kv_positions)
    mask = kv_pos[None, :] <= q_pos[:, None]
    if window:
        mask &= kv_pos[None, :] > q_pos[:, None] - window
    k_n, v_n = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    raw = np.einsum("btnh,bsnh->bnts", q, k_n) * scale
    tanh = np.tanh(raw / softcap) if softcap else None
    capped = softcap * tanh if softcap else raw
    scores = np.where(mask, capped, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bnts,bsnh->btnh", p, v_n)
    dv_n = np.einsum("bnts,btnh->bsnh", p, do)
    dp = np.einsum("btnh,bsnh->bnts", do, v_n)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    if softcap:
        ds *= 1.0 - tanh ** 2
    dq = np.einsum("bnts,bsnh->btnh", ds, k_n) * scale
    dk_n = np.einsum("bnts,btnh->bsnh", ds, q) * scale
    group_sum = lambda x: x.reshape(b, s, kv, g, -1).sum(3)  # noqa: E731
    return o, (dq, group_sum(dk_n), group_sum(dv_n))


def random_inputs(seed, b=2, t=37, n=4, kv=2, h=16, spread=3.0):
    """q, k, v scaled so that scores reach well past a cap of a few units; ct weights the summed output."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(spread * rng.standard_normal((b, t, n, h)), jnp.float32)
    k = jnp.asarray(spread * rng.standard_normal((b, t, kv, h)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, t, kv, h)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
    return q, k, v, ct


def output_and_grads(attn, q, k, v, ct, *extra):
    """Jitted (o, (dq, dk, dv)) of sum(o * ct); `extra` are traced arguments of `attn` (a window)."""
    def run(q, k, v, ct, *extra):
        o, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, *extra), q, k, v)
        return o, vjp(ct)
    return jax.jit(run)(q, k, v, ct, *extra)


def assert_close(actual, expected, rtol=RTOL, atol=ATOL):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64), rtol=rtol, atol=atol)


# (window as passed, the window it means): static ints, traced int32 scalars (0 = global), None.
WINDOWS = {"global": (None, None), "static_7": (7, 7), "traced_7": (np.int32(7), 7),
           "traced_0_global": (np.int32(0), None), "traced_wider_than_seq": (np.int32(100), None)}


@pytest.mark.parametrize("window_name", list(WINDOWS))
def test_flash_with_softcap_matches_reference(window_name):
    window, meant = WINDOWS[window_name]
    q, k, v, ct = random_inputs(0)
    softcap, scale = 2.5, 0.2
    traced = isinstance(window, np.integer)   # handed to the jitted function as an argument: traced

    def attn(q, k, v, *w):
        return flash_attention(q, k, v, sliding_window=w[0] if w else window, block_q=16, block_k=8,
                               scale=scale, softcap=softcap)

    extra = (jnp.asarray(window),) if traced else ()
    o, grads = output_and_grads(attn, q, k, v, ct, *extra)
    o_ref, grads_ref = reference(q, k, v, ct, softcap=softcap, window=meant, scale=scale)
    assert_close(o, o_ref)
    assert_close(grads, grads_ref)
    # The cap bends these scores: without it the attention is measurably different.
    o_uncapped, _ = reference(q, k, v, ct, window=meant, scale=scale)
    assert np.abs(o_uncapped - o_ref).max() > 1e-2


@pytest.mark.parametrize("window", [None, 6, np.int32(6), np.int32(0)], ids=str)
def test_reference_attention_with_softcap_matches_numpy(window):
    """The "xla" path's own attention (masked_attention with causal_mask) against the NumPy reference."""
    q, k, v, ct = random_inputs(1, n=6, kv=2, t=29)
    positions = jnp.broadcast_to(jnp.arange(29), (2, 29))

    def attn(q, k, v, *w):
        mask = causal_mask(positions, positions, jnp.asarray(w[0]) if w else window)
        return masked_attention(q, k, v, mask, softcap=1.5)

    traced = isinstance(window, np.integer)
    o, grads = output_and_grads(attn, q, k, v, ct, *((window,) if traced else ()))
    o_ref, grads_ref = reference(q, k, v, ct, softcap=1.5, window=None if window is None else int(window))
    assert_close(o, o_ref)
    assert_close(grads, grads_ref)


def test_flash_softcap_with_shuffled_keys_and_mqa():
    """Keys in shuffled order and one kv head: the traced window's block skipping must not assume sorted keys."""
    q, k, v, ct = random_inputs(2, n=4, kv=1)
    kv_positions = np.random.default_rng(7).permutation(37)
    attn = lambda q, k, v, w: flash_attention(q, k, v, sliding_window=w, kv_positions_bs=jnp.asarray(kv_positions),  # noqa: E731
                                              block_q=8, block_k=8, softcap=3.0)
    o, grads = output_and_grads(attn, q, k, v, ct, jnp.int32(11))
    o_ref, grads_ref = reference(q, k, v, ct, softcap=3.0, window=11, kv_positions=kv_positions)
    assert_close(o, o_ref)
    assert_close(grads, grads_ref)


def test_traced_windows_differ_per_layer_in_a_scan():
    """One scan body, three layers with windows 3, global (0) and 12: each layer attends as its window says."""
    q, k, v, ct = random_inputs(3)
    windows = jnp.asarray([3, 0, 12], jnp.int32)

    def loss(q, k, v):
        def layer(total, window):
            o = flash_attention(q, k, v, sliding_window=window, block_q=16, block_k=16, softcap=2.0)
            return total + jnp.sum(o * ct), None
        return jax.lax.scan(layer, 0.0, windows)[0]

    value, grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v)
    per_layer = [reference(q, k, v, ct, softcap=2.0, window=w) for w in (3, None, 12)]
    np.testing.assert_allclose(value, sum(float(np.sum(o * np.asarray(ct))) for o, _ in per_layer), rtol=1e-5)
    assert_close(grads, [sum(g[i] for _, g in per_layer) for i in range(3)], atol=3e-5)


def test_traced_window_skips_the_same_blocks_as_the_static_one():
    """The flash loops' block ranges come from the traced window as they do from a static one (and a traced 0
    visits what no window visits): blocks outside the window are not computed."""
    q = jnp.zeros((1, 64, 2, 8))
    cfg = lambda window: _Config(causal=True, sliding_window=window, block_q=8, block_k=8, scale=1.0)  # noqa: E731
    static = _layout(cfg(10), q, q, q, None, None, None).visit_ij
    traced = jax.jit(lambda w: _layout(cfg(None), q, q, q, None, None, w).visit_ij)(jnp.int32(10))
    np.testing.assert_array_equal(traced, static)
    assert int(np.asarray(static).sum()) < 8 * 9 // 2          # fewer than the causal triangle's blocks
    global_ = _layout(cfg(None), q, q, q, None, None, None).visit_ij
    np.testing.assert_array_equal(jax.jit(lambda w: _layout(cfg(None), q, q, q, None, None, w).visit_ij)(
        jnp.int32(0)), global_)


def test_memory_stays_linear_with_softcap_and_a_traced_window():
    """Mirrors test_flash_attention.py's memory tests: the capped kernel's backward keeps only block-sized
    scores (the tanh of a block, not of the [t, s] matrix), inside a scan over layers with traced windows."""
    def temp_bytes(t, softcap, b=1, n=4, h=64, layers=2):
        x = jax.ShapeDtypeStruct((b, t, n, h), jnp.float32)
        w = jax.ShapeDtypeStruct((layers, h, h), jnp.float32)
        windows = jax.ShapeDtypeStruct((layers,), jnp.int32)

        def loss(w, x, windows):
            def layer(x, layer_in):
                w_hh, window = layer_in
                return flash_attention(x @ w_hh, x[:, :, :2], x[:, :, :2], block_q=256, block_k=256,
                                       sliding_window=window, softcap=softcap), None
            return jnp.sum(jax.lax.scan(layer, x, (w, windows))[0] ** 2)

        compiled = jax.jit(jax.grad(loss)).lower(w, x, windows).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    short, long = temp_bytes(2048, 50.0), temp_bytes(4096, 50.0)
    assert long / short < 2.5, (short, long)            # linear growth, not 4x
    assert long < 1 * 4 * 4096 * 4096 * 4 / 2, long     # well below one fp32 score matrix
    plain = temp_bytes(4096, None)
    assert long < 1.25 * plain, (long, plain)           # the cap costs about nothing in memory


_x = jnp.zeros((1, 8, 4, 16))
_kv = jnp.zeros((1, 8, 2, 16))


@pytest.mark.parametrize("kwargs, match", [
    ({"softcap": 0.0}, "softcap"),
    ({"softcap": -1.0}, "softcap"),
    ({"softcap": float("inf")}, "softcap"),
    ({"scale": 0.0}, "scale"),
    ({"sliding_window": jnp.asarray([4, 4], jnp.int32)}, "integer scalar"),
    ({"sliding_window": jnp.asarray(4.0)}, "integer scalar"),
    ({"sliding_window": jnp.int32(4), "causal": False}, "requires causal"),
])
def test_invalid_softcap_and_window(kwargs, match):
    with pytest.raises(ValueError, match=match):
        flash_attention(_x, _kv, _kv, **kwargs)
