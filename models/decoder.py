"""DecoderLM: the decoder-only language model every dense family builds, and its shape description.

A family's config (models/llama.py, gpt2.py, ...) holds its architecture in its
own words; `decoder_spec(execution)` turns it into a `DecoderSpec`, which is all
the generic code needs: the model is built from it, parameters and FLOPs are
counted from it, and the KV cache is laid out from it.

    tokens -> embedding (* embed_scale) (+ learned positions) -> BlockStack
           -> final norm -> head (tied to the embedding or separate) -> logits (soft-capped)

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
from spillway.layers.layer_pattern import LayerSettings, StackRun, check_runs, needs_values, run_bounds
from spillway.layers.moe import MoEConfig
from spillway.layers.norm import make_norm
from spillway.layers.offload import OffloadPolicy, RematPlan
from spillway.layers.stack import BlockStack


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    """The shape of a decoder-only model: what generic code may ask of any family.

    `block` is every layer's structure (and its static window and RoPE base).
    Layers may differ two ways (layers/layer_pattern.py, docs/DESIGN.md section 2):

      layer_settings  one `LayerSettings` per layer: the sliding window, RoPE
                      base and linear RoPE scale of that layer (Gemma 2's
                      alternating local/global layers, Gemma 3's five local
                      and one global). They are scanned as data beside the
                      weights: one weight stack, one compiled body.
      runs            consecutive layers of one structure (`StackRun`: a block
                      config, its layer count, optionally its block class), in
                      order, covering the stack; None is one run of `block`.
                      A mixture-of-experts family's dense layers among sparse
                      ones are runs (Qwen3-MoE's mlp_only_layers and
                      decoder_sparse_step: a run per stretch of dense or
                      sparse layers, models/qwen3_moe.py); the dense families,
                      Gemma and Mixtral are one run.

    Parameter counts (total and, for MoE layers, active: `num_params`), the
    KV cache and the FLOP count (models/flops.py) are summed over the layers'
    own configs (`layer_configs`).
    `final_logit_softcap` caps the logits, cap * tanh(logits / cap) (Gemma 2),
    wherever the head is applied: the model, the chunked loss and generation.
    """

    vocab_size: int
    num_layers: int
    max_seq_len: int
    block: BlockConfig
    tie_embeddings: bool = False
    learned_positions: bool = False     # GPT-2: a learned vector per position, added to the embedding
    embed_scale: float | None = None    # multiply the embedding by this, in the compute dtype (Gemma: sqrt(d_model))
    layer_settings: tuple[LayerSettings, ...] | None = None   # one per layer; None: every layer as its block says
    runs: tuple[StackRun, ...] | None = None                  # None: one run of `block` over every layer
    final_logit_softcap: float | None = None                  # Gemma 2: 30.0

    def __post_init__(self):
        for field in ("vocab_size", "num_layers", "max_seq_len", "embed_scale", "final_logit_softcap"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ConfigError(f"{field} must be positive, got {value}")
        if self.runs is not None:
            object.__setattr__(self, "runs", check_runs(self.runs, self.num_layers))
        if self.layer_settings is not None:
            object.__setattr__(self, "layer_settings", tuple(self.layer_settings))
            if len(self.layer_settings) != self.num_layers:
                raise ConfigError(f"{len(self.layer_settings)} per-layer settings for {self.num_layers} layers")
            windows = {s.sliding_window for s in self.layer_settings}
            widest = max((w for w in windows if w is not None), default=None)
            if None in windows and widest is not None and widest > self.max_seq_len:
                raise ConfigError(
                    f"the layer pattern mixes windowed and global layers, but its window ({widest}) is larger "
                    f"than max_seq_len ({self.max_seq_len}): every windowed layer would attend globally; "
                    f"shrink the window or give every layer global attention (to train a checkpoint on shorter "
                    f"sequences, keep its max_seq_len and set data.seq_len alone)")
        if self.block.execution.attention_impl == "cudnn" and needs_values(self.layer_settings, self.stack_runs()):
            raise ConfigError("attention_impl='cudnn' takes one static window for every layer; this model's "
                              "layers differ in their window or RoPE (a layer pattern): use attention_impl=flash")
        heads = {(r.block.num_kv_heads, r.block.resolved_head_dim) for r in self.stack_runs()}
        if len(heads) > 1:
            raise ConfigError(f"the runs of layers have different KV head layouts {sorted(heads)}: the KV cache "
                              f"is one stack over the layers")

    @property
    def d_model(self) -> int:
        return self.block.d_model

    def stack_runs(self) -> tuple[StackRun, ...]:
        """The runs of layers of one structure, first layers first (one run of `block` when `runs` is None)."""
        return self.runs or (StackRun(self.block, self.num_layers),)

    def layer_configs(self) -> tuple[BlockConfig, ...]:
        """Each layer's block config with its own window and RoPE base (what its FLOPs and parameters follow).

        A linear RoPE scale has no BlockConfig field; it changes neither.
        """
        configs = [run.block for run in self.stack_runs() for _ in range(run.num_layers)]
        if self.layer_settings is None:
            return tuple(configs)
        return tuple(dataclasses.replace(b, sliding_window=s.sliding_window, rope_theta=s.rope_theta)
                     for b, s in zip(configs, self.layer_settings, strict=True))

    @staticmethod
    def block_params(b: BlockConfig, *, active: bool = False) -> int:
        """Parameters of one block of config `b`, counted from its fields.

        `active`: of an MoE block, only what one token uses: the router, its
        top-k experts and any shared experts (all of a dense block is active).
        """
        d, h, n, kv, f = b.d_model, b.resolved_head_dim, b.num_heads, b.num_kv_heads, b.mlp_hidden
        norm = d * (2 if b.norm == "layer" else 1)
        norms = 4 if b.post_norms else 2    # pre-norms, and Gemma's post-attention and post-MLP norms
        attn = d * h * (2 * n + 2 * kv)
        attn += (n + 2 * kv) * h if b.qkv_bias else 0
        attn += d if b.out_bias else 0
        attn += 2 * h if b.qk_norm else 0
        if b.moe is not None:
            return norms * norm + attn + moe_params(b.moe, active=active)
        mlp = (3 if b.gated_mlp else 2) * d * f
        mlp += ((2 if b.gated_mlp else 1) * f + d) if b.mlp_bias else 0
        return norms * norm + attn + mlp

    def layer_params(self, layer: int = 0) -> int:
        """Parameters of one layer (default the first), counted from its run's block config."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is outside the model's {self.num_layers} layers")
        for (start, stop), run in zip(run_bounds(self.stack_runs()), self.stack_runs()):
            if start <= layer < stop:
                return self.block_params(run.block)
        raise AssertionError("unreachable: the runs cover the layers")

    def num_params(self, *, active: bool = False) -> int:
        """Parameter count from the shapes alone (no allocation), summed layer by layer.

        `active`: the parameters one token's forward pass uses: the embedding,
        every attention, norm and dense MLP, and of each MoE layer the router,
        the top-k experts and any shared experts; the output head. (The whole
        embedding table is counted, as the published "active" figures of
        Mixtral and Qwen3-MoE do, though a token reads one row of it.)
        """
        d = self.d_model
        embed = self.vocab_size * d
        positions = self.max_seq_len * d if self.learned_positions else 0
        layers = sum(r.num_layers * self.block_params(r.block, active=active) for r in self.stack_runs())
        final_norm = d * (2 if self.block.norm == "layer" else 1)
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return embed + positions + layers + final_norm + head

    def num_active_params(self) -> int:
        """`num_params(active=True)`: what a token uses (the total for a dense model)."""
        return self.num_params(active=True)

    def kv_cache_shape(self, batch: int, max_len: int) -> tuple[int, ...]:
        """Shape of each of the K and V caches: [layers, batch, max_len, kv_heads, head_dim].

        Every layer caches all `max_len` positions, windowed ones too (their
        mask hides what lies outside the window), so the cache is one stack.
        """
        return (self.num_layers, batch, max_len, self.block.num_kv_heads, self.block.resolved_head_dim)


