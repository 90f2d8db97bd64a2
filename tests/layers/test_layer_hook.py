"""layers/layer_hook.py: the hook in force while a model is traced, and what BlockStack does with it: called
before every layer with a carry, the layer running with the state the hook returns, outputs stacked."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spillway.layers import layer_hook
from spillway.layers.block import BlockConfig, BlockContext
from spillway.layers.stack import BlockStack

CFG = BlockConfig(d_model=16, num_heads=4, num_kv_heads=2, mlp_hidden=24)
LAYERS = 3


class ScaleEachLayer:
    """Counts layers in its carry, scales each layer's weights by `scale`, and outputs each layer's index."""

    def __init__(self, scale):
        self.scale, self.collected, self.final_carry = scale, None, None

    def start(self):
        return jnp.zeros((), jnp.int32)

    def before_layer(self, carry, layer_index, layer_state):
        return carry + 1, jax.tree.map(lambda w: w * self.scale, layer_state), {"index": layer_index, "seen": carry}

    def collect(self, outputs, carry):
        self.collected, self.final_carry = outputs, carry


def test_the_hook_is_in_force_only_inside_its_context_even_when_it_raises():
    hook = ScaleEachLayer(1.0)
    assert layer_hook.current() is None
    with layer_hook.running_before_layers(hook):
        assert layer_hook.current() is hook
    with pytest.raises(RuntimeError), layer_hook.running_before_layers(hook):
        raise RuntimeError
    assert layer_hook.current() is None


def test_the_stack_runs_each_layer_with_the_state_the_hook_returns_and_stacks_its_outputs():
    stack = BlockStack(CFG, LAYERS, remat="recompute_all", rngs=nnx.Rngs(0))
    x_btd = jax.random.normal(jax.random.key(3), (2, 4, CFG.d_model))
    ctx = BlockContext(jnp.broadcast_to(jnp.arange(4), (2, 4)))
    hook = ScaleEachLayer(0.5)
    with layer_hook.running_before_layers(hook):
        hooked, _ = stack(x_btd, ctx)
    np.testing.assert_array_equal(hook.collected["index"], np.arange(LAYERS))
    np.testing.assert_array_equal(hook.collected["seen"], np.arange(LAYERS))   # the carry went layer to layer
    assert int(hook.final_carry) == LAYERS                                       # and comes back after the last
    # The oracle: the same stack with every weight halved beforehand, no hook.
    graphdef, state = nnx.split(stack)
    halved = nnx.merge(graphdef, jax.tree.map(lambda w: w * 0.5, state))
    expected, _ = halved(x_btd, ctx)
    np.testing.assert_allclose(hooked, expected, rtol=1e-5, atol=1e-5)


def test_a_hook_needs_one_activation_policy_for_the_whole_stack():
    stack = BlockStack(CFG, LAYERS, remat="save_dots:1,recompute_all", rngs=nnx.Rngs(0))
    x_btd = jnp.zeros((1, 4, CFG.d_model))
    with layer_hook.running_before_layers(ScaleEachLayer(1.0)), pytest.raises(ValueError, match="2 segments"):
        stack(x_btd, BlockContext(jnp.arange(4)[None]))
