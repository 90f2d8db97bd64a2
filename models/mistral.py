"""Mistral 7B (v0.1 and v0.3): config presets at their published sizes, and the Hugging Face table.

Mistral is Llama-shaped (pre-norm RMSNorm blocks, SwiGLU MLP, no biases, RoPE,
grouped-query attention) with one difference: v0.1 attends through a sliding
window of 4096 positions in every layer. v0.3 drops the window, grows the
vocabulary to 32768 and raises RoPE theta to 1e6; both are config, so one
`MistralConfig` covers them and the model is the generic `DecoderLM`.

Window semantics (transformers' `sliding_window_overlay`, and layers/attention.py):
the query at position q sees keys k with q - window < k <= q, i.e. `window`
keys including itself.

Hugging Face: the checkpoint names and layouts are Llama's (models/llama_shaped.py
`weights`); config.json's `sliding_window: null` means no window, and a
config.json that omits the key gets transformers' default, 4096.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from spillway.models import hf, hf_rows, llama_shaped
from spillway.models.llama_shaped import LlamaShapedConfig
from spillway.models.registry import Family, register_family


@dataclasses.dataclass(frozen=True)
class MistralConfig(LlamaShapedConfig):
    """The Llama-shaped config with a sliding window over every layer (None: each query sees all earlier keys)."""

    sliding_window: int | None = None    # keys each query sees (itself included)
    max_seq_len: int = 32768

    POSITIVE_FIELDS = LlamaShapedConfig.POSITIVE_FIELDS + ("sliding_window",)
    BLOCK_FIELDS = LlamaShapedConfig.BLOCK_FIELDS + ("sliding_window",)


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


# --- Hugging Face ----------------------------------------------------------------

# transformers' MistralConfig defaults, for keys a config.json omits (they differ from Llama's).
_HF_DEFAULTS = {"num_key_value_heads": 8, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096 * 32,
                "sliding_window": 4096, "tie_word_embeddings": False}


_LAYER_TYPES = ("full_attention", "sliding_attention")


def _window_of(hf_config: Mapping[str, Any]) -> int | None:
    """The one window every layer attends through. A config with `layer_types` is what transformers'
    AutoConfig reads as Ministral (MinistralForCausalLM: only the layers typed sliding_attention window),
    so those types decide: all full is no window, all sliding the window, a mix (Ministral 8B's) is refused,
    as this family windows every layer alike. (MistralForCausalLM built directly ignores layer_types; the
    Auto classes, which users load with, do not.)"""
    window = hf_config["sliding_window"]
    kinds = set(hf_config.get("layer_types") or ())
    hf.refuse(bool(kinds - set(_LAYER_TYPES)),
              f"layer_types holds {sorted(kinds - set(_LAYER_TYPES))}: Mistral layers are {' or '.join(_LAYER_TYPES)}")
    if kinds == {"full_attention"}:
        return None
    hf.refuse(window is not None and len(kinds) > 1,
              "layer_types mixes full and sliding-window attention layers (a Ministral checkpoint, which "
              "transformers loads as MinistralForCausalLM): spillway's mistral family windows every layer alike, "
              "so it cannot load this model without changing its logits")
    return None if window is None else int(window)


def config_from_hf(hf_config: Mapping[str, Any]) -> MistralConfig:
    hf_config = {**_HF_DEFAULTS, **hf_config}
    return MistralConfig(**llama_shaped.fields_from_hf(hf_config, "Mistral"), sliding_window=_window_of(hf_config))


def fields_to_hf(cfg: MistralConfig) -> dict[str, Any]:
    return {**llama_shaped.fields_to_hf(cfg),
            "sliding_window": cfg.sliding_window}


FAMILY = register_family(Family(
    name="mistral",
    config_cls=MistralConfig,
    presets=PRESETS,
    description="Mistral 7B v0.1 / v0.3: Llama-shaped, GQA, sliding-window attention (v0.1)",
    hf=hf.HFTable(model_types=("mistral",), architecture="MistralForCausalLM",
                  config_from_hf=config_from_hf, fields_to_hf=fields_to_hf, weights=llama_shaped.weights,
                  base_prefix=hf_rows.BASE_PREFIX),
))
