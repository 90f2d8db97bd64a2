"""The Llama family: published parameter counts, shapes, subclassed blocks, config errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spillway.layers import names
from spillway.layers.block import TransformerBlock
from spillway.layers.norm import RMSNorm
from spillway.layers.sharding import create_sharded
from spillway.models.llama import PRESETS as LLAMA_PRESETS
from spillway.models.decoder import DecoderLM, count_params
from spillway.models.registry import preset_config

# Published parameter counts (model cards / safetensors metadata).
PUBLISHED = {
    "llama2_7b": 6_738_415_616,
    "llama3_8b": 8_030_261_248,
    "llama3_1_8b": 8_030_261_248,
    "llama3_1_70b": 70_553_706_496,
    "llama3_2_1b": 1_235_814_400,
    "llama3_2_3b": 3_212_749_824,
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_parameter_counts_match_published(preset):
    cfg = LLAMA_PRESETS[preset]
    assert cfg.num_params() == PUBLISHED[preset]
    if preset != "llama3_1_70b":  # the built (abstract) model agrees with the formula
        assert count_params(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0))) == PUBLISHED[preset]


def test_forward_shapes_odd_sizes():
    cfg = preset_config("llama", "tiny_odd")
    model = create_sharded(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)))
    logits = model(jnp.zeros((3, 7), jnp.int32))
    assert logits.shape == (3, 7, cfg.vocab_size)
    assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize("field,value,message", [
    ("num_heads", 7, r"num_heads \(7\) does not divide d_model \(60\)"),
    ("num_kv_heads", 4, r"num_kv_heads \(4\) does not divide num_heads \(6\)"),
    ("vocab_size", 0, "vocab_size must be positive"),
])
def test_config_errors_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        preset_config("llama", "tiny_odd", **{field: value})


@pytest.mark.parametrize("plan,message", [
    ("offload_dots:9,recompute_all", "boundary 9 is beyond the stack's 3 layers"),
    ("offload_evrything", "unknown offload preset 'offload_evrything'"),
])
def test_bad_activation_plans_are_errors(plan, message):
    with pytest.raises(ValueError, match=message):
        nnx.eval_shape(lambda: DecoderLM(preset_config("llama", "tiny_odd"), rngs=nnx.Rngs(0), remat=plan))


def test_unknown_model_preset():
    with pytest.raises(ValueError, match="unknown llama preset 'llama5'"):
        preset_config("llama", "llama5")


class ParallelBlock(TransformerBlock):
    def forward(self, x_btd, ctx, cache):
        h_btd = self.attn_norm(x_btd)
        attn_btd, cache = self.attention(h_btd, ctx, cache)
        return x_btd + attn_btd + self.mlp(h_btd), cache


class PostNormBlock(TransformerBlock):
    def __init__(self, cfg, *, rngs):
        super().__init__(cfg, rngs=rngs)
        self.post_attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)

    def forward(self, x_btd, ctx, cache):
        attn_btd, cache = self.attention(self.attn_norm(x_btd), ctx, cache)
        x_btd = x_btd + self.post_attn_norm(attn_btd)
        return x_btd + self.mlp(self.mlp_norm(x_btd)), cache


@pytest.mark.parametrize("block_cls", [ParallelBlock, PostNormBlock])
@pytest.mark.slow  # in `make test-slow` (CI runs it): minutes on 2 cores
def test_subclassed_blocks_give_the_no_remat_gradients_under_offload_policies(block_cls):
    cfg = preset_config("llama", "tiny_odd", num_layers=2)
    base = create_sharded(lambda: DecoderLM(cfg, block_cls=block_cls, rngs=nnx.Rngs(0), remat="save_all"))
    assert base.layers.block_names == frozenset(names.ACTIVATION_NAMES)
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, cfg.vocab_size)

    def loss_fn(model):
        return jnp.mean(model(tokens).astype(jnp.float32) ** 2)

    ref = jax.jit(nnx.grad(loss_fn))(base)
    for policy in ("offload_dots", "save_qkv_offload_mlp", "offload_inputs:1,recompute_all"):
        model = nnx.eval_shape(lambda: DecoderLM(cfg, block_cls=block_cls, rngs=nnx.Rngs(0), remat=policy))
        nnx.update(model, nnx.state(base))
        grads = jax.jit(nnx.grad(loss_fn))(model)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                     nnx.state(grads), nnx.state(ref))


@pytest.mark.parametrize("block_cls,reads_attn_out", [(TransformerBlock, True), (ParallelBlock, False),
                                                     (PostNormBlock, True)])
def test_subclassed_blocks_copy_their_tagged_activations_to_host(block_cls, reads_attn_out):
    """Placement, where a CPU run can see it: the jaxpr copies the subclass's tagged values to host
    (memory kinds are no-ops on CPU; tests/recipes/plan/test_aot.py checks the GPU HLO). What is copied is what
    the backward pass reads: a parallel block never normalises x + attn_out, so ATTN_OUT stays behind."""
    from spillway.layers.stack import host_offloaded_names

    def offloaded(cls):
        cfg = preset_config("llama", "tiny_odd", num_layers=2)
        graphdef, state = nnx.split(nnx.eval_shape(
            lambda: DecoderLM(cfg, block_cls=cls, rngs=nnx.Rngs(0), remat="offload_dots")))
        tokens = jnp.zeros((2, 9), jnp.int32)

        def loss(state):
            return jnp.mean(nnx.merge(graphdef, state)(tokens).astype(jnp.float32) ** 2)
        return dict(host_offloaded_names(jax.make_jaxpr(jax.grad(loss))(state)))

    expected = {names.QKV: 3, names.ATTN_CONTEXT: 1, names.MLP_HIDDEN: 2}
    assert offloaded(block_cls) == ({**expected, names.ATTN_OUT: 1} if reads_attn_out else expected)


def test_block_that_skips_a_name_rejects_policies_for_it():
    class NoMlpBlock(TransformerBlock):
        def forward(self, x_btd, ctx, cache):
            attn_btd, cache = self.attention(self.attn_norm(x_btd), ctx, cache)
            return x_btd + attn_btd, cache

    cfg = preset_config("llama", "tiny_odd", num_layers=2)
    with pytest.raises(ValueError, match=r"\['mlp_hidden', 'mlp_out'\].*NoMlpBlock never tags"):
        nnx.eval_shape(lambda: DecoderLM(cfg, block_cls=NoMlpBlock, rngs=nnx.Rngs(0), remat="offload_dots"))


def test_block_cls_must_subclass_transformer_block():
    with pytest.raises(TypeError, match="must subclass TransformerBlock"):
        nnx.eval_shape(lambda: DecoderLM(preset_config("llama", "tiny_odd"), block_cls=RMSNorm, rngs=nnx.Rngs(0)))
