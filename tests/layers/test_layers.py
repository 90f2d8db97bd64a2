"""Shapes with odd sizes and numerics of the small layers: RMSNorm, RoPE, MLP, attention, embeddings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spillway.layers.attention import Attention
from spillway.layers.embed import Embedding, LMHead
from spillway.layers.mlp import MLP
from spillway.layers.norm import RMSNorm
from spillway.layers.rope import RopeScaling, apply_rope, inverse_frequencies
from spillway.models.decoder import DecoderLM
from spillway.models.registry import preset_config


def test_rmsnorm_normalises_in_float32():
    norm = RMSNorm(7, eps=1e-6, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 3, 7)) * 5
    y = np.asarray(norm(x))
    np.testing.assert_allclose(np.sqrt(np.mean(y**2, axis=-1)), 1.0, rtol=1e-4)
    assert norm(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16


def test_rope_preserves_norm_and_relative_positions():
    inv = inverse_frequencies(10, 10000.0)
    q = jax.random.normal(jax.random.key(0), (1, 5, 3, 10))
    k = jax.random.normal(jax.random.key(1), (1, 5, 3, 10))
    pos = jnp.arange(5)[None]
    rq, rk = apply_rope(q, pos, inv), apply_rope(k, pos, inv)
    np.testing.assert_allclose(np.linalg.norm(rq, axis=-1), np.linalg.norm(q, axis=-1), rtol=1e-5)
    # Scores depend only on the distance: shifting every position changes nothing.
    rq2, rk2 = apply_rope(q, pos + 11, inv), apply_rope(k, pos + 11, inv)
    np.testing.assert_allclose(jnp.einsum("btnh,bsnh->bnts", rq, rk), jnp.einsum("btnh,bsnh->bnts", rq2, rk2),
                               rtol=1e-4, atol=1e-4)


def test_llama31_scaling_keeps_high_and_slows_low_frequencies():
    plain = inverse_frequencies(128, 500000.0)
    scaled = inverse_frequencies(128, 500000.0, RopeScaling())
    assert scaled[0] == pytest.approx(plain[0])                 # shortest wavelength untouched
    assert scaled[-1] == pytest.approx(plain[-1] / 8.0)         # longest slowed by `factor`
    assert np.all(scaled <= plain + 1e-12)


def test_rope_rejects_odd_head_dim():
    with pytest.raises(ValueError, match="even head_dim"):
        inverse_frequencies(7, 10000.0)


@pytest.mark.parametrize("kind", ["swiglu", "geglu", "gelu"])
def test_mlp_shapes(kind):
    mlp = MLP(13, 29, kind=kind, rngs=nnx.Rngs(0))
    assert mlp(jnp.ones((2, 5, 13))).shape == (2, 5, 13)
    assert hasattr(mlp, "w_gate") == (kind != "gelu")


def test_unknown_mlp_kind():
    with pytest.raises(ValueError, match="unknown mlp kind 'relu2'"):
        MLP(4, 8, kind="relu2", rngs=nnx.Rngs(0))


def _naive_attention(q, k, v, window=None):
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    t = q.shape[1]
    scores = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    mask = j <= i
    if window is not None:
        mask &= j > i - window
    scores = jnp.where(mask, scores, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), v)


@pytest.mark.parametrize("heads,kv_heads", [(6, 6), (6, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("impl", ["xla", "flash"])
def test_attention_matches_naive(heads, kv_heads, window, impl):
    attn = Attention(36, heads, kv_heads, sliding_window=window, impl=impl, flash_block_size=8, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (2, 11, 36))
    pos = jnp.broadcast_to(jnp.arange(11), (2, 11))
    out, cache = attn(x, pos)
    assert out.shape == (2, 11, 36) and cache is None
    inv = inverse_frequencies(6, 10000.0)
    q = apply_rope(jnp.einsum("btd,dnh->btnh", x, attn.wq[...]), pos, inv)
    k = apply_rope(jnp.einsum("btd,dnh->btnh", x, attn.wk[...]), pos, inv)
    v = jnp.einsum("btd,dnh->btnh", x, attn.wv[...])
    expected = jnp.einsum("btnh,nhd->btd", _naive_attention(q, k, v, window), attn.wo[...])
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


def test_attention_head_errors_name_the_fields():
    with pytest.raises(ValueError, match=r"num_heads \(7\) does not divide d_model \(30\)"):
        Attention(30, 7, 7, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"num_kv_heads \(4\) does not divide num_heads \(6\)"):
        Attention(30, 6, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="unknown attention impl 'magic'"):
        Attention(30, 6, 2, impl="magic", rngs=nnx.Rngs(0))


def test_tied_and_separate_heads():
    emb = Embedding(17, 6, rngs=nnx.Rngs(0))
    x = emb(jnp.array([[1, 2, 16]]))
    assert x.shape == (1, 3, 6)
    np.testing.assert_allclose(emb.attend(x), x @ emb.table[...].T, rtol=1e-6)
    assert LMHead(6, 17, rngs=nnx.Rngs(0))(x).shape == (1, 3, 17)


def test_every_parameter_has_logical_axes():
    model = nnx.eval_shape(lambda: DecoderLM(preset_config("llama", "tiny_odd"), rngs=nnx.Rngs(0)))
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            axes = var.get_metadata().get("logical_axes")
            assert axes is not None and len(axes) == len(var.get_value().shape), path
