"""A block for the train-step tests of auxiliary outputs that emits a value of its own. A recipe names it with
`block=aux_test_blocks:EmitsResidualScale` (this folder is on sys.path under pytest), so no model family is
added. The MoE blocks those tests train are benchmarks/moe_blocks.py's tiny ones (top-2 of 5 experts)."""

import jax.numpy as jnp

from spillway.layers import aux_outputs
from spillway.layers.block import TransformerBlock


class EmitsResidualScale(TransformerBlock):
    """A dense block that emits the mean absolute value of its output under "resid_scale": a value no
    loss term knows, which the step must carry to its metrics all the same."""

    def forward(self, x_btd, ctx, cache=None):
        y_btd, cache = super().forward(x_btd, ctx, cache)
        aux_outputs.emit("resid_scale", jnp.mean(jnp.abs(y_btd.astype(jnp.float32))))
        return y_btd, cache
