"""Qwen2.5 and Qwen3 (dense): config presets at their published sizes, and the Hugging Face tables.

Both are Llama-shaped (models/llama_shaped.py: pre-norm RMSNorm blocks, SwiGLU MLP, RoPE,
grouped-query attention, no output-projection bias) and run as the generic `DecoderLM`; two
families, because their checkpoints differ:

    qwen2  (Qwen2 / Qwen2.5, model_type "qwen2"): biases on the q, k and v
           projections; head_dim is d_model // num_heads.
    qwen3  (model_type "qwen3"): no biases; an RMSNorm over each head's q and
           k (one scale of head_dim shared by all heads) before RoPE; head_dim
           set on its own (128 at every published size, so 0.6B's queries are
           2048 wide on a 1024-wide residual stream).

Qwen's config.json carries `use_sliding_window` / `sliding_window` /
`max_window_layers`: with the window on, layers from `max_window_layers` up
attend through a window and the ones below do not. spillway's Qwen configs
have no window field, so such a config is refused by name; every published
Qwen2.5 and Qwen3 dense checkpoint has `use_sliding_window: false`, which is
read. (The family spec could express it: per-layer windows are
`DecoderSpec.layer_settings`, as the Gemma families use them.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from spillway.models import hf, hf_rows, llama_shaped
from spillway.models.llama_shaped import LlamaShapedConfig
from spillway.models.registry import Family, register_family


@dataclasses.dataclass(frozen=True)
class Qwen2Config(LlamaShapedConfig):
    """Qwen2 / Qwen2.5: q/k/v projection biases are part of the architecture, not a switch."""

    rope_theta: float = 1e6
    norm_eps: float = 1e-6
    max_seq_len: int = 32768

    def block_options(self) -> dict[str, Any]:
        return {"qkv_bias": True}


@dataclasses.dataclass(frozen=True)
class Qwen3Config(LlamaShapedConfig):
    """Qwen3 dense: q/k RMSNorm per head is part of the architecture; head_dim is its own field."""

    head_dim: int = 128
    rope_theta: float = 1e6
    norm_eps: float = 1e-6
    max_seq_len: int = 40960

    def block_options(self) -> dict[str, Any]:
        return {"qk_norm": True}


_QWEN_VOCAB = 151936

QWEN2_PRESETS: dict[str, Qwen2Config] = {
    "qwen2_5_0_5b": Qwen2Config(vocab_size=_QWEN_VOCAB, d_model=896, num_layers=24, num_heads=14, num_kv_heads=2,
                                mlp_hidden=4864, tie_embeddings=True, max_seq_len=32768),
    "qwen2_5_1_5b": Qwen2Config(vocab_size=_QWEN_VOCAB, d_model=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                                mlp_hidden=8960, tie_embeddings=True, max_seq_len=131072),
    # The 7B's embedding has 152064 rows (padded further than the smaller sizes').
    "qwen2_5_7b": Qwen2Config(vocab_size=152064, d_model=3584, num_layers=28, num_heads=28, num_kv_heads=4,
                              mlp_hidden=18944, tie_embeddings=False, max_seq_len=131072),
    # Test and CPU sizes; odd numbers in "tiny_odd" to catch shape bugs.
    "tiny": Qwen2Config(vocab_size=4096, d_model=256, num_layers=4, num_heads=8, num_kv_heads=2, mlp_hidden=704,
                        tie_embeddings=True, max_seq_len=256),
    "tiny_odd": Qwen2Config(vocab_size=131, d_model=60, num_layers=3, num_heads=6, num_kv_heads=2, mlp_hidden=92,
                            max_seq_len=64),
}

QWEN3_PRESETS: dict[str, Qwen3Config] = {
    "qwen3_0_6b": Qwen3Config(vocab_size=_QWEN_VOCAB, d_model=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                              mlp_hidden=3072, tie_embeddings=True),
    "qwen3_1_7b": Qwen3Config(vocab_size=_QWEN_VOCAB, d_model=2048, num_layers=28, num_heads=16, num_kv_heads=8,
                              mlp_hidden=6144, tie_embeddings=True),
    "qwen3_4b": Qwen3Config(vocab_size=_QWEN_VOCAB, d_model=2560, num_layers=36, num_heads=32, num_kv_heads=8,
                            mlp_hidden=9728, tie_embeddings=True),
    "qwen3_8b": Qwen3Config(vocab_size=_QWEN_VOCAB, d_model=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                            mlp_hidden=12288, tie_embeddings=False),
    # Test and CPU sizes. "tiny_odd": head_dim (14) is not d_model // num_heads (10), as at 0.6B.
    "tiny": Qwen3Config(vocab_size=4096, d_model=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64,
                        mlp_hidden=704, tie_embeddings=True, max_seq_len=256),
    "tiny_odd": Qwen3Config(vocab_size=131, d_model=60, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=14,
                            mlp_hidden=92, max_seq_len=64),
}


# --- Hugging Face ----------------------------------------------------------------

# transformers' Qwen2Config / Qwen3Config defaults, for keys a config.json omits.
_HF_DEFAULTS = {"num_key_value_heads": 32, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 4096,
                "max_window_layers": 28}


def _refuse_sliding_layers(hf_config: Mapping[str, Any], family: str) -> None:
    """Refuse a config whose window transformers would apply to some layers (as its config class decides)."""
    window = hf_config["sliding_window"] if hf_config["use_sliding_window"] else None
    if window is None:
        return  # transformers drops the window (and every "sliding_attention" layer type) when it is off
    num_layers = hf_config["num_hidden_layers"]
    layer_types = hf_config.get("layer_types") or [
        "sliding_attention" if i >= hf_config["max_window_layers"] else "full_attention" for i in range(num_layers)]
    windowed = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    if not windowed:
        return
    where = f"use_sliding_window=True is not supported: this {family} config windows"
    hf.refuse(len(windowed) == len(layer_types), f"{where} every layer to {window} positions, and spillway's "
                                                 f"{family} has no sliding window (spillway's Mistral has one)")
    hf.refuse(True, f"{where} layers {windowed} to {window} positions (max_window_layers="
                    f"{hf_config['max_window_layers']}) and the others not, and spillway's {family} config has "
                    f"no per-layer windows")


def _qwen_fields_from_hf(hf_config: Mapping[str, Any], family: str, **options) -> dict[str, Any]:
    fields = llama_shaped.fields_from_hf(hf_config, family, **options)
    _refuse_sliding_layers(hf_config, family)
    return fields


def _qwen_fields_to_hf(cfg) -> dict[str, Any]:
    return {**llama_shaped.fields_to_hf(cfg), "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": cfg.num_layers}


def qwen2_config_from_hf(hf_config: Mapping[str, Any]) -> Qwen2Config:
    hf_config = {**_HF_DEFAULTS, **hf_config}
    # transformers' Qwen2 reads no attention_bias: q/k/v always have biases, o_proj never.
    # A config that asks for biases on all four projections describes another model.
    return Qwen2Config(**_qwen_fields_from_hf(hf_config, "Qwen2",
                                              projection_biases="q/k/v biases and no o_proj bias"))


def qwen2_fields_to_hf(cfg: Qwen2Config) -> dict[str, Any]:
    return {**_qwen_fields_to_hf(cfg)}


def qwen3_config_from_hf(hf_config: Mapping[str, Any]) -> Qwen3Config:
    hf_config = {**_HF_DEFAULTS, "head_dim": 128, **hf_config}
    fields = _qwen_fields_from_hf(hf_config, "Qwen3")
    fields["head_dim"] = int(hf_config["head_dim"])  # its own field, even where it equals d_model // num_heads
    return Qwen3Config(**fields)


def qwen3_fields_to_hf(cfg: Qwen3Config) -> dict[str, Any]:
    return {**_qwen_fields_to_hf(cfg),
            "attention_bias": False}


QWEN2 = register_family(Family(
    name="qwen2",
    config_cls=Qwen2Config,
    presets=QWEN2_PRESETS,
    description="Qwen2 / Qwen2.5: Llama-shaped with q/k/v biases, GQA, RoPE theta 1e6",
    hf=hf.HFTable(model_types=("qwen2",), architecture="Qwen2ForCausalLM",
                  config_from_hf=qwen2_config_from_hf, fields_to_hf=qwen2_fields_to_hf,
                  weights=llama_shaped.weights, base_prefix=hf_rows.BASE_PREFIX),
))

QWEN3 = register_family(Family(
    name="qwen3",
    config_cls=Qwen3Config,
    presets=QWEN3_PRESETS,
    description="Qwen3 dense: Llama-shaped with per-head q/k RMSNorm, head_dim 128, GQA",
    hf=hf.HFTable(model_types=("qwen3",), architecture="Qwen3ForCausalLM",
                  config_from_hf=qwen3_config_from_hf, fields_to_hf=qwen3_fields_to_hf,
                  weights=llama_shaped.weights, base_prefix=hf_rows.BASE_PREFIX),
))
