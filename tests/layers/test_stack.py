"""layers/stack.py: the stacked blocks, the scan against the layers applied one at a time, segments, and the
check that a plan names only what the block tags."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spillway.layers import names
from spillway.layers.block import BlockConfig, BlockContext, TransformerBlock
from spillway.layers.offload import OffloadPolicy
from spillway.layers.stack import BlockStack

CFG = BlockConfig(d_model=16, num_heads=4, num_kv_heads=2, mlp_hidden=24)
LAYERS = 3


def _inputs(seq=6):
    x_btd = jax.random.normal(jax.random.key(2), (2, seq, CFG.d_model))
    return x_btd, BlockContext(jnp.broadcast_to(jnp.arange(seq), (2, seq)))


def _one_layer_at_a_time(stack, x_btd, ctx):
    """The oracle: each layer's slice of the stacked state merged into a block and applied in turn."""
    graphdef, state = nnx.split(stack.blocks)
    for layer in range(stack.num_layers):
        block = nnx.merge(graphdef, jax.tree.map(lambda a: a[layer], state))
        x_btd, _ = block(x_btd, ctx)
    return x_btd


def test_parameters_are_stacked_on_a_leading_layers_axis():
    stack = BlockStack(CFG, LAYERS, rngs=nnx.Rngs(0))
    variables = [v for _, v in nnx.iter_graph(stack.blocks) if isinstance(v, nnx.Param)]
    assert variables
    for var in variables:
        assert var.get_value().shape[0] == LAYERS
        assert var.get_metadata()["logical_axes"][0] == names.LAYERS
    # Each layer is initialised with its own key: no two layers' weights are equal.
    wq = stack.blocks.attn.wq.get_value()
    assert not np.allclose(wq[0], wq[1])


@pytest.mark.parametrize("remat", ["save_all", "recompute_all", "save_dots:1,offload_dots"])
def test_the_scan_gives_what_the_layers_give_one_at_a_time(remat):
    stack = BlockStack(CFG, LAYERS, remat=remat, rngs=nnx.Rngs(0))
    x_btd, ctx = _inputs()
    out, cache = stack(x_btd, ctx)
    assert cache is None and len(stack.segments) == (2 if "," in remat else 1)
    np.testing.assert_allclose(out, _one_layer_at_a_time(stack, x_btd, ctx), rtol=1e-5, atol=1e-5)


def test_a_plan_naming_a_tag_the_block_never_makes_is_refused_when_built():
    policy = OffloadPolicy.of({"not_a_tag_of_this_block": "host"})
    with pytest.raises(ValueError, match=r"never tags .* silently do nothing"):
        BlockStack(CFG, LAYERS, remat=policy, rngs=nnx.Rngs(0))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="num_layers must be positive"):
        BlockStack(CFG, 0, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="block_cls must subclass TransformerBlock"):
        BlockStack(CFG, LAYERS, block_cls=nnx.Linear, rngs=nnx.Rngs(0))
    assert issubclass(TransformerBlock, nnx.Module)
