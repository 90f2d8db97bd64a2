"""Llama 2, 3, 3.1 and 3.2: config presets at their published sizes, and the model.

One readable file: `LlamaConfig` (a frozen dataclass, with presets by name) and
`Llama` (embedding, a BlockStack of offload-aware TransformerBlocks, final
RMSNorm, tied or separate output head). Architecture differences between the
generations are all config: vocabulary, GQA, RoPE theta, Llama 3.1/3.2 RoPE
scaling, tied embeddings (3.2 1B/3B).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from layers.block import BlockConfig, BlockContext, TransformerBlock
from layers.embed import Embedding, LMHead
from layers.norm import RMSNorm
from layers.offload import OffloadPolicy, RematPlan
from layers.rope import RopeScaling
from layers.stack import BlockStack


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    mlp_hidden: int
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 4096
    sliding_window: int | None = None
    attention_impl: str = "xla"     # "xla" | "cudnn" | "flash" (layers/attention.py)
    flash_block_size: int = 512
    dtype: str = "bfloat16"         # compute dtype
    param_dtype: str = "float32"
    remat: str = "recompute_all"    # a RematPlan spec: preset or "preset:K,preset"
    init_std: float = 0.02

    def __post_init__(self):
        for field in ("vocab_size", "num_layers", "max_seq_len"):
            if getattr(self, field) <= 0:
                raise ValueError(f"LlamaConfig.{field} must be positive, got {getattr(self, field)}")
        self.block_config()  # validates the head layout and sizes with field names
        RematPlan.parse(self.remat).resolve(self.num_layers)

    def block_config(self) -> BlockConfig:
        return BlockConfig(
            d_model=self.d_model, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            mlp_hidden=self.mlp_hidden, head_dim=self.head_dim, mlp_kind="swiglu", norm_eps=self.norm_eps,
            rope_theta=self.rope_theta, rope_scaling=self.rope_scaling, sliding_window=self.sliding_window,
            attention_impl=self.attention_impl, flash_block_size=self.flash_block_size,
            dtype=self.dtype, param_dtype=self.param_dtype, init_std=self.init_std)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    def num_params(self) -> int:
        """Parameter count from the shapes alone (no allocation)."""
        h = self.resolved_head_dim
        attn = self.d_model * h * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.d_model * self.mlp_hidden
        per_layer = attn + mlp + 2 * self.d_model
        head = 0 if self.tie_embeddings else self.vocab_size * self.d_model
        return self.vocab_size * self.d_model + self.num_layers * per_layer + self.d_model + head

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), without remat recompute.

        6 * (non-embedding-lookup params) for the matmuls plus the attention scores
        and context: 6 * layers * seq * heads * head_dim (causal halves the 12).
        """
        matmul_params = self.num_params() - self.vocab_size * self.d_model * (0 if self.tie_embeddings else 1)
        matmul_params -= self.num_layers * 2 * self.d_model + self.d_model  # norms are not matmuls
        attention = 6 * self.num_layers * seq_len * self.num_heads * self.resolved_head_dim
        return 6.0 * matmul_params + attention


_LLAMA31_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)
_LLAMA32_SCALING = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)

PRESETS: dict[str, LlamaConfig] = {
    "llama2_7b": LlamaConfig(vocab_size=32000, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=32,
                             mlp_hidden=11008, norm_eps=1e-5, max_seq_len=4096),
    "llama3_8b": LlamaConfig(vocab_size=128256, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                             mlp_hidden=14336, rope_theta=500000.0, max_seq_len=8192),
    "llama3_1_8b": LlamaConfig(vocab_size=128256, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                               mlp_hidden=14336, rope_theta=500000.0, rope_scaling=_LLAMA31_SCALING,
                               max_seq_len=131072),
    "llama3_1_70b": LlamaConfig(vocab_size=128256, d_model=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                                mlp_hidden=28672, rope_theta=500000.0, rope_scaling=_LLAMA31_SCALING,
                                max_seq_len=131072),
    "llama3_2_1b": LlamaConfig(vocab_size=128256, d_model=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                               mlp_hidden=8192, rope_theta=500000.0, rope_scaling=_LLAMA32_SCALING,
                               tie_embeddings=True, max_seq_len=131072),
    "llama3_2_3b": LlamaConfig(vocab_size=128256, d_model=3072, num_layers=28, num_heads=24, num_kv_heads=8,
                               mlp_hidden=8192, rope_theta=500000.0, rope_scaling=_LLAMA32_SCALING,
                               tie_embeddings=True, max_seq_len=131072),
    # Test and CPU sizes. Odd numbers on purpose in "tiny_odd" to catch shape bugs.
    "tiny": LlamaConfig(vocab_size=4096, d_model=256, num_layers=4, num_heads=8, num_kv_heads=4,
                        mlp_hidden=704, max_seq_len=256, dtype="float32"),
    "tiny_odd": LlamaConfig(vocab_size=131, d_model=60, num_layers=3, num_heads=6, num_kv_heads=2,
                            mlp_hidden=92, max_seq_len=64, rope_scaling=_LLAMA31_SCALING, rope_theta=500000.0,
                            dtype="float32"),
}


