"""Blocks for the train-step tests of auxiliary outputs: Llama's block with an MoE layer in its MLP slot
(layers/moe_block.py), and one that emits a value of its own. A recipe names them with
`block=moe_test_blocks:NAME` (this folder is on sys.path under pytest), so no model family is added.

Odd sizes on purpose: top-2 of 5 experts, d_model 32 (the test recipes' model.d_model).
"""

import jax.numpy as jnp

from spillway.layers import aux_outputs
from spillway.layers.block import TransformerBlock
from spillway.layers.moe import MoEConfig
from spillway.layers.moe_block import moe_block

D_MODEL = 32
NUM_EXPERTS, TOP_K = 5, 2

DROPLESS_CFG = MoEConfig(d_model=D_MODEL, num_experts=NUM_EXPERTS, top_k=TOP_K, expert_hidden=24)
CAPACITY_CFG = MoEConfig(d_model=D_MODEL, num_experts=NUM_EXPERTS, top_k=TOP_K, expert_hidden=24,
                         dispatch="capacity", capacity_factor=1.0)

Dropless = moe_block(DROPLESS_CFG)
Capacity = moe_block(CAPACITY_CFG)


class EmitsResidualScale(TransformerBlock):
    """A dense block that emits the mean absolute value of its output under "resid_scale": a value no
    loss term knows, which the step must carry to its metrics all the same."""

    def forward(self, x_btd, ctx, cache=None):
        y_btd, cache = super().forward(x_btd, ctx, cache)
        aux_outputs.emit("resid_scale", jnp.mean(jnp.abs(y_btd.astype(jnp.float32))))
        return y_btd, cache
