"""TransformerBlock: the offload-aware block users subclass.

The base class builds the four standard sublayers from a narrow `BlockConfig`
(attn_norm, attn, mlp_norm, mlp) and runs a pre-norm Llama block. Its
`__call__` tags the block input (BLOCK_INPUT) and hands over to `forward`,
which subclasses override. Because attention and MLP tag QKV, ATTN_CONTEXT,
ATTN_OUT, MLP_HIDDEN and MLP_OUT themselves, a subclass that reuses them (or
tags the same names) gets every OffloadPolicy for free: remat and offload are
applied from outside by BlockStack, never inside the block.

    class ParallelBlock(TransformerBlock):
        def forward(self, x_btd, ctx, cache):
            h_btd = self.attn_norm(x_btd)
            attn_btd, cache = self.attention(h_btd, ctx, cache)
            return x_btd + attn_btd + self.mlp(h_btd), cache
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from layers import names
from layers.attention import Attention, check_head_layout
from layers.mlp import MLP
from layers.norm import RMSNorm
from layers.rope import RopeScaling


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """What one block needs to know; never the whole model or recipe."""

    d_model: int
    num_heads: int
    num_kv_heads: int
    mlp_hidden: int
    head_dim: int | None = None
    mlp_kind: str = "swiglu"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    attention_impl: str = "xla"
    flash_block_size: int = 512
    qkv_bias: bool = False
    dtype: str = "float32"          # compute dtype
    param_dtype: str = "float32"
    init_std: float = 0.02

    def __post_init__(self):
        for field in ("d_model", "num_heads", "num_kv_heads", "mlp_hidden"):
            if getattr(self, field) <= 0:
                raise ValueError(f"BlockConfig.{field} must be positive, got {getattr(self, field)}")
        check_head_layout(self.d_model, self.num_heads, self.num_kv_heads, self.head_dim)


class BlockContext(NamedTuple):
    """Per-call inputs shared by all layers: token positions and, when decoding, where to write the cache."""

    positions_bt: jax.Array
    cache_index: jax.Array | None = None


class TransformerBlock(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: BlockConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.attn = Attention(
            cfg.d_model, cfg.num_heads, cfg.num_kv_heads, head_dim=cfg.head_dim,
            rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling, sliding_window=cfg.sliding_window,
            impl=cfg.attention_impl, qkv_bias=cfg.qkv_bias, dtype=dtype, param_dtype=param_dtype,
            init_std=cfg.init_std, flash_block_size=cfg.flash_block_size, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.mlp = MLP(cfg.d_model, cfg.mlp_hidden, kind=cfg.mlp_kind, dtype=dtype, param_dtype=param_dtype,
                       init_std=cfg.init_std, rngs=rngs)

    def __call__(self, x_btd: jax.Array, ctx: BlockContext, cache: dict | None = None):
        """Returns (x_btd, cache). Tags the block input so policies can offload it."""
        x_btd = checkpoint_name(x_btd, names.BLOCK_INPUT)
        return self.forward(x_btd, ctx, cache)

    def attention(self, h_btd: jax.Array, ctx: BlockContext, cache: dict | None):
        """Self-attention of an already normalised input; returns (out_btd, cache)."""
        return self.attn(h_btd, ctx.positions_bt, cache, ctx.cache_index)

    def forward(self, x_btd: jax.Array, ctx: BlockContext, cache: dict | None):
        attn_btd, cache = self.attention(self.attn_norm(x_btd), ctx, cache)
        x_btd = x_btd + attn_btd
        x_btd = x_btd + self.mlp(self.mlp_norm(x_btd))
        return x_btd, cache
