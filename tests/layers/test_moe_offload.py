"""Offload presets on blocks whose MLP is an MoE layer: every applicable one gives the no-remat loss and
gradients, and the expert-activation preset copies exactly the expert activations to host (jaxpr level).

The blocks are `layers.moe_block` blocks (a TransformerBlock whose `make_mlp` returns an `MoE` (top-2 of
5 experts, odd sizes)), scanned by the real `BlockStack`. Applicable: the
presets naming no tag the block lacks (the stack refuses the others, which is
checked too): without shared experts the dense presets that name no MLP tag
plus every MoE preset; with shared experts (a dense MLP) every preset.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spillway.layers import names
from spillway.layers.block import BlockConfig, BlockContext
from spillway.layers.moe import MoEConfig
from spillway.layers.moe_block import moe_block
from spillway.layers.offload import MOE_PRESETS, PRESETS
from spillway.layers.stack import BlockStack, host_offloaded_names

BLOCK = BlockConfig(d_model=12, num_heads=3, num_kv_heads=1, mlp_hidden=7)
MOE = {
    "dropless": MoEConfig(d_model=12, num_experts=5, top_k=2, expert_hidden=7),
    "capacity": MoEConfig(d_model=12, num_experts=5, top_k=2, expert_hidden=7, dispatch="capacity",
                          capacity_factor=1.0),
    "dropless_blocked": MoEConfig(d_model=12, num_experts=5, top_k=2, expert_hidden=7, grouped_matmul="blocked",
                                  grouped_matmul_block=4),
    "dropless_shared": MoEConfig(d_model=12, num_experts=5, top_k=2, expert_hidden=7, shared_expert_hidden=6,
                                 shared_expert_gate=True),
}
LAYERS = 3
NO_MLP_TAGS = ("save_all", "recompute_all", "offload_inputs")


def build(kind: str, plan) -> BlockStack:
    return BlockStack(BLOCK, LAYERS, block_cls=moe_block(MOE[kind]), remat=plan, rngs=nnx.Rngs(0))


X_BTD = jax.random.normal(jax.random.key(1), (2, 9, BLOCK.d_model), jnp.float32)


def loss_and_grads(stack: BlockStack):
    graphdef, state = nnx.split(stack)

    def loss(state):
        ctx = BlockContext(jnp.arange(X_BTD.shape[1])[None])
        return jnp.mean(nnx.merge(graphdef, state)(X_BTD, ctx)[0] ** 2)
    step = jax.jit(jax.value_and_grad(loss))
    value, grads = step.lower(state).compile(compiler_options={"xla_backend_optimization_level": 0})(state)
    return float(value), jax.tree.map(np.asarray, grads)


# Each preset is one compile of the stack's gradient (3 to 5 s of a worker's time on 2 cores). With shared
# experts every one of the 11 presets applies: the longest case. The default suite runs the dropless dispatch
# with the presets only an MoE block has and that move or recompute its expert activations, besides the mixed
# per-layer plan (`DEFAULT_PRESETS`); every applicable preset of every dispatch runs with the slow tests (the
# dense presets' names are the dense blocks' own tests, tests/layers/test_offload_policy.py). The capacity
# dispatch's preset copies are checked in the default suite by the next test.
MIXED = "moe_offload_experts:1,moe_save_dots:1,recompute_all"
DEFAULT_PRESETS = ("moe_offload_dots", "moe_recompute_experts", MIXED)


def applicable(kind: str) -> list[str]:
    dense = sorted(PRESETS) if MOE[kind].shared_expert_hidden else list(NO_MLP_TAGS)
    return dense + sorted(MOE_PRESETS) + [MIXED]


@pytest.mark.parametrize("kind,subset", [
    pytest.param("dropless", DEFAULT_PRESETS, id="dropless"),
    pytest.param("dropless", None, marks=pytest.mark.slow, id="dropless-every"),
    pytest.param("capacity", None, marks=pytest.mark.slow, id="capacity-every"),
    pytest.param("dropless_blocked", None, marks=pytest.mark.slow, id="dropless_blocked-every"),
    pytest.param("dropless_shared", None, marks=pytest.mark.slow, id="dropless_shared-every")])
def test_every_applicable_preset_gives_the_no_remat_loss_and_gradients(kind, subset):
    plans = applicable(kind) if subset is None else list(subset)
    assert set(plans) <= set(applicable(kind))
    reference = build(kind, "save_all")
    want, want_grads = loss_and_grads(reference)
    params = nnx.state(reference)
    for plan in plans:
        stack = nnx.eval_shape(lambda: build(kind, plan))
        nnx.update(stack, params)
        got, got_grads = loss_and_grads(stack)
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=plan)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=plan),
                     got_grads, want_grads)


def test_a_dense_preset_naming_mlp_tags_is_refused_where_the_moe_layer_has_no_dense_mlp():
    with pytest.raises(ValueError, match=r"remat plan names \['mlp_hidden', 'mlp_out'\], which MoEBlock never tags"):
        build("dropless", "save_dots")
    assert set(names.MOE_ACTIVATION_NAMES) <= build("capacity", "recompute_all").block_names


@pytest.mark.parametrize("kind", ["dropless", "dropless_blocked", "capacity"])
def test_the_expert_offload_preset_copies_exactly_the_expert_activations_to_host(kind):
    """Gate and up are two EXPERT_HIDDEN values; the combine reads EXPERT_OUT back; attention stays on device."""
    stack = build(kind, "moe_offload_experts")
    graphdef, state = nnx.split(stack)

    def loss(state):
        return jnp.mean(nnx.merge(graphdef, state)(X_BTD, BlockContext(jnp.arange(9)[None]))[0] ** 2)
    found = dict(host_offloaded_names(jax.make_jaxpr(jax.grad(loss))(state)))
    assert found == {names.EXPERT_INPUT: 1, names.EXPERT_HIDDEN: 2, names.EXPERT_OUT: 1}
