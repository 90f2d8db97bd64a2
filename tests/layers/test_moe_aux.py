"""Router losses by hand, and the auxiliary-output channel (layers/aux_outputs.py) through a scanned stack.

The stack here is the channel's recipe for layers/stack.py (`collected_in_body`
inside `jax.checkpoint` inside `lax.scan`, per-segment results joined by
`concat_layers`): its training loss with the load-balancing and z-losses
added, and that loss's gradients, must equal a Python loop over the same
layers that calls `MoE.apply` and adds the same losses.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spillway.layers import aux_outputs
from spillway.layers.moe import MoE, MoEConfig
from spillway.layers.offload import preset
from spillway.layers.router import expert_load, load_balancing_loss, route, router_stats, router_z_loss

LN3 = math.log(3.0)


def test_losses_by_hand():
    """Two tokens, both with probabilities (0.75, 0.25): f = (1, 0), P = (0.75, 0.25); logsumexp = ln 4."""
    stats = router_stats(route(jnp.asarray([[LN3, 0.0], [LN3, 0.0]]), top_k=1, renormalize=True))
    np.testing.assert_allclose(float(load_balancing_loss(stats)), 2 * (1.0 * 0.75 + 0.0 * 0.25), rtol=1e-6)
    np.testing.assert_allclose(float(router_z_loss(stats)), math.log(4.0) ** 2, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(expert_load(stats)), [1.0, 0.0])
    # Opposite preferences balance: f = P = (0.5, 0.5), the loss is k = 1; z-loss the mean of (ln 4)^2 and (ln 2)^2.
    stats = router_stats(route(jnp.asarray([[LN3, 0.0], [0.0, LN3]]), top_k=1, renormalize=True))
    np.testing.assert_allclose(float(load_balancing_loss(stats)), 1.0, rtol=1e-6)
    two = router_stats(route(jnp.asarray([[LN3, 0.0], [0.0, 0.0]]), top_k=1, renormalize=False))
    np.testing.assert_allclose(float(router_z_loss(two)), (math.log(4.0) ** 2 + math.log(2.0) ** 2) / 2, rtol=1e-6)


def test_stats_of_stacked_layers_pool_before_the_product():
    """Layer 1 sends everything to e0, layer 2 to e1: pooled, the experts are balanced (f = P = 1/2 each),
    though each layer alone scores 1.5."""
    first = router_stats(route(jnp.asarray([[LN3, 0.0], [LN3, 0.0]]), 1, True))
    second = router_stats(route(jnp.asarray([[0.0, LN3], [0.0, LN3]]), 1, True))
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), first, second)
    np.testing.assert_allclose(float(load_balancing_loss(first)), 1.5, rtol=1e-6)
    np.testing.assert_allclose(float(load_balancing_loss(stacked)), 2 * (0.5 * 0.5 + 0.5 * 0.5), rtol=1e-6)
    assert expert_load(stacked).shape == (2, 2)   # per layer, for the logs


def test_channel_rules():
    aux_outputs.emit("nobody", jnp.ones(()))      # no collector: dropped, no error
    assert not aux_outputs.active()
    with aux_outputs.collecting() as outer:
        aux_outputs.emit("a", 1)
        with aux_outputs.collecting() as inner:
            assert aux_outputs.active()
            aux_outputs.emit("b", 2)
    assert outer.values == {"a": 1} and inner.values == {"b": 2}
    # Runs of different kinds: the dense run emits nothing; each key joins over the runs that carry it.
    joined = aux_outputs.concat_layers([{"moe": jnp.ones((2, 3))}, {}, {"moe": jnp.zeros((1, 3)), "x": jnp.ones(4)}])
    assert joined["moe"].shape == (3, 3) and joined["x"].shape == (4,)
    assert float(aux_outputs.sum_layers(joined)["moe"].sum()) == 6.0


CFG = MoEConfig(d_model=6, num_experts=5, top_k=2, expert_hidden=7, dispatch="capacity", capacity_factor=1.0)
LAYERS = 3
LB_COEF, Z_COEF = 0.02, 0.001


def stacked_moes():
    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return MoE(CFG, rngs=rngs)
    return make(nnx.Rngs(0))


def total_loss(main, stats, coefficients=(LB_COEF, Z_COEF)):
    return main + coefficients[0] * load_balancing_loss(stats) + coefficients[1] * router_z_loss(stats)


def scanned_loss(state, graphdef, x_btd, plan):
    """Layers 0..1 under one policy and layer 2 under another: two scans, the channel through both."""
    with aux_outputs.collecting() as model_aux:
        per_segment = []
        for (start, stop), policy in zip([(0, 2), (2, 3)], plan):
            def body(x_btd, layer_state):
                return x_btd + nnx.merge(graphdef, layer_state)(x_btd), None
            body = aux_outputs.collected_in_body(body)
            if policy.remat:
                body = jax.checkpoint(body, policy=policy.to_jax(), prevent_cse=False)
            x_btd, (_, aux) = jax.lax.scan(body, x_btd, jax.tree.map(lambda a: a[start:stop], state))
            per_segment.append(aux)
        aux_outputs.emit_all(aux_outputs.concat_layers(per_segment))
    return total_loss(jnp.mean(x_btd ** 2), model_aux.values["moe"])


def looped_loss(state, graphdef, x_btd, coefficients=(LB_COEF, Z_COEF)):
    per_layer = []
    for layer in range(LAYERS):
        y_btd, stats = nnx.merge(graphdef, jax.tree.map(lambda a: a[layer], state)).apply(x_btd)
        x_btd = x_btd + y_btd
        per_layer.append(stats)
    return total_loss(jnp.mean(x_btd ** 2), jax.tree.map(lambda *leaves: jnp.stack(leaves), *per_layer),
                      coefficients)


@pytest.mark.parametrize("plan", [("save_all", "recompute_all"), ("moe_offload_experts", "moe_save_dots")], ids=str)
def test_aux_losses_leave_a_scanned_stack_with_the_loss_and_gradients_of_a_loop(plan):
    graphdef, state = nnx.split(stacked_moes())
    x_btd = jax.random.normal(jax.random.key(4), (2, 9, CFG.d_model))
    policies = tuple(preset(name) for name in plan)
    got, got_grads = jax.jit(jax.value_and_grad(lambda s: scanned_loss(s, graphdef, x_btd, policies)))(state)
    want, want_grads = jax.jit(jax.value_and_grad(lambda s: looped_loss(s, graphdef, x_btd)))(state)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got_grads, want_grads)
    # The auxiliary losses reach the router: without them its gradient differs.
    plain = jax.jit(jax.grad(lambda s: looped_loss(s, graphdef, x_btd, (0.0, 0.0))))(state)
    difference = np.asarray(plain["router"]["w"][...]) - np.asarray(want_grads["router"]["w"][...])
    assert np.abs(difference).max() > 1e-6


def test_the_block_stack_carries_every_layers_stats_to_the_models_collector():
    """A BlockStack of MoE blocks under a two-segment plan: the stats it emits (stacked [layers, ...]) equal
    those of each layer's block run alone in a Python loop, and so do the loss with the aux losses added and
    its gradients."""
    from spillway.layers.block import BlockConfig, BlockContext
    from spillway.layers.moe_block import moe_block
    from spillway.layers.stack import BlockStack

    block = BlockConfig(d_model=6, num_heads=3, num_kv_heads=1, mlp_hidden=7)
    stack = BlockStack(block, LAYERS, block_cls=moe_block(CFG), remat="moe_offload_experts:2,recompute_all",
                       rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(stack)
    block_graphdef = nnx.graphdef(stack.blocks)
    x_btd = jax.random.normal(jax.random.key(5), (2, 9, 6))
    ctx = BlockContext(jnp.arange(9)[None])

    def through_stack(state):
        with aux_outputs.collecting() as aux:
            y_btd, _ = nnx.merge(graphdef, state)(x_btd, ctx)
        stats = aux.values["moe"]
        return total_loss(jnp.mean(y_btd ** 2), stats), stats

    def layer_by_layer(state):
        y_btd, per_layer = x_btd, []
        for layer in range(LAYERS):
            layer_state = jax.tree.map(lambda a: a[layer], state["blocks"])
            with aux_outputs.collecting() as aux:
                y_btd, _ = nnx.merge(block_graphdef, layer_state)(y_btd, ctx)
            per_layer.append(aux.values["moe"])
        stats = jax.tree.map(lambda *leaves: jnp.stack(leaves), *per_layer)
        return total_loss(jnp.mean(y_btd ** 2), stats), stats

    (got, got_stats), got_grads = jax.jit(jax.value_and_grad(through_stack, has_aux=True))(state)
    (want, want_stats), want_grads = jax.jit(jax.value_and_grad(layer_by_layer, has_aux=True))(state)
    assert got_stats.expert_choices.shape == (LAYERS, CFG.num_experts)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), got_stats, want_stats)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got_grads, want_grads)
    # Without a collector the stack runs as before and the stats are dropped.
    assert nnx.merge(graphdef, state)(x_btd, ctx)[0].shape == x_btd.shape