def llama_config(name: str, **overrides) -> LlamaConfig:
    try:
        base = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown Llama preset {name!r}; known presets: {sorted(PRESETS)}") from None
    return dataclasses.replace(base, **overrides)


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, block_cls: type = TransformerBlock,
                 remat: str | OffloadPolicy | RematPlan | None = None):
        self.cfg = cfg
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        self.embed = Embedding(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=param_dtype,
                               init_std=cfg.init_std, rngs=rngs)
        self.layers = BlockStack(cfg.block_config(), cfg.num_layers, block_cls=block_cls,
                                 remat=cfg.remat if remat is None else remat, rngs=rngs)
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.head = None if cfg.tie_embeddings else LMHead(
            cfg.d_model, cfg.vocab_size, dtype=dtype, param_dtype=param_dtype, init_std=cfg.init_std, rngs=rngs)

    def __call__(self, tokens_bt: jax.Array, positions_bt: jax.Array | None = None,
                 cache: dict | None = None, cache_index: jax.Array | None = None):
        """Logits [b, t, vocab] in the compute dtype; with a cache, returns (logits, cache)."""
        if positions_bt is None:
            start = 0 if cache_index is None else cache_index
            positions_bt = jnp.broadcast_to(start + jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        x_btd, new_cache = self.hidden_states(tokens_bt, positions_bt, cache, cache_index)
        logits_btv = self.logits(x_btd)
        return logits_btv if cache is None else (logits_btv, new_cache)

    def hidden_states(self, tokens_bt: jax.Array, positions_bt: jax.Array, cache: dict | None = None,
                      cache_index: jax.Array | None = None):
        """Final-normed hidden states [b, t, d] (and the cache): everything but the output head.

        Split from `logits` so a loss can apply the head a chunk of tokens at a
        time and never hold all [t, vocab] logits (recipes/train.py).
        """
        x_btd = self.embed(tokens_bt)
        x_btd, new_cache = self.layers(x_btd, BlockContext(positions_bt, cache_index), cache)
        return self.final_norm(x_btd), new_cache

    def logits(self, x_btd: jax.Array) -> jax.Array:
        return self.embed.attend(x_btd) if self.head is None else self.head(x_btd)

    def split_head(self):
        """(logits_fn, head_params) with logits_fn(head_params, x) == self.logits(x).

        The output head as a pure function of its own parameters (the tied
        embedding table or the separate head), for losses that need the head's
        gradient explicitly (recipes/train.py's chunked loss).
        """
        module = self.embed if self.head is None else self.head
        graphdef, head_params = nnx.split(module)

        def logits_fn(head_params, x_btd):
            head = nnx.merge(graphdef, head_params)
            return head.attend(x_btd) if isinstance(head, Embedding) else head(x_btd)

        return logits_fn, head_params

    def init_cache(self, batch: int, max_len: int, dtype=None) -> dict:
        """Zeroed KV cache for decoding: {"k", "v"}: [layers, batch, max_len, kv_heads, head_dim]."""
        cfg = self.cfg
        shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.resolved_head_dim)
        dtype = jnp.dtype(dtype or cfg.dtype)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def count_params(cfg: LlamaConfig) -> int:
    """Parameters of the built model, counted from abstract shapes (nothing allocated)."""
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param))))
