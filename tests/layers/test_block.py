"""layers/block.py: BlockConfig's checks, the pre-norm block against its sublayers called by hand, and the
tags a block (and a subclass that reuses the sublayers) carries for the offload policies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spillway.layers import names
from spillway.layers.block import BlockConfig, BlockContext, TransformerBlock
from spillway.layers.errors import ConfigError
from spillway.layers.stack import tagged_names

CFG = BlockConfig(d_model=16, num_heads=4, num_kv_heads=2, mlp_hidden=24)


def _inputs(seq=5):
    x_btd = jax.random.normal(jax.random.key(1), (2, seq, CFG.d_model))
    return x_btd, BlockContext(jnp.broadcast_to(jnp.arange(seq), (2, seq)))


def test_the_block_is_pre_norm_attention_then_mlp_each_added_to_the_residual():
    block = TransformerBlock(CFG, rngs=nnx.Rngs(0))
    x_btd, ctx = _inputs()
    attn_btd, _ = block.attn(block.attn_norm(x_btd), ctx.positions_bt)
    mid_btd = x_btd + attn_btd
    expected = mid_btd + block.mlp(block.mlp_norm(mid_btd))
    out, cache = block(x_btd, ctx)
    assert cache is None
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)


class ParallelBlock(TransformerBlock):
    """README's example: attention and MLP read the same normalised input."""

    def forward(self, x_btd, ctx, cache):
        h_btd = self.attn_norm(x_btd)
        attn_btd, cache = self.attention(h_btd, ctx, cache)
        return x_btd + attn_btd + self.mlp(h_btd), cache


@pytest.mark.parametrize("block_cls", [TransformerBlock, ParallelBlock])
def test_a_block_and_a_subclass_reusing_the_sublayers_tag_every_activation_name(block_cls):
    graphdef, state = nnx.split(block_cls(CFG, rngs=nnx.Rngs(0)))
    x_btd, ctx = _inputs()
    jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x, ctx)[0])(state, x_btd)
    assert tagged_names(jaxpr) == set(names.ACTIVATION_NAMES)


@pytest.mark.parametrize("fields, message", [
    ({"num_heads": 3}, "num_heads"),
    ({"head_dim": 3, "num_heads": 4}, "head_dim must be even"),
    ({"norm": "batch"}, "BlockConfig.norm must be one of"),
    ({"mlp_kind": "relu6"}, "BlockConfig.mlp_kind must be one of"),
    ({"mlp_hidden": 0}, "mlp_hidden"),
])
def test_a_config_that_cannot_work_is_a_config_error_naming_the_field(fields, message):
    values = {"d_model": 16, "num_heads": 4, "num_kv_heads": 2, "mlp_hidden": 24, **fields}
    with pytest.raises(ConfigError, match=message):
        BlockConfig(**values)
