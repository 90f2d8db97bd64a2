"""A TransformerBlock whose MLP is a given MoE layer, for a BlockConfig that does not name one.

`moe_block(moe_cfg)` returns a `TransformerBlock` subclass (named MoEBlock)
whose `make_mlp` builds `MoE(moe_cfg)`; attention, norms and the pre-norm
forward are the base block's. The families describe their MoE layers in
`BlockConfig.moe` instead (layers/block.py: the base block builds the MoE layer
itself, and parameter and FLOP counts read it); this class stays for stacks
built from a plain BlockConfig (the layer tests and benchmarks). The class is
made once per config, so graphdefs (jit's static arguments) of two stacks
with equal configs compare equal.
"""

from __future__ import annotations

import functools

from flax import nnx

from spillway.layers.block import TransformerBlock
from spillway.layers.moe import MoE, MoEConfig


@functools.lru_cache(maxsize=None)
def moe_block(moe_cfg: MoEConfig) -> type[TransformerBlock]:
    class MoEBlock(TransformerBlock):
        def make_mlp(self, rngs: nnx.Rngs) -> nnx.Module:
            if self.cfg.d_model != moe_cfg.d_model:
                raise ValueError(f"the block's d_model ({self.cfg.d_model}) differs from its MoE layer's "
                                 f"({moe_cfg.d_model})")
            return MoE(moe_cfg, rngs=rngs)

    MoEBlock.__qualname__ = "MoEBlock"
    return MoEBlock
