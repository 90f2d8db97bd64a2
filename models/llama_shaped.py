"""What the Llama-shaped families share: their config base, and their Hugging Face fields and tensors.

Llama, Mistral, Qwen2 and Qwen3 are one architecture with switches: pre-norm
RMSNorm blocks, a SwiGLU MLP, RoPE, grouped-query attention, no output-projection
bias, and the same checkpoint names. Each family's config extends
`LlamaShapedConfig` with only what differs:

    its defaults          redeclare the field (`rope_theta: float = 1e6`)
    its own fields        Mistral's `sliding_window` (add it to BLOCK_FIELDS /
                          POSITIVE_FIELDS when the block reads it / it is a size)
    fixed block switches  `block_options()`: Qwen2's q/k/v biases, Qwen3's q/k norms

Each family keeps a config class of its own, a sibling under this base and
never a subclass of another family's: generic code finds a family by the exact
type of its config (models/registry.py `family_of_config`), and a recipe checks
its model with isinstance (a MistralConfig must not pass as a LlamaConfig).

Hugging Face: `fields_from_hf` / `fields_to_hf` map the config.json keys these
families share (transformers' Llama spelling), `weights` lists a Llama-shaped
checkpoint's tensors; a family file adds its own keys, defaults and refusals.
Hugging Face checkpoints already use the rotate-half RoPE layout of
layers/rope.py, so no permutation is applied (Meta's original consolidated.*.pth
files are not read).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from spillway.layers.block import BlockConfig
from spillway.layers.errors import require_positive
from spillway.layers.execution import Execution
from spillway.layers.rope import RopeScaling
from spillway.models import hf, hf_rows
from spillway.models.decoder import DecoderSpec


@dataclasses.dataclass(frozen=True)
class LlamaShapedConfig:
    """The fields every Llama-shaped family has; architecture only (dtypes and kernels are `Execution`)."""

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    mlp_hidden: int
    head_dim: int | None = None          # None: d_model // num_heads
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 4096

    # Numbers that must be positive (None allowed where the type allows it), named with the family's class.
    POSITIVE_FIELDS: ClassVar[tuple[str, ...]] = (
        "vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "mlp_hidden", "head_dim",
        "rope_theta", "norm_eps", "max_seq_len")
    # Fields that BlockConfig takes under the same name.
    BLOCK_FIELDS: ClassVar[tuple[str, ...]] = (
        "d_model", "num_heads", "num_kv_heads", "mlp_hidden", "head_dim", "norm_eps", "rope_theta", "rope_scaling")

    def __post_init__(self):
        require_positive(type(self).__name__, **{name: getattr(self, name) for name in self.POSITIVE_FIELDS})
        self.decoder_spec(Execution())  # validates the head layout (and RoPE's even head_dim), naming the field

    def block_options(self) -> dict[str, Any]:
        """BlockConfig switches the family always sets (Qwen2: qkv_bias=True); none for Llama."""
        return {}

    def block_config(self, execution: Execution = Execution()) -> BlockConfig:
        return BlockConfig(norm="rms", mlp_kind="swiglu", execution=execution,
                           **{name: getattr(self, name) for name in self.BLOCK_FIELDS}, **self.block_options())

    def decoder_spec(self, execution: Execution = Execution()) -> DecoderSpec:
        return DecoderSpec(vocab_size=self.vocab_size, num_layers=self.num_layers, max_seq_len=self.max_seq_len,
                           block=self.block_config(execution), tie_embeddings=self.tie_embeddings)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    def num_params(self) -> int:
        return self.decoder_spec().num_params()


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


def fields_from_hf(hf_config: Mapping[str, Any], family: str, *,
                   projection_biases: str = "no q/k/v/o projection biases") -> dict[str, Any]:
    """The LlamaShapedConfig fields of a Hugging Face config; refuses what no Llama-shaped family has.

    `projection_biases` says what the family has instead of transformers'
    `attention_bias` (biases on all four projections), for the refusal.
    """
    hf.require(hf_config, ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size"), family)
    hf.refuse(bool(hf_config.get("attention_bias", False)),
              f"attention_bias=True is not supported: {family} has {projection_biases}")
    hf.refuse(bool(hf_config.get("mlp_bias", False)), f"mlp_bias=True is not supported: {family}'s MLP has no biases")
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


def fields_to_hf(cfg: LlamaShapedConfig) -> dict[str, Any]:
    """config.json keys of the LlamaShapedConfig fields, in the transformers < 5 spelling (5 still reads it)."""
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "intermediate_size": cfg.mlp_hidden, "head_dim": cfg.resolved_head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling_to_hf(cfg.rope_scaling), "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_seq_len,
    }


def weights(cfg: LlamaShapedConfig) -> list[hf.HFWeight]:
    """Every tensor of a Llama-shaped checkpoint, with the q/k/v biases or q/k norms the config's block has."""
    block = cfg.block_config()
    W, p = hf.HFWeight, hf_rows.LAYER
    table = hf_rows.embedding() + hf_rows.attention_projections() + hf_rows.gated_mlp() + [
        W(p + "input_layernorm.weight", ("attn_norm", "scale"), hf.VECTOR),
        # In Llama-shaped checkpoints this is the MLP's pre-norm (Gemma 2 uses the name for a post-norm).
        W(p + "post_attention_layernorm.weight", ("mlp_norm", "scale"), hf.VECTOR),
    ]
    if block.qkv_bias:
        table += [W(p + f"self_attn.{x}_proj.bias", ("attn", f"b{x}"), hf.VECTOR) for x in "qkv"]
    if block.qk_norm:
        table += hf_rows.qk_norms()
    return table + hf_rows.final(cfg.tie_embeddings)
