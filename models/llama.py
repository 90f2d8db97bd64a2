"""Llama 2, 3, 3.1 and 3.2: config presets at their published sizes, and the Hugging Face table.

`LlamaConfig` is the Llama-shaped config (models/llama_shaped.py) as it is:
differences between the generations are all config (vocabulary, GQA, RoPE
theta, Llama 3.1/3.2 RoPE scaling, tied embeddings at 3.2 1B/3B). The model is
the generic `DecoderLM` (models/decoder.py): pre-norm RMSNorm blocks, SwiGLU
MLP, no biases, RoPE.

Hugging Face: `nn.Linear` stores [out, in]; spillway stores [in, out] with the
heads split out (q_proj [heads*head_dim, d] -> wq [d, heads, head_dim]); the
table is the Llama-shaped one, and config.json's `attention_bias` / `mlp_bias`
must be false.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from spillway.layers.rope import RopeScaling
from spillway.models import hf, hf_rows, llama_shaped
from spillway.models.llama_shaped import LlamaShapedConfig
from spillway.models.registry import Family, register_family


@dataclasses.dataclass(frozen=True)
class LlamaConfig(LlamaShapedConfig):
    """Llama 2 / 3 / 3.1 / 3.2: the Llama-shaped fields with their defaults, nothing added."""


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
                        mlp_hidden=704, max_seq_len=256),
    "tiny_odd": LlamaConfig(vocab_size=131, d_model=60, num_layers=3, num_heads=6, num_kv_heads=2,
                            mlp_hidden=92, max_seq_len=64, rope_scaling=_LLAMA31_SCALING, rope_theta=500000.0),
}


# --- Hugging Face ----------------------------------------------------------------

def config_from_hf(hf_config: Mapping[str, Any]) -> LlamaConfig:
    return LlamaConfig(**llama_shaped.fields_from_hf(hf_config, "Llama"))


def fields_to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    return {**llama_shaped.fields_to_hf(cfg),
            "attention_bias": False, "mlp_bias": False}


FAMILY = register_family(Family(
    name="llama",
    config_cls=LlamaConfig,
    presets=PRESETS,
    description="Llama 2 / 3 / 3.1 / 3.2: RMSNorm, SwiGLU, RoPE (3.1 scaling), GQA",
    hf=hf.HFTable(model_types=("llama",), architecture="LlamaForCausalLM",
                  config_from_hf=config_from_hf, fields_to_hf=fields_to_hf, weights=llama_shaped.weights,
                  base_prefix=hf_rows.BASE_PREFIX),
))