def moe_params(moe: MoEConfig, *, active: bool = False) -> int:
    """Parameters of one MoE layer (layers/moe.py): router, experts (all, or the top-k `active` ones),
    shared experts and their gate."""
    d, f, fs = moe.d_model, moe.expert_hidden, moe.shared_expert_hidden
    matrices = 3 if moe.gated else 2
    experts = (moe.top_k if active else moe.num_experts) * matrices * d * f
    shared = matrices * d * fs + (d if moe.shared_expert_gate else 0)
    return d * moe.num_experts + experts + shared


def soft_cap(logits: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(logits / cap), computed in float32 and returned in the logits' dtype; `cap` None: unchanged."""
    if cap is None:
        return logits
    capped = cap * jnp.tanh(logits.astype(jnp.float32) / cap)
    return capped.astype(logits.dtype)


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
        self.layers = BlockStack(spec.block, spec.num_layers, block_cls=block_cls, remat=remat, rngs=rngs,
                                 runs=spec.runs, layer_settings=spec.layer_settings)
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
                      cache_index: jax.Array | None = None, *, segment_ids_bt: jax.Array | None = None):
        """Final-normed hidden states [b, t, d] (and the cache): everything but the output head.

        Split from `logits` so a loss can apply the head a chunk of tokens at a
        time and never hold all [t, vocab] logits (recipes/train/loss.py). `segment_ids_bt`: packed
        examples, each attending only to its own (layers/segment_mask.py).
        """
        x_btd = self.embed_tokens(tokens_bt, positions_bt)
        x_btd, new_cache = self.layers(x_btd, BlockContext(positions_bt, cache_index, segment_ids_bt=segment_ids_bt),
                                       cache)
        return self.final_norm(x_btd), new_cache

    def logits(self, x_btd: jax.Array) -> jax.Array:
        """The head's logits, soft-capped where the family caps them (Gemma 2)."""
        logits_btv = self.embed.attend(x_btd) if self.head is None else self.head(x_btd)
        return soft_cap(logits_btv, self.spec.final_logit_softcap)

    def split_head(self):
        """(logits_fn, head_params) with logits_fn(head_params, x) == self.logits(x).

        The output head as a pure function of its own parameters (the tied
        embedding table or the separate head), for losses that need the head's
        gradient explicitly (the chunked loss).
        """
        module = self.embed if self.head is None else self.head
        graphdef, head_params = nnx.split(module)
        cap = self.spec.final_logit_softcap

        def logits_fn(head_params, x_btd):
            head = nnx.merge(graphdef, head_params)
            return soft_cap(head.attend(x_btd) if isinstance(head, Embedding) else head(x_btd), cap)

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
