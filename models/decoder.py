"""DecoderLM: the decoder-only language model every dense family builds, and its shape description.

A family's config (models/llama.py, gpt2.py, ...) holds its architecture in its
own words; `decoder_spec(execution)` turns it into a `DecoderSpec`, which is all
the generic code needs: the model is built from it, parameters and FLOPs are
counted from it, and the KV cache is laid out from it.

    tokens -> embedding (* embed_scale) (+ learned positions) -> BlockStack
           -> final norm -> head (tied to the embedding or separate) -> logits

`DecoderLM` answers `model(tokens_bt)` with logits [batch, seq, vocab], and
`model(tokens_bt, cache=..., cache_index=...)` with (logits, cache) when
decoding; `hidden_states` / `split_head` let a loss apply the head a chunk of
tokens at a time.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spillway.layers.block import BlockConfig, BlockContext, TransformerBlock
from spillway.layers.embed import Embedding, LMHead, PositionEmbedding
from spillway.layers.errors import ConfigError
from spillway.layers.execution import Execution
from spillway.layers.norm import make_norm
from spillway.layers.offload import OffloadPolicy, RematPlan
from spillway.layers.stack import BlockStack


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    """The shape of a decoder-only model: what generic code may ask of any dense family.

    Every layer is the same block (`block`): the stack is one scan over
    identical layers. That is what refuses per-layer attention patterns today
    (Gemma 2/3's alternating local sliding-window and global layers, Qwen
    configs that window only some layers; see `PER_LAYER_PATTERN_NEEDS`).
    Supporting them would take, in this order:

      1. a layer pattern here: `blocks: tuple[BlockConfig, ...]`, one config
         per layer kind, repeated to `num_layers` (Gemma 3: five local, one
         global), with `layer_params`, `kv_cache_shape` and the FLOP count
         (models/flops.py) summed per kind, windows per kind;
      2. BlockStack (layers/stack.py) scanning over repetitions of the pattern
         (the scanned body holds one block of each kind) plus a remainder,
         so a heterogeneous stack stays one scan and RematPlan segments and
         offload policies still apply per layer;
      3. Hugging Face tables whose `{i}` maps to (repetition, kind) (models/hf.py).

    Gemma also needs block parts (post-attention and post-MLP norms,
    attention and final-logit soft-capping) that are a block subclass or
    BlockConfig switches, not spec changes; `embed_scale` is already here.
    """

    vocab_size: int
    num_layers: int
    max_seq_len: int
    block: BlockConfig
    tie_embeddings: bool = False
    learned_positions: bool = False     # GPT-2: a learned vector per position, added to the embedding
    embed_scale: float | None = None    # multiply the embedding by this (Gemma: sqrt(d_model))

    def __post_init__(self):
        for field in ("vocab_size", "num_layers", "max_seq_len", "embed_scale"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ConfigError(f"{field} must be positive, got {value}")

    @property
    def d_model(self) -> int:
        return self.block.d_model

    def layer_params(self) -> int:
        """Parameters of one block, counted from its config."""
        b = self.block
        d, h, n, kv, f = b.d_model, b.resolved_head_dim, b.num_heads, b.num_kv_heads, b.mlp_hidden
        norm = d * (2 if b.norm == "layer" else 1)
        attn = d * h * (2 * n + 2 * kv)
        attn += (n + 2 * kv) * h if b.qkv_bias else 0
        attn += d if b.out_bias else 0
        attn += 2 * h if b.qk_norm else 0
        mlp = (3 if b.gated_mlp else 2) * d * f
        mlp += ((2 if b.gated_mlp else 1) * f + d) if b.mlp_bias else 0
        return 2 * norm + attn + mlp

    def num_params(self) -> int:
        """Parameter count from the shapes alone (no allocation)."""
        d = self.d_model
        embed = self.vocab_size * d
        positions = self.max_seq_len * d if self.learned_positions else 0
        final_norm = d * (2 if self.block.norm == "layer" else 1)
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return embed + positions + self.num_layers * self.layer_params() + final_norm + head

    def kv_cache_shape(self, batch: int, max_len: int) -> tuple[int, ...]:
        """Shape of each of the K and V caches: [layers, batch, max_len, kv_heads, head_dim]."""
        return (self.num_layers, batch, max_len, self.block.num_kv_heads, self.block.resolved_head_dim)


# Appended to refusals of configs whose layers differ (models/qwen.py), so the user learns what is missing.
PER_LAYER_PATTERN_NEEDS = ("spillway's stack repeats one block kind in every layer; a per-layer attention pattern "
                           "needs a layer pattern in DecoderSpec and a BlockStack that scans over its repetitions "
                           "(models/decoder.py, DecoderSpec)")


class DecoderLM(nnx.Module):
    """Embedding, a scanned BlockStack of offload-aware blocks, final norm, output head."""

    def __init__(self, config, execution: Execution = Execution(), *, rngs: nnx.Rngs,
                 remat: str | OffloadPolicy | RematPlan = "recompute_all", block_cls: type = TransformerBlock):
        """`config`: a family's config (anything with decoder_spec(execution)); `remat`: the activation plan."""
        self.config = config   # the family's own description (models/hf.py exports with it)
        self.spec = spec = config.decoder_spec(execution)
        ex = execution
        dtype, param_dtype = ex.compute_dtype, ex.parameter_dtype
        self.embed = Embedding(spec.vocab_size, spec.d_model, dtype=dtype, param_dtype=param_dtype,
                               init_std=ex.init_std, rngs=rngs)
        self.positions = PositionEmbedding(spec.max_seq_len, spec.d_model, dtype=dtype, param_dtype=param_dtype,
                                           init_std=ex.init_std, rngs=rngs) if spec.learned_positions else None
        self.layers = BlockStack(spec.block, spec.num_layers, block_cls=block_cls, remat=remat, rngs=rngs)
        self.final_norm = make_norm(spec.block.norm, spec.d_model, eps=spec.block.norm_eps, rngs=rngs)
        self.head = None if spec.tie_embeddings else LMHead(
            spec.d_model, spec.vocab_size, dtype=dtype, param_dtype=param_dtype, init_std=ex.init_std, rngs=rngs)

    def __call__(self, tokens_bt: jax.Array, positions_bt: jax.Array | None = None,
                 cache: dict | None = None, cache_index: jax.Array | None = None):
        """Logits [b, t, vocab] in the compute dtype; with a cache, returns (logits, cache)."""
        if positions_bt is None:
            start = 0 if cache_index is None else cache_index
            positions_bt = jnp.broadcast_to(start + jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        x_btd, new_cache = self.hidden_states(tokens_bt, positions_bt, cache, cache_index)
        logits_btv = self.logits(x_btd)
        return logits_btv if cache is None else (logits_btv, new_cache)

    def embed_tokens(self, tokens_bt: jax.Array, positions_bt: jax.Array) -> jax.Array:
        x_btd = self.embed(tokens_bt)
        if self.spec.embed_scale is not None:
            x_btd = x_btd * jnp.asarray(self.spec.embed_scale, x_btd.dtype)
        if self.positions is not None:
            x_btd = x_btd + self.positions(positions_bt)
        return x_btd

    def hidden_states(self, tokens_bt: jax.Array, positions_bt: jax.Array, cache: dict | None = None,
                      cache_index: jax.Array | None = None):
        """Final-normed hidden states [b, t, d] (and the cache): everything but the output head.

        Split from `logits` so a loss can apply the head a chunk of tokens at a
        time and never hold all [t, vocab] logits (recipes/train/loss.py).
        """
        x_btd = self.embed_tokens(tokens_bt, positions_bt)
        x_btd, new_cache = self.layers(x_btd, BlockContext(positions_bt, cache_index), cache)
        return self.final_norm(x_btd), new_cache

    def logits(self, x_btd: jax.Array) -> jax.Array:
        return self.embed.attend(x_btd) if self.head is None else self.head(x_btd)

    def split_head(self):
        """(logits_fn, head_params) with logits_fn(head_params, x) == self.logits(x).

        The output head as a pure function of its own parameters (the tied
        embedding table or the separate head), for losses that need the head's
        gradient explicitly (the chunked loss).
        """
        module = self.embed if self.head is None else self.head
        graphdef, head_params = nnx.split(module)

        def logits_fn(head_params, x_btd):
            head = nnx.merge(graphdef, head_params)
            return head.attend(x_btd) if isinstance(head, Embedding) else head(x_btd)

        return logits_fn, head_params

    def init_cache(self, batch: int, max_len: int, dtype=None) -> dict:
        """Zeroed KV cache for decoding: {"k", "v"}: [layers, batch, max_len, kv_heads, head_dim]."""
        if self.positions is not None and max_len > self.spec.max_seq_len:
            raise ValueError(f"a cache of {max_len} positions exceeds the model's {self.spec.max_seq_len} "
                             f"learned positions")
        shape = self.spec.kv_cache_shape(batch, max_len)
        dtype = jnp.dtype(dtype or self.spec.block.execution.dtype)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def count_params(model_or_build) -> int:
    """Parameters of a built model (or of `build()` evaluated abstractly: nothing allocated)."""
    model = model_or_build if isinstance(model_or_build, nnx.Module) else nnx.eval_shape(model_or_build)
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))))
