"""The MoE layer sharded over 8 fake CPU devices equals one device, forward and backward, with the token
exchange each dispatch implies (tests/conftest.py makes the 8 devices).

Mesh data=2 x fsdp=2 x tensor=2: tokens split over data x fsdp, the 6 experts
over fsdp (3 per device), their hidden axis over tensor. The capacity dispatch
moves tokens to the experts (an all-to-all in the compiled program); the
dropless one gathers the experts to the tokens (all-gather forward, a
reduce-scatter of their gradients backward).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spillway.layers.errors import ConfigError
from spillway.layers.moe import MoE, MoEConfig
from spillway.layers.mesh import MeshConfig
from spillway.layers.sharding import activation_sharding, create_sharded, make_mesh

CFG = MoEConfig(d_model=12, num_experts=6, top_k=2, expert_hidden=8, shared_expert_hidden=4)


def loss_and_grads(model: MoE, x_btd, mesh=None):
    graphdef, state = nnx.split(model)

    def loss(state, x_btd):
        y_btd, stats = nnx.merge(graphdef, state).apply(x_btd)
        return jnp.mean(jnp.sin(y_btd)) + 0.1 * jnp.sum(stats.router_prob_sum * stats.expert_choices)

    def step(state, x_btd):
        with activation_sharding(mesh):
            return jax.value_and_grad(loss, argnums=(0, 1))(state, x_btd)
    compiled = jax.jit(step).lower(state, x_btd).compile()
    return compiled(state, x_btd), compiled.as_text()


# dropless by blocks is the dropless dispatch with another grouped matmul (its own sharded test is slow)
@pytest.mark.parametrize("dispatch", ["dropless", "capacity", pytest.param("dropless_blocked", marks=pytest.mark.slow)])
def test_sharded_forward_and_backward_equal_one_device(dispatch):
    blocked = {"grouped_matmul": "blocked", "grouped_matmul_block": 4} if dispatch == "dropless_blocked" else {}
    dispatch = dispatch.removesuffix("_blocked")
    cfg = dataclasses.replace(CFG, dispatch=dispatch, capacity_factor=1.5, **blocked)
    x_btd = jax.random.normal(jax.random.key(1), (4, 5, cfg.d_model), jnp.float32)
    single = MoE(cfg, rngs=nnx.Rngs(0))
    (want, want_grads), _ = loss_and_grads(single, x_btd)

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    sharded = create_sharded(lambda: MoE(cfg, rngs=nnx.Rngs(0)), mesh)
    assert sharded.w_up[...].sharding.spec == jax.sharding.PartitionSpec("fsdp", None, "tensor")
    x_sharded = jax.device_put(x_btd, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"))))
    (got, got_grads), hlo = loss_and_grads(sharded, x_sharded, mesh)

    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6),
                 got_grads, want_grads)
    if dispatch == "capacity":
        assert "all-to-all" in hlo
    else:
        assert "all-gather" in hlo and "reduce-scatter" in hlo


def test_a_mesh_whose_expert_axis_does_not_divide_the_experts_is_refused_while_tracing():
    model = MoE(dataclasses.replace(CFG, num_experts=5), rngs=nnx.Rngs(0))
    x_btd = jnp.zeros((4, 5, CFG.d_model))
    with pytest.raises(ConfigError, match=r"mesh.fsdp=2 = 2, which does not divide num_experts \(5\)"):
        with activation_sharding(make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))):
            jax.eval_shape(model.apply, x_btd)
