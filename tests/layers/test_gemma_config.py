"""The Gemma switches of BlockConfig and LayerValues: bad values are one-line ConfigErrors that name the field,
and the (1 + w) RMSNorm computes what transformers' Gemma2RMSNorm does, in float32 with the cast last."""

import jax.numpy as jnp
import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="Hugging Face parity tests need torch and transformers (the `parity` extra), installed only in the Python 3.11 environment")
from flax import nnx
Gemma2RMSNorm = pytest.importorskip("transformers.models.gemma2.modeling_gemma2", reason="Hugging Face parity tests need torch and transformers (the `parity` extra), installed only in the Python 3.11 environment").Gemma2RMSNorm

from spillway.layers.attention import Attention
from spillway.layers.block import BlockConfig, BlockContext, TransformerBlock
from spillway.layers.errors import ConfigError
from spillway.layers.execution import Execution
from spillway.layers.layer_values import layer_values, stack_layer_values
from spillway.layers.norm import make_norm

BASE = dict(d_model=16, num_heads=2, num_kv_heads=1, mlp_hidden=24)


@pytest.mark.parametrize("fields, match", [
    ({"attn_softcap": 0.0}, r"BlockConfig.attn_softcap must be a positive finite number, got 0.0"),
    ({"attn_softcap": -50.0}, r"BlockConfig.attn_softcap must be a positive finite number"),
    ({"attn_softcap": float("inf")}, r"BlockConfig.attn_softcap must be a positive finite number"),
    ({"attn_softcap": "50"}, r"BlockConfig.attn_softcap must be a positive finite number"),
    ({"query_scale": 0.0}, r"BlockConfig.query_scale must be a positive finite number"),
    ({"query_scale": float("nan")}, r"BlockConfig.query_scale must be a positive finite number"),
    ({"norm": "rms_plus_two"}, r"BlockConfig.norm must be one of \('rms', 'rms_plus_one', 'layer'\)"),
    ({"mlp_kind": "geglu_exact"}, r"BlockConfig.mlp_kind must be one of"),
    ({"attn_softcap": 50.0, "execution": Execution(attention_impl="cudnn")},
     r"cuDNN's fused attention has no logit soft-capping; use execution.attention_impl=flash"),
])
def test_bad_gemma_fields_are_one_line_config_errors(fields, match):
    with pytest.raises(ConfigError, match=match) as err:
        BlockConfig(**BASE, **fields)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kwargs, match", [
    ({"sliding_window": -1}, "sliding_window must be None, 0 \\(global\\) or a positive int"),
    ({"sliding_window": 4.5}, "sliding_window"),
    ({"rope_theta": 0.0}, "rope_theta must be a positive finite number"),
    ({"rope_scale": -2.0}, "rope_scale must be a positive finite number"),
])
def test_bad_layer_values_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        layer_values(**kwargs)


def test_layer_values_stack_into_per_layer_arrays():
    stacked = stack_layer_values([layer_values(512, 10_000.0), layer_values(None, 1e6, 8.0)])
    assert stacked.sliding_window.dtype == jnp.int32 and stacked.sliding_window.tolist() == [512, 0]
    assert stacked.rope_theta.dtype == jnp.float32 and stacked.rope_scale.tolist() == [1.0, 8.0]
    with pytest.raises(ConfigError, match="at least one layer"):
        stack_layer_values([])


def test_cudnn_cannot_take_a_traced_window():
    block = TransformerBlock(BlockConfig(**BASE, execution=Execution(attention_impl="cudnn")), rngs=nnx.Rngs(0))
    x = jnp.zeros((1, 5, 16))
    ctx = BlockContext(jnp.arange(5)[None], layer_values=layer_values(3))
    with pytest.raises(ConfigError, match="cudnn.*static sliding window.*use attention_impl='flash'"):
        block(x, ctx)


def test_attention_refuses_cudnn_with_softcap_and_bad_qk_norm_kind():
    with pytest.raises(ConfigError, match="cuDNN"):
        Attention(16, 2, 1, impl="cudnn", softcap=30.0, rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match="qk_norm_kind"):
        Attention(16, 2, 1, qk_norm=True, qk_norm_kind="layer", rngs=nnx.Rngs(0))


def test_gemma_block_parameters():
    """post_norms adds exactly post_attn_norm and post_mlp_norm; rms_plus_one norms (q/k norm too) start at zero."""
    def param_paths(module):
        return {".".join(map(str, path)) for path, node in nnx.iter_graph(module) if isinstance(node, nnx.Param)}

    plain = TransformerBlock(BlockConfig(**BASE), rngs=nnx.Rngs(0))
    cfg = BlockConfig(**BASE, norm="rms_plus_one", post_norms=True, qk_norm=True)
    gemma = TransformerBlock(cfg, rngs=nnx.Rngs(0))
    assert param_paths(gemma) - param_paths(plain) == {
        "post_attn_norm.scale", "post_mlp_norm.scale", "attn.q_norm.scale", "attn.k_norm.scale"}
    for norm in (gemma.attn_norm, gemma.post_attn_norm, gemma.mlp_norm, gemma.post_mlp_norm, gemma.attn.q_norm):
        assert norm.plus_one and not np.asarray(norm.scale[...]).any()
    assert cfg.qk_norm_kind == "rms_plus_one" and BlockConfig(**BASE, qk_norm=True).qk_norm_kind == "rms"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rms_plus_one_matches_gemma2_rmsnorm(dtype):
    """Against transformers' Gemma2RMSNorm: float32 statistics and (1 + w), cast to the input dtype last
    (bf16 inputs give bit-equal bf16 outputs)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 7, 16)).astype(np.float32) * 4
    w = rng.standard_normal(16).astype(np.float32)
    theirs = Gemma2RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        theirs.weight.copy_(torch.as_tensor(w))
        expected = theirs(torch.as_tensor(x).to(getattr(torch, dtype))).float().numpy()
    ours = make_norm("rms_plus_one", 16, eps=1e-6, rngs=nnx.Rngs(0))
    ours.scale[...] = jnp.asarray(w)
    out = ours(jnp.asarray(x).astype(dtype))
    assert out.dtype == jnp.dtype(dtype)
    if dtype == "float32":
        np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6, atol=1e-6)
    else:
        np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), expected)
