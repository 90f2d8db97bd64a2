"""MoE FLOPs by active experts (layers/moe_flops.py): a hand-worked count, and XLA's own count of the capacity
layer's forward pass (`cost_analysis()` of a CPU compile), which multiplies every slot it executes."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from spillway.layers.moe import MoE, MoEConfig
from spillway.layers.moe_flops import moe_flops_per_token, moe_layer_flops


def test_active_flops_by_hand():
    """Top-2 of 5 experts, d 6, f 7, SwiGLU; shared experts of hidden 5 with their gate; 3 x 7 tokens."""
    cfg = MoEConfig(d_model=6, num_experts=5, top_k=2, expert_hidden=7, shared_expert_hidden=5,
                    shared_expert_gate=True)
    flops = moe_layer_flops(cfg, 3, 7)
    tokens = 21
    assert flops.router == 2 * tokens * 6 * 5                        # 1260
    assert flops.expert_hidden == 2 * tokens * 2 * 6 * 7 * 2         # two experts a token, gate and up: 7056
    assert flops.expert_out == 2 * tokens * 2 * 7 * 6                # 3528
    assert flops.shared_hidden == 2 * tokens * 6 * 5 * 2 and flops.shared_out == 2 * tokens * 5 * 6
    assert flops.shared_gate == 2 * tokens * 6
    assert flops.total == 1260 + 7056 + 3528 + 2520 + 1260 + 252
    assert moe_flops_per_token(cfg) == flops.total / tokens
    # Only k of E count: doubling the experts adds router work only.
    more = moe_layer_flops(dataclasses.replace(cfg, num_experts=10), 3, 7)
    assert more.experts == flops.experts and more.router == 2 * flops.router
    # Dropless executes what is active; capacity executes every slot (here 2 sequences x 5 experts x 3 slots).
    assert moe_layer_flops(cfg, 3, 7, counted="executed") == flops
    capacity = dataclasses.replace(cfg, dispatch="capacity", capacity_factor=1.0)   # ceil(2 * 7 / 5) = 3 slots
    executed = moe_layer_flops(capacity, 3, 7, counted="executed")
    assert executed.expert_out == 2 * (3 * 5 * 3) * 7 * 6
    assert moe_layer_flops(capacity, 3, 7).expert_out == flops.expert_out
    # By blocks of 4: 42 copies need at most ceil(42 / 4) + 5 = 16 blocks, all of which the loop runs.
    blocked = dataclasses.replace(cfg, grouped_matmul="blocked", grouped_matmul_block=4)
    assert moe_layer_flops(blocked, 3, 7, counted="executed").expert_out == 2 * 16 * 4 * 7 * 6


@pytest.mark.parametrize("cfg", [
    MoEConfig(d_model=128, num_experts=4, top_k=2, expert_hidden=256, dispatch="capacity", capacity_factor=1.0),
    MoEConfig(d_model=128, num_experts=4, top_k=2, expert_hidden=256, dispatch="capacity", capacity_factor=1.0,
              mlp_kind="gelu", shared_expert_hidden=96, shared_expert_gate=True),
    # Every expert chosen by every token (k = E): executed, active and a dense MLP per expert coincide.
    MoEConfig(d_model=128, num_experts=2, top_k=2, expert_hidden=256, dispatch="capacity", capacity_factor=1.0),
], ids=["swiglu", "gelu_shared", "k_equals_e"])
def test_executed_flops_match_xla_on_the_capacity_forward(cfg):
    """Within 3%: the remainder is the elementwise work the count leaves out (softmax, activation, slots)."""
    model = MoE(cfg, rngs=nnx.Rngs(0))
    x_btd = jnp.ones((2, 32, cfg.d_model))
    xla = jax.jit(lambda x: model.apply(x)[0]).lower(x_btd).compile().cost_analysis()["flops"]
    counted = moe_layer_flops(cfg, 2, 32, counted="executed").total
    assert counted <= xla <= 1.03 * counted
    if cfg.top_k == cfg.num_experts:
        assert counted == moe_layer_flops(cfg, 2, 32).total
