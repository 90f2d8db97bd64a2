"""A Gemma-style TransformerBlock against transformers' Gemma 2 and Gemma 3 decoder layers with copied weights.

The oracle is Hugging Face's own model (float32, eager attention), built tiny
and random in the test: Gemma2Model / Gemma3TextModel with three layers
(sliding, global, sliding), head_dim * heads != d_model, a query scale from
query_pre_attn_scalar that is not 1 / sqrt(head_dim), random norm weights (so
the (1 + w) scales matter) and, on Gemma 2, a soft-cap small enough to bend the
scores. The JAX side is three spillway blocks (rms_plus_one norms, post-norms,
the tanh-GELU gated MLP, q/k norm on Gemma 3) between a scaled embedding and
a final (1 + w) norm written here, compared on the models' last hidden state.

Both ways of giving a block its layer's window and RoPE base are checked:
static BlockConfigs per layer kind, and one BlockConfig with LayerValues
(traced under jit: how a scanned stack hands them over), with the "xla" and
"flash" attentions, and decoding token by token against a KV cache.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="Hugging Face parity tests need torch and transformers (the `parity` extra), installed only in the Python 3.11 environment")
from flax import nnx
_hf = pytest.importorskip("transformers", reason="Hugging Face parity tests need torch and transformers (the `parity` extra), installed only in the Python 3.11 environment")
Gemma2Config, Gemma2Model = _hf.Gemma2Config, _hf.Gemma2Model
Gemma3TextConfig, Gemma3TextModel = _hf.Gemma3TextConfig, _hf.Gemma3TextModel

from spillway.layers.block import BlockConfig, BlockContext, TransformerBlock
from spillway.layers.execution import Execution
from spillway.layers.layer_values import layer_values, stack_layer_values

D, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, VOCAB, WINDOW = 24, 4, 2, 8, 40, 50, 5
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 19))


def hf_model(kind: str):
    common = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=HIDDEN, num_hidden_layers=len(LAYER_TYPES),
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                  sliding_window=WINDOW, layer_types=LAYER_TYPES, query_pre_attn_scalar=6,
                  max_position_embeddings=64, rms_norm_eps=1e-6, attn_implementation="eager")
    if kind == "gemma2":
        model = Gemma2Model(Gemma2Config(**common, attn_logit_softcapping=1.5))
    else:   # Gemma 3 4B and larger: local base 10k, global base 1M with linear scaling 8
        model = Gemma3TextModel(Gemma3TextConfig(**common, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}}))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.25)
    return model.eval()


def hf_hidden(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(TOKENS)).last_hidden_state.numpy()


def layer_settings(kind: str, layer_type: str) -> dict:
    """(sliding_window, rope_theta, rope_scale) of one layer, as the Hugging Face config gives them."""
    local = layer_type == "sliding_attention"
    if kind == "gemma2":
        return dict(sliding_window=WINDOW if local else None, rope_theta=10000.0, rope_scale=1.0)
    return dict(sliding_window=WINDOW if local else None, rope_theta=10000.0 if local else 1_000_000.0,
                rope_scale=1.0 if local else 8.0)


def block_config(kind: str, impl: str, **static) -> BlockConfig:
    return BlockConfig(d_model=D, num_heads=HEADS, num_kv_heads=KV_HEADS, mlp_hidden=HIDDEN, head_dim=HEAD_DIM,
                       norm="rms_plus_one", norm_eps=1e-6, mlp_kind="geglu", qk_norm=kind == "gemma3",
                       attn_softcap=1.5 if kind == "gemma2" else None, query_scale=6 ** -0.5, post_norms=True,
                       execution=Execution(attention_impl=impl, flash_block_size=8), **static)


def copy_layer(block: TransformerBlock, layer) -> None:
    """Hugging Face decoder layer weights into a spillway block (torch [out, in] -> [in, ...])."""
    sd = {k: v.detach().numpy() for k, v in layer.state_dict().items()}
    a = block.attn
    a.wq[...] = jnp.asarray(sd["self_attn.q_proj.weight"].T.reshape(D, HEADS, HEAD_DIM))
    a.wk[...] = jnp.asarray(sd["self_attn.k_proj.weight"].T.reshape(D, KV_HEADS, HEAD_DIM))
    a.wv[...] = jnp.asarray(sd["self_attn.v_proj.weight"].T.reshape(D, KV_HEADS, HEAD_DIM))
    a.wo[...] = jnp.asarray(sd["self_attn.o_proj.weight"].T.reshape(HEADS, HEAD_DIM, D))
    if a.q_norm is not None:
        a.q_norm.scale[...] = jnp.asarray(sd["self_attn.q_norm.weight"])
        a.k_norm.scale[...] = jnp.asarray(sd["self_attn.k_norm.weight"])
    block.mlp.w_gate[...] = jnp.asarray(sd["mlp.gate_proj.weight"].T)
    block.mlp.w_up[...] = jnp.asarray(sd["mlp.up_proj.weight"].T)
    block.mlp.w_down[...] = jnp.asarray(sd["mlp.down_proj.weight"].T)
    for ours, theirs in (("attn_norm", "input_layernorm"), ("post_attn_norm", "post_attention_layernorm"),
                         ("mlp_norm", "pre_feedforward_layernorm"), ("post_mlp_norm", "post_feedforward_layernorm")):
        getattr(block, ours).scale[...] = jnp.asarray(sd[f"{theirs}.weight"])


def embedded(model) -> jax.Array:
    table = model.embed_tokens.weight.detach().numpy()
    return jnp.asarray(table[TOKENS]) * jnp.float32(math.sqrt(D))


def final_norm(model, x_btd):
    w = jnp.asarray(model.norm.weight.detach().numpy())
    return x_btd * jax.lax.rsqrt(jnp.mean(x_btd * x_btd, -1, keepdims=True) + 1e-6) * (1.0 + w)


def spillway_blocks(model, kind: str, impl: str, mode: str):
    """The three layers as spillway blocks, and their LayerValues (stacked [L]) when mode == "traced"."""
    blocks, values = [], []
    for layer, layer_type in zip(model.layers, LAYER_TYPES):
        settings = layer_settings(kind, layer_type)
        if mode == "static":
            assert settings["rope_scale"] == 1.0   # a static block has no linear RoPE scaling
            cfg = block_config(kind, impl, sliding_window=settings["sliding_window"],
                               rope_theta=settings["rope_theta"])
        else:
            cfg = block_config(kind, impl)
            values.append(layer_values(**settings))
        block = TransformerBlock(cfg, rngs=nnx.Rngs(0))
        copy_layer(block, layer)
        blocks.append(block)
    return blocks, (stack_layer_values(values) if values else None)


def run_blocks(blocks, stacked_values, x_btd, positions_bt):
    """All layers under one jit; each gets its slice of the stacked values, traced."""
    graphdefs, states = zip(*(nnx.split(b) for b in blocks))

    @jax.jit
    def forward(states, x_btd, stacked_values):
        for i, (graphdef, state) in enumerate(zip(graphdefs, states)):
            values = None if stacked_values is None else jax.tree.map(lambda a: a[i], stacked_values)
            x_btd, _ = nnx.merge(graphdef, state)(x_btd, BlockContext(positions_bt, layer_values=values))
        return x_btd
    return forward(states, x_btd, stacked_values)


@functools.cache
def hf_oracle(kind: str):
    model = hf_model(kind)
    return model, hf_hidden(model)


# Gemma 3's global layers scale RoPE linearly, which only LayerValues express: no static Gemma 3 case.
@pytest.mark.parametrize("kind, mode, impl", [
    ("gemma2", "static", "xla"), ("gemma2", "static", "flash"), ("gemma2", "traced", "xla"),
    ("gemma2", "traced", "flash"), ("gemma3", "traced", "xla"), ("gemma3", "traced", "flash")])
def test_block_matches_transformers(kind, mode, impl):
    model, expected = hf_oracle(kind)
    blocks, values = spillway_blocks(model, kind, impl, mode)
    positions = jnp.broadcast_to(jnp.arange(TOKENS.shape[1]), TOKENS.shape)
    hidden = final_norm(model, run_blocks(blocks, values, embedded(model), positions))
    np.testing.assert_allclose(np.asarray(hidden), expected, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("kind, impl", [("gemma2", "flash"), ("gemma3", "xla")])
def test_decoding_with_a_cache_matches_transformers(kind, impl):
    """A 12-token prompt, then one token at a time against the KV cache, with traced LayerValues."""
    model, expected = hf_oracle(kind)
    blocks, values = spillway_blocks(model, kind, impl, "traced")
    graphdefs, states = zip(*(nnx.split(b) for b in blocks))
    b, t = TOKENS.shape
    x_all = embedded(model)

    @jax.jit
    def step(states, caches, x_btd, start, stacked_values):
        positions = jnp.broadcast_to(start + jnp.arange(x_btd.shape[1]), x_btd.shape[:2])
        new_caches = []
        for i, (graphdef, state, cache) in enumerate(zip(graphdefs, states, caches)):
            ctx = BlockContext(positions, start, jax.tree.map(lambda a: a[i], stacked_values))
            x_btd, cache = nnx.merge(graphdef, state)(x_btd, ctx, cache)
            new_caches.append(cache)
        return x_btd, new_caches

    empty = {"k": jnp.zeros((b, 24, KV_HEADS, HEAD_DIM)), "v": jnp.zeros((b, 24, KV_HEADS, HEAD_DIM))}
    caches = [empty] * len(blocks)
    out, caches = step(states, caches, x_all[:, :12], jnp.int32(0), values)
    outs = [out]
    for i in range(12, t):
        out, caches = step(states, caches, x_all[:, i:i + 1], jnp.int32(i), values)
        outs.append(out)
    hidden = final_norm(model, jnp.concatenate(outs, axis=1))
    np.testing.assert_allclose(np.asarray(hidden), expected, rtol=1e-4, atol=2e-5)


def test_the_cap_and_the_plus_one_norm_matter():
    """The oracle is sensitive to what is tested: without the soft-cap, or with plain RMSNorm, the
    block no longer matches transformers' Gemma 2."""
    model, expected = hf_oracle("gemma2")
    positions = jnp.broadcast_to(jnp.arange(TOKENS.shape[1]), TOKENS.shape)
    blocks, values = spillway_blocks(model, "gemma2", "xla", "traced")
    for attr in ("attn_softcap", "norm"):
        changed = []
        for block, layer in zip(blocks, model.layers):
            cfg = block.cfg
            cfg = BlockConfig(**{**cfg.__dict__, attr: None if attr == "attn_softcap" else "rms"})
            other = TransformerBlock(cfg, rngs=nnx.Rngs(0))
            copy_layer(other, layer)
            changed.append(other)
        hidden = final_norm(model, run_blocks(changed, values, embedded(model), positions))
        assert np.abs(np.asarray(hidden) - expected).max() > 1e-2, attr
