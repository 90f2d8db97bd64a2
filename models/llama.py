"""Llama 2, 3, 3.1 and 3.2: config presets at their published sizes, and the Hugging Face table.

`LlamaConfig` holds the architecture only (dtypes and kernels are the recipe's
`Execution`). Differences between the generations are all config: vocabulary,
GQA, RoPE theta, Llama 3.1/3.2 RoPE scaling, tied embeddings (3.2 1B/3B). The
model is the generic `DecoderLM` (models/decoder.py): pre-norm RMSNorm blocks,
SwiGLU MLP, no biases, RoPE.

Hugging Face: `nn.Linear` stores [out, in]; spillway stores [in, out] with the
heads split out (q_proj [heads*head_dim, d] -> wq [d, heads, head_dim]). No
RoPE permutation is needed: HF checkpoints already use the rotate-half layout
of layers/rope.py (Meta's original consolidated.*.pth files are not read).
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
from spillway.models.registry import Family, register_family


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

    def __post_init__(self):
        self.decoder_spec(Execution())  # validates sizes and the head layout, naming the field

    def block_config(self, execution: Execution = Execution(), **extra) -> BlockConfig:
        return BlockConfig(
            d_model=self.d_model, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            mlp_hidden=self.mlp_hidden, head_dim=self.head_dim, norm="rms", norm_eps=self.norm_eps,
            mlp_kind="swiglu", rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            execution=execution, **extra)

    def decoder_spec(self, execution: Execution = Execution()) -> DecoderSpec:
        return DecoderSpec(vocab_size=self.vocab_size, num_layers=self.num_layers, max_seq_len=self.max_seq_len,
                           block=self.block_config(execution), tie_embeddings=self.tie_embeddings)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    def num_params(self) -> int:
        return self.decoder_spec().num_params()


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


class Llama(DecoderLM):
    """A Llama: `Llama(config, execution, rngs=..., remat=..., block_cls=...)` (see DecoderLM)."""


# --- Hugging Face ----------------------------------------------------------------

def rope_scaling_from_hf(scaling: dict | None) -> RopeScaling | None:
    if scaling is None:
        return None
    kind = scaling["rope_type"]
    hf.refuse(kind != "llama3", f"unsupported rope_type {kind!r} in the Hugging Face config: spillway implements "
                                f"only 'default' (no scaling) and 'llama3' RoPE")
    hf.require(scaling, ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
               "rope_scaling")
    return RopeScaling(factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
                       high_freq_factor=float(scaling["high_freq_factor"]),
                       original_max_position=int(scaling["original_max_position_embeddings"]))


def rope_scaling_to_hf(scaling: RopeScaling | None) -> dict | None:
    if scaling is None:
        return None
    return {"rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position}


def llama_fields_from_hf(hf_config: Mapping[str, Any], family: str) -> dict[str, Any]:
    """The LlamaConfig fields of a Llama-shaped Hugging Face config (Llama, Mistral, Qwen share them)."""
    hf.require(hf_config, ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size"), family)
    hidden_act = hf_config.get("hidden_act", "silu")
    hf.refuse(hidden_act != "silu", f"hidden_act {hidden_act!r} is not supported: the {family} MLP is SwiGLU ('silu')")
    d_model, num_heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim")
    if head_dim is not None and d_model % num_heads == 0 and head_dim == d_model // num_heads:
        head_dim = None  # the default; left unset so configs compare equal to the presets
    rope_theta, scaling = hf.rope_settings(hf_config)
    return dict(
        vocab_size=hf_config["vocab_size"], d_model=d_model, num_layers=hf_config["num_hidden_layers"],
        num_heads=num_heads, num_kv_heads=hf_config.get("num_key_value_heads") or num_heads,
        mlp_hidden=hf_config["intermediate_size"], head_dim=head_dim, rope_theta=rope_theta,
        rope_scaling=rope_scaling_from_hf(scaling),
        # transformers' own defaults, for keys a config.json omits.
        norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        max_seq_len=int(hf_config.get("max_position_embeddings", 2048)),
    )


def llama_fields_to_hf(cfg) -> dict[str, Any]:
    """config.json keys of the LlamaConfig fields, in the transformers < 5 spelling (5 still reads it)."""
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "intermediate_size": cfg.mlp_hidden, "head_dim": cfg.resolved_head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling_to_hf(cfg.rope_scaling), "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_seq_len,
    }


def config_from_hf(hf_config: Mapping[str, Any]) -> LlamaConfig:
    hf.refuse(bool(hf_config.get("attention_bias", False)),
              "attention_bias=True is not supported: Llama has no q/k/v/o projection biases")
    hf.refuse(bool(hf_config.get("mlp_bias", False)), "mlp_bias=True is not supported: Llama's MLP has no biases")
    return LlamaConfig(**llama_fields_from_hf(hf_config, "Llama"))


def config_to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **llama_fields_to_hf(cfg),
            "attention_bias": False, "mlp_bias": False}


def llama_weights(cfg, *, qkv_bias: bool = False, qk_norm: bool = False) -> list[hf.HFWeight]:
    """Every tensor of a Llama-shaped checkpoint (Mistral and Qwen add q/k/v biases or q/k norms)."""
    W, p = hf.HFWeight, "model.layers.{i}."
    weights = [
        W("model.embed_tokens.weight", ("embed", "table"), hf.COPY),
        W(p + "self_attn.q_proj.weight", ("attn", "wq"), hf.IN_HEADS),
        W(p + "self_attn.k_proj.weight", ("attn", "wk"), hf.IN_HEADS),
        W(p + "self_attn.v_proj.weight", ("attn", "wv"), hf.IN_HEADS),
        W(p + "self_attn.o_proj.weight", ("attn", "wo"), hf.OUT_HEADS),
        W(p + "mlp.gate_proj.weight", ("mlp", "w_gate"), hf.LINEAR),
        W(p + "mlp.up_proj.weight", ("mlp", "w_up"), hf.LINEAR),
        W(p + "mlp.down_proj.weight", ("mlp", "w_down"), hf.LINEAR),
        W(p + "input_layernorm.weight", ("attn_norm", "scale"), hf.VECTOR),
        # In Llama-shaped checkpoints this is the MLP's pre-norm (Gemma 2 uses the name for a post-norm).
        W(p + "post_attention_layernorm.weight", ("mlp_norm", "scale"), hf.VECTOR),
    ]
    if qkv_bias:
        weights += [W(p + f"self_attn.{x}_proj.bias", ("attn", f"b{x}"), hf.VECTOR) for x in "qkv"]
    if qk_norm:
        weights += [W(p + f"self_attn.{x}_norm.weight", ("attn", f"{x}_norm", "scale"), hf.VECTOR) for x in "qk"]
    weights.append(W("model.norm.weight", ("final_norm", "scale"), hf.VECTOR))
    if not cfg.tie_embeddings:
        weights.append(W("lm_head.weight", ("head", "w"), hf.LINEAR))
    return weights


FAMILY = register_family(Family(
    name="llama",
    config_cls=LlamaConfig,
    presets=PRESETS,
    description="Llama 2 / 3 / 3.1 / 3.2: RMSNorm, SwiGLU, RoPE (3.1 scaling), GQA",
    hf=hf.HFTable(model_types=("llama",), config_from_hf=config_from_hf, config_to_hf=config_to_hf,
                  weights=llama_weights),
    model_cls=Llama,
))


def llama_config(name: str, **overrides) -> LlamaConfig:
    return FAMILY.config(name, **overrides)
