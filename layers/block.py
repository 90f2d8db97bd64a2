"""TransformerBlock: the offload-aware block users subclass.

The base class builds the four standard sublayers from a narrow `BlockConfig`
(attn_norm, attn, mlp_norm, mlp), each through a small factory method a
subclass can override, and runs a pre-norm block (Llama, GPT-2, Mistral, Qwen).
With `post_norms` (Gemma 2 and 3) it also builds post_attn_norm and
post_mlp_norm, applied to each sublayer's output before its residual add. Its
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
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from spillway.layers import names
from spillway.layers.attention import Attention, check_head_layout
from spillway.layers.errors import ConfigError, require_positive, require_positive_finite
from spillway.layers.execution import Execution
from spillway.layers.layer_values import LayerValues
from spillway.layers.mlp import ACTIVATIONS, GATED, MLP
from spillway.layers.moe import MoE, MoEConfig
from spillway.layers.norm import NORM_KINDS, make_norm
from spillway.layers.rope import RopeScaling


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """What one block needs to know; never the whole model or recipe.

    The architecture switches cover the dense families: the norm kind ("rms" |
    "rms_plus_one" | "layer"), attention options (q/k/v and output biases, q/k
    RMSNorm, RoPE or none, a sliding window, logit soft-capping, the score
    scale), post-norms on the sublayer outputs, and the MLP (gated or plain,
    with or without biases). How it runs (dtypes, attention kernel, init
    scale) is `execution`.

    Gemma's switches: `attn_softcap` c turns the attention scores s into
    c * tanh(s / c) before the mask and softmax (Gemma 2: 50.0); `query_scale`
    is the factor the scores q.k use (None: 1 / sqrt(head_dim); Gemma:
    query_pre_attn_scalar ** -0.5); norm="rms_plus_one" is the (1 + w) RMSNorm,
    used by q/k norm too when `qk_norm` is on; `post_norms` adds post_attn_norm
    and post_mlp_norm (Hugging Face's post_attention_layernorm and
    post_feedforward_layernorm); mlp_kind="geglu" is the tanh-approximated
    GELU gated MLP (Gemma's gelu_pytorch_tanh). Per-layer sliding windows and
    RoPE bases come through `BlockContext.layer_values`, not from here.

    `moe` makes the MLP slot a mixture-of-experts layer (layers/moe.py, a
    sparse layer of Mixtral or Qwen3-MoE); None is the dense MLP of
    `mlp_hidden` / `mlp_kind`. The MoE config's d_model must be the block's,
    and the block's `execution` replaces the MoE config's (one recipe
    setting governs the whole block). A model mixing dense and sparse layers
    gives each kind its own run (layers/layer_pattern.py StackRun).
    """

    d_model: int
    num_heads: int
    num_kv_heads: int
    mlp_hidden: int
    head_dim: int | None = None
    norm: str = "rms"               # "rms" | "layer" (layers/norm.py)
    norm_eps: float = 1e-5
    mlp_kind: str = "swiglu"        # "swiglu" | "geglu" | "gelu" (layers/mlp.py)
    mlp_bias: bool = False
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: bool = False
    rope: bool = True
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    attn_softcap: float | None = None   # scores -> cap * tanh(scores / cap); None: no cap
    query_scale: float | None = None    # score factor; None: 1 / sqrt(head_dim)
    post_norms: bool = False            # norms on the attention and MLP outputs before each residual add
    moe: MoEConfig | None = None        # the MLP slot is this mixture-of-experts layer; None: the dense MLP
    execution: Execution = Execution()

    def __post_init__(self):
        require_positive("BlockConfig", d_model=self.d_model, num_heads=self.num_heads,
                         num_kv_heads=self.num_kv_heads, mlp_hidden=self.mlp_hidden, head_dim=self.head_dim,
                         norm_eps=self.norm_eps, rope_theta=self.rope_theta, sliding_window=self.sliding_window)
        check_head_layout(self.d_model, self.num_heads, self.num_kv_heads, self.head_dim)
        if self.rope and self.resolved_head_dim % 2:
            raise ConfigError(f"RoPE rotates pairs of dimensions: head_dim must be even, got {self.resolved_head_dim}")
        if self.norm not in NORM_KINDS:
            raise ConfigError(f"BlockConfig.norm must be one of {NORM_KINDS}, got {self.norm!r}")
        if self.mlp_kind not in ACTIVATIONS:
            raise ConfigError(f"BlockConfig.mlp_kind must be one of {sorted(ACTIVATIONS)}, got {self.mlp_kind!r}")
        require_positive_finite("BlockConfig", attn_softcap=self.attn_softcap, query_scale=self.query_scale)
        if self.attn_softcap is not None and self.execution.attention_impl == "cudnn":
            raise ConfigError(f"BlockConfig.attn_softcap={self.attn_softcap}: cuDNN's fused attention has no "
                              f"logit soft-capping; use execution.attention_impl=flash (or xla)")
        if self.moe is not None:
            if self.moe.d_model != self.d_model:
                raise ConfigError(f"BlockConfig.moe.d_model ({self.moe.d_model}) differs from the block's "
                                  f"d_model ({self.d_model})")
            if self.moe.execution != self.execution:
                object.__setattr__(self, "moe", dataclasses.replace(self.moe, execution=self.execution))

    @property
    def qk_norm_kind(self) -> str:
        """The norm q/k norm uses: Gemma's (1 + w) RMSNorm in a Gemma block, plain RMSNorm otherwise."""
        return "rms_plus_one" if self.norm == "rms_plus_one" else "rms"

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    @property
    def gated_mlp(self) -> bool:
        return self.mlp_kind in GATED


class BlockContext(NamedTuple):
    """Per-call inputs shared by all layers: token positions, when decoding where to write the cache, and
    this layer's traced values (window, RoPE base and scale; layers/layer_values.py) where layers differ.

    `layer_values` None: every layer uses its static BlockConfig (the program is what it was before
    LayerValues existed). Given: they replace BlockConfig.sliding_window and rope_theta for this call.
    """

    positions_bt: jax.Array
    cache_index: jax.Array | None = None
    layer_values: LayerValues | None = None
    # Packed examples that do not see each other: each token's example id [b, t] (layers/segment_mask.py);
    # None: one sequence per row.
    segment_ids_bt: jax.Array | None = None


class TransformerBlock(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)); with post_norms (Gemma)
    x + post_attn_norm(attn(norm(x))), then + post_mlp_norm(mlp(norm(x)))."""

    def __init__(self, cfg: BlockConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.attn_norm = self.make_norm(rngs)
        self.attn = self.make_attention(rngs)
        # Only made when asked for: a subclass may add its own post_attn_norm (an attribute set to None here
        # would be static, and nnx refuses a module assigned to it later).
        if cfg.post_norms:
            self.post_attn_norm = self.make_norm(rngs)
        self.mlp_norm = self.make_norm(rngs)
        self.mlp = self.make_mlp(rngs)
        if cfg.post_norms:
            self.post_mlp_norm = self.make_norm(rngs)

    # Factories: a subclass overrides one to swap a part (a MoE layer for the MLP, say).
    def make_norm(self, rngs: nnx.Rngs) -> nnx.Module:
        return make_norm(self.cfg.norm, self.cfg.d_model, eps=self.cfg.norm_eps, rngs=rngs)

    def make_attention(self, rngs: nnx.Rngs) -> nnx.Module:
        cfg, ex = self.cfg, self.cfg.execution
        return Attention(
            cfg.d_model, cfg.num_heads, cfg.num_kv_heads, head_dim=cfg.head_dim, rope=cfg.rope,
            rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling, sliding_window=cfg.sliding_window,
            impl=ex.attention_impl, qkv_bias=cfg.qkv_bias, out_bias=cfg.out_bias, qk_norm=cfg.qk_norm,
            qk_norm_eps=cfg.norm_eps, qk_norm_kind=cfg.qk_norm_kind, softcap=cfg.attn_softcap,
            scale=cfg.query_scale, dtype=ex.compute_dtype, param_dtype=ex.parameter_dtype,
            init_std=ex.init_std, flash_block_size=ex.flash_block_size, rngs=rngs)

    def make_mlp(self, rngs: nnx.Rngs) -> nnx.Module:
        cfg, ex = self.cfg, self.cfg.execution
        if cfg.moe is not None:
            return MoE(cfg.moe, rngs=rngs)
        return MLP(cfg.d_model, cfg.mlp_hidden, kind=cfg.mlp_kind, bias=cfg.mlp_bias, dtype=ex.compute_dtype,
                   param_dtype=ex.parameter_dtype, init_std=ex.init_std, rngs=rngs)

    def __call__(self, x_btd: jax.Array, ctx: BlockContext, cache: dict | None = None):
        """Returns (x_btd, cache). Tags the block input so policies can offload it."""
        x_btd = checkpoint_name(x_btd, names.BLOCK_INPUT)
        return self.forward(x_btd, ctx, cache)

    def attention(self, h_btd: jax.Array, ctx: BlockContext, cache: dict | None):
        """Self-attention of an already normalised input; returns (out_btd, cache)."""
        return self.attn(h_btd, ctx.positions_bt, cache, ctx.cache_index, layer_values=ctx.layer_values,
                         segment_ids_bt=ctx.segment_ids_bt)

    def forward(self, x_btd: jax.Array, ctx: BlockContext, cache: dict | None):
        attn_btd, cache = self.attention(self.attn_norm(x_btd), ctx, cache)
        if self.cfg.post_norms:
            attn_btd = self.post_attn_norm(attn_btd)
        x_btd = x_btd + attn_btd
        mlp_btd = self.mlp(self.mlp_norm(x_btd))
        if self.cfg.post_norms:
            mlp_btd = self.post_mlp_norm(mlp_btd)
        return x_btd + mlp_btd, cache
