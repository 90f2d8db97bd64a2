"""Mistral 7B (v0.1 and v0.3): config presets at their published sizes, and the Hugging Face table.

Mistral is Llama-shaped (pre-norm RMSNorm blocks, SwiGLU MLP, no biases, RoPE,
grouped-query attention) with one difference: v0.1 attends through a sliding
window of 4096 positions in every layer. v0.3 drops the window, grows the
vocabulary to 32768 and raises RoPE theta to 1e6; both are config, so one
`MistralConfig` covers them and the model is the generic `DecoderLM`.

Window semantics (transformers' `sliding_window_overlay`, and layers/attention.py):
the query at position q sees keys k with q - window < k <= q, i.e. `window`
keys including itself.

Hugging Face: the checkpoint names and layouts are Llama's (models/llama.py's
`llama_weights`); config.json's `sliding_window: null` means no window, and a
config.json that omits the key gets transformers' default, 4096.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from spillway.layers.block import BlockConfig
from spillway.layers.execution import Execution
from spillway.layers.rope import RopeScaling
from spillway.models import hf
from spillway.models.decoder import DecoderLM, DecoderSpec
from spillway.models.llama import llama_fields_from_hf, llama_fields_to_hf, llama_weights
from spillway.models.registry import Family, register_family


@dataclasses.dataclass(frozen=True)
class MistralConfig:
    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    mlp_hidden: int
    head_dim: int | None = None          # None: d_model // num_heads
    sliding_window: int | None = None    # keys each query sees (itself included); None: all earlier ones
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 32768

    def __post_init__(self):
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")
        self.decoder_spec(Execution())  # validates sizes and the head layout, naming the field

    def block_config(self, execution: Execution = Execution()) -> BlockConfig:
        return BlockConfig(
            d_model=self.d_model, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            mlp_hidden=self.mlp_hidden, head_dim=self.head_dim, norm="rms", norm_eps=self.norm_eps,
            mlp_kind="swiglu", rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            sliding_window=self.sliding_window, execution=execution)

    def decoder_spec(self, execution: Execution = Execution()) -> DecoderSpec:
        return DecoderSpec(vocab_size=self.vocab_size, num_layers=self.num_layers, max_seq_len=self.max_seq_len,
                           block=self.block_config(execution), tie_embeddings=self.tie_embeddings)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    def num_params(self) -> int:
        return self.decoder_spec().num_params()


_MISTRAL_7B = dict(d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8, mlp_hidden=14336, max_seq_len=32768)

PRESETS: dict[str, MistralConfig] = {
    "mistral_7b_v0_1": MistralConfig(vocab_size=32000, sliding_window=4096, rope_theta=10000.0, **_MISTRAL_7B),
    "mistral_7b_v0_3": MistralConfig(vocab_size=32768, sliding_window=None, rope_theta=1e6, **_MISTRAL_7B),
    # Test and CPU sizes. "tiny_odd": odd sizes, and a window shorter than the test sequences.
    "tiny": MistralConfig(vocab_size=4096, d_model=256, num_layers=4, num_heads=8, num_kv_heads=4,
                          mlp_hidden=704, sliding_window=64, max_seq_len=256),
    "tiny_odd": MistralConfig(vocab_size=131, d_model=60, num_layers=3, num_heads=6, num_kv_heads=2,
                              mlp_hidden=92, sliding_window=7, max_seq_len=64),
}


class Mistral(DecoderLM):
    """A Mistral: `Mistral(config, execution, rngs=..., remat=..., block_cls=...)` (see DecoderLM)."""


# --- Hugging Face ----------------------------------------------------------------

# transformers' MistralConfig defaults, for keys a config.json omits (they differ from Llama's).
_HF_DEFAULTS = {"num_key_value_heads": 8, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096 * 32,
                "sliding_window": 4096, "tie_word_embeddings": False}


def config_from_hf(hf_config: Mapping[str, Any]) -> MistralConfig:
    hf_config = {**_HF_DEFAULTS, **hf_config}
    hf.refuse(bool(hf_config.get("attention_bias", False)),
              "attention_bias=True is not supported: Mistral has no q/k/v/o projection biases")
    hf.refuse(bool(hf_config.get("mlp_bias", False)), "mlp_bias=True is not supported: Mistral's MLP has no biases")
    # transformers' MistralModel ignores `layer_types` (it warns and windows every layer
    # alike), so spillway does too: the same config gives the same model.
    window = hf_config["sliding_window"]
    return MistralConfig(**llama_fields_from_hf(hf_config, "Mistral"),
                         sliding_window=None if window is None else int(window))


def config_to_hf(cfg: MistralConfig) -> dict[str, Any]:
    return {"architectures": ["MistralForCausalLM"], "model_type": "mistral", **llama_fields_to_hf(cfg),
            "sliding_window": cfg.sliding_window}


FAMILY = register_family(Family(
    name="mistral",
    config_cls=MistralConfig,
    presets=PRESETS,
    description="Mistral 7B v0.1 / v0.3: Llama-shaped, GQA, sliding-window attention (v0.1)",
    hf=hf.HFTable(model_types=("mistral",), config_from_hf=config_from_hf, config_to_hf=config_to_hf,
                  weights=llama_weights),
    model_cls=Mistral,
))


def mistral_config(name: str, **overrides) -> MistralConfig:
    return FAMILY.config(name, **overrides)
