"""Gemma 2 and Gemma 3 (text): configs, presets at the published sizes, and their Hugging Face tables.

Both are decoders of one block structure whose layers differ in their
attention: a layer pattern of local layers ("L": a sliding window, the local
RoPE base) and global layers ("G": no window, the global RoPE base and, on
Gemma 3 4B and larger, a linear RoPE position scaling of 8), repeated over the
depth. Layer i is `layer_pattern[i % len(layer_pattern)]`; the depth need not
be a multiple of the period (Gemma 3 1B: 26 layers, four periods of six and two
more). The layers share their weights' shapes, so the stack is one weight
stack scanned with per-layer values (models/decoder.py DecoderSpec,
layers/layer_pattern.py).

    gemma2  "LG" (layer 0 local), window 4096, RoPE base 10,000 on both kinds,
            attention-logit soft-cap 50 and final-logit soft-cap 30.
    gemma3  "LLLLLG", window 512 (1B) or 1024, local base 10,000, global
            1,000,000 (x8 linear scaling on 4B and larger), q/k RMSNorm, no
            soft-caps.

Every Gemma block: RMSNorm with a (1 + w) scale (w starts at zero), pre- and
post-norms around attention and the MLP (Hugging Face's
`post_attention_layernorm` is the post-attention norm here, never a pre-MLP
norm as in Llama's table), the tanh-GELU gated MLP, scores scaled by
query_pre_attn_scalar ** -0.5, embeddings scaled by sqrt(d_model) in the compute
dtype, a head tied to the embedding.

Presets are the text towers (Gemma 3 4B, 12B and 27B are multimodal; their
vision tower is not modelled). Their Hugging Face embedding has 262,208 rows
(Google's JAX and Keras releases count 262,144: 64 * d_model fewer parameters).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from spillway.layers.block import BlockConfig
from spillway.layers.errors import ConfigError, require_positive
from spillway.layers.execution import Execution
from spillway.layers.layer_pattern import LayerSettings
from spillway.models import hf, hf_rows
from spillway.models.decoder import DecoderSpec
from spillway.models.registry import Family, register_family

LOCAL, GLOBAL = "L", "G"


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
    """The fields Gemma 2 and Gemma 3 share; architecture only (dtypes and kernels are `Execution`)."""

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_hidden: int
    layer_pattern: str = "LG"             # one period of "L" (local) and "G" (global) layers, repeated
    sliding_window: int = 4096            # the local layers' window
    rope_theta: float = 10000.0           # the global layers' RoPE base
    rope_local_theta: float = 10000.0     # the local layers' RoPE base
    rope_global_scale: float = 1.0        # linear position scaling of the global layers' RoPE (Gemma 3 4B+: 8)
    query_pre_attn_scalar: float = 256.0  # scores are scaled by query_pre_attn_scalar ** -0.5
    attn_softcap: float | None = None     # attention scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None    # logits -> cap * tanh(logits / cap)
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    max_seq_len: int = 8192

    QK_NORM: ClassVar[bool] = False       # Gemma 3 normalises each head's q and k

    def __post_init__(self):
        require_positive(type(self).__name__, vocab_size=self.vocab_size, d_model=self.d_model,
                         num_layers=self.num_layers, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                         head_dim=self.head_dim, mlp_hidden=self.mlp_hidden, sliding_window=self.sliding_window,
                         rope_theta=self.rope_theta, rope_local_theta=self.rope_local_theta,
                         rope_global_scale=self.rope_global_scale, query_pre_attn_scalar=self.query_pre_attn_scalar,
                         norm_eps=self.norm_eps, max_seq_len=self.max_seq_len)
        name = type(self).__name__
        for cap in ("attn_softcap", "final_softcap"):
            value = getattr(self, cap)
            if value is not None and not value > 0:
                raise ConfigError(f"{name}.{cap} must be positive (or None for no soft-cap), got {value}")
        kinds = set(self.layer_pattern)
        if not self.layer_pattern or not kinds <= {LOCAL, GLOBAL}:
            raise ConfigError(f"{name}.layer_pattern must be a non-empty string of {LOCAL!r} (local) and "
                              f"{GLOBAL!r} (global) layers, got {self.layer_pattern!r}")
        if len(self.layer_pattern) > self.num_layers:
            raise ConfigError(f"{name}.layer_pattern {self.layer_pattern!r} has {len(self.layer_pattern)} layers, "
                              f"more than the model's {self.num_layers}: the depth cannot follow it (the layers "
                              f"would be {self.layer_kinds()!r})")
        self.decoder_spec(Execution())   # the head layout and the window against max_seq_len, named

    def layer_kinds(self) -> str:
        """One letter per layer: "L" local, "G" global."""
        p = self.layer_pattern
        return "".join(p[i % len(p)] for i in range(self.num_layers))

    def layer_settings(self) -> tuple[LayerSettings, ...]:
        local = LayerSettings(sliding_window=self.sliding_window, rope_theta=self.rope_local_theta)
        global_ = LayerSettings(sliding_window=None, rope_theta=self.rope_theta, rope_scale=self.rope_global_scale)
        return tuple(local if kind == LOCAL else global_ for kind in self.layer_kinds())

    def block_config(self, execution: Execution = Execution()) -> BlockConfig:
        """Every layer's structure, with the global layers' values as its static ones."""
        return BlockConfig(
            d_model=self.d_model, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            mlp_hidden=self.mlp_hidden, head_dim=self.head_dim, norm="rms_plus_one", norm_eps=self.norm_eps,
            mlp_kind="geglu", qk_norm=self.QK_NORM, rope_theta=self.rope_theta, attn_softcap=self.attn_softcap,
            query_scale=self.query_pre_attn_scalar ** -0.5, post_norms=True, execution=execution)

    def decoder_spec(self, execution: Execution = Execution()) -> DecoderSpec:
        return DecoderSpec(vocab_size=self.vocab_size, num_layers=self.num_layers, max_seq_len=self.max_seq_len,
                           block=self.block_config(execution), tie_embeddings=self.tie_embeddings,
                           embed_scale=math.sqrt(self.d_model), layer_settings=self.layer_settings(),
                           final_logit_softcap=self.final_softcap)

    def num_params(self) -> int:
        return self.decoder_spec().num_params()


@dataclasses.dataclass(frozen=True)
class Gemma2Config(GemmaConfig):
    """Gemma 2: local and global layers alternating, soft-capped attention scores and logits."""

    layer_pattern: str = "LG"
    attn_softcap: float | None = 50.0
    final_softcap: float | None = 30.0


@dataclasses.dataclass(frozen=True)
class Gemma3Config(GemmaConfig):
    """Gemma 3 (text): five local layers and one global, q/k RMSNorm, two RoPE bases, no soft-caps."""

    layer_pattern: str = "LLLLLG"
    sliding_window: int = 1024
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 131072

    QK_NORM: ClassVar[bool] = True


_GEMMA2_VOCAB = 256000
_GEMMA3_VOCAB = 262208        # the text tower's rows in the Hugging Face checkpoints of 4B, 12B, 27B

GEMMA2_PRESETS: dict[str, Gemma2Config] = {
    # Hugging Face google/gemma-2-{2b,9b,27b}; query_pre_attn_scalar 256 at 2B and 9B (1 / sqrt(head_dim),
    # as Google's gemma_pytorch reference), d_model / num_heads = 144 at 27B.
    "gemma2_2b": Gemma2Config(vocab_size=_GEMMA2_VOCAB, d_model=2304, num_layers=26, num_heads=8, num_kv_heads=4,
                              head_dim=256, mlp_hidden=9216),
    "gemma2_9b": Gemma2Config(vocab_size=_GEMMA2_VOCAB, d_model=3584, num_layers=42, num_heads=16, num_kv_heads=8,
                              head_dim=256, mlp_hidden=14336),
    "gemma2_27b": Gemma2Config(vocab_size=_GEMMA2_VOCAB, d_model=4608, num_layers=46, num_heads=32,
                               num_kv_heads=16, head_dim=128, mlp_hidden=36864, query_pre_attn_scalar=144.0),
    # Test and CPU sizes: odd widths, a depth that is not a multiple of the period, a window shorter than
    # the sequence.
    "tiny": Gemma2Config(vocab_size=2048, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                         mlp_hidden=256, sliding_window=32, query_pre_attn_scalar=32.0, max_seq_len=128),
    "tiny_odd": Gemma2Config(vocab_size=131, d_model=60, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=10,
                             mlp_hidden=92, sliding_window=7, query_pre_attn_scalar=12.0, max_seq_len=64),
}

GEMMA3_PRESETS: dict[str, Gemma3Config] = {
    # Hugging Face google/gemma-3-1b-pt and the text_config of google/gemma-3-{4b,12b,27b}-pt.
    "gemma3_1b": Gemma3Config(vocab_size=262144, d_model=1152, num_layers=26, num_heads=4, num_kv_heads=1,
                              head_dim=256, mlp_hidden=6912, sliding_window=512, max_seq_len=32768),
    "gemma3_4b": Gemma3Config(vocab_size=_GEMMA3_VOCAB, d_model=2560, num_layers=34, num_heads=8, num_kv_heads=4,
                              head_dim=256, mlp_hidden=10240, rope_global_scale=8.0),
    "gemma3_12b": Gemma3Config(vocab_size=_GEMMA3_VOCAB, d_model=3840, num_layers=48, num_heads=16,
                               num_kv_heads=8, head_dim=256, mlp_hidden=15360, rope_global_scale=8.0),
    "gemma3_27b": Gemma3Config(vocab_size=_GEMMA3_VOCAB, d_model=5376, num_layers=62, num_heads=32,
                               num_kv_heads=16, head_dim=128, mlp_hidden=21504, rope_global_scale=8.0,
                               query_pre_attn_scalar=168.0),
    # Test and CPU sizes: 8 layers of a period of 6 (one period and two more), odd widths.
    "tiny": Gemma3Config(vocab_size=2048, d_model=128, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=32,
                         mlp_hidden=256, sliding_window=32, query_pre_attn_scalar=32.0, rope_global_scale=8.0,
                         max_seq_len=128),
    "tiny_odd": Gemma3Config(vocab_size=131, d_model=60, num_layers=8, num_heads=6, num_kv_heads=2, head_dim=10,
                             mlp_hidden=92, sliding_window=7, query_pre_attn_scalar=12.0, rope_global_scale=8.0,
                             max_seq_len=64),
}


# --- Hugging Face: registered here, mapped in models/gemma_hf.py ------------------------------------
from spillway.models import gemma_hf  # noqa: E402


def gemma2_config_from_hf(hf_config) -> Gemma2Config:
    return Gemma2Config(**gemma_hf.gemma2_fields_from_hf(hf_config))


def gemma3_config_from_hf(hf_config) -> Gemma3Config:
    """A gemma3_text config, or a multimodal gemma3 config's text tower (its `text_config`)."""
    return Gemma3Config(**gemma_hf.gemma3_fields_from_hf(hf_config))


GEMMA2 = register_family(Family(
    name="gemma2",
    config_cls=Gemma2Config,
    presets=GEMMA2_PRESETS,
    description="Gemma 2: alternating sliding-window and global layers, soft-capped attention and logits",
    hf=hf.HFTable(model_types=("gemma2",), architecture="Gemma2ForCausalLM",
                  config_from_hf=gemma2_config_from_hf, fields_to_hf=gemma_hf.gemma2_fields_to_hf,
                  weights=gemma_hf.weights, base_prefix=hf_rows.BASE_PREFIX),
))

GEMMA3 = register_family(Family(
    name="gemma3",
    config_cls=Gemma3Config,
    presets=GEMMA3_PRESETS,
    description="Gemma 3 (text): five local layers and one global, two RoPE bases, q/k norms",
    hf=hf.HFTable(model_types=("gemma3_text", "gemma3"), architecture="Gemma3ForCausalLM",
                  config_from_hf=gemma3_config_from_hf, fields_to_hf=gemma_hf.gemma3_fields_to_hf,
                  weights=gemma_hf.weights,
                  tower_prefixes=gemma_hf.GEMMA3_TEXT_TOWER, base_prefix=hf_rows.BASE_PREFIX),
))
