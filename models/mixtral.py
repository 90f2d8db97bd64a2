"""Mixtral (8x7B, 8x22B): sparse mixture-of-experts Mistral, its presets at published sizes, its Hugging Face table.

Mixtral is Mistral (models/mistral.py: Llama-shaped, GQA, RoPE, an optional
sliding window) with every layer's MLP an MoE layer (layers/moe.py): a router
to 8 experts, softmax in float32, the top 2 experts a token goes through with
their probabilities renormalised to sum to 1 (transformers'
`MixtralTopKRouter`: `router_top_value /= router_top_value.sum()`), each
expert a SwiGLU MLP of `mlp_hidden` (config.json's intermediate_size). One
structure for every layer: one run of `BlockConfig(moe=...)` blocks.

Parameters (exact, from the shapes; tests/models/test_moe_families.py checks
them against transformers' own model built on the meta device). Active: the
embedding and head, every attention and norm, and of each layer the router
and the top-2 experts:

    mixtral_8x7b    46,702,792,704 total, 12,879,925,248 active   (published: "46.7B", "12.9B")
    mixtral_8x22b  140,620,634,112 total, 39,152,031,744 active   (published: "141B", "39B")

Hugging Face: Mistral's tensors, with each layer's MoE under
`model.layers.{i}.block_sparse_moe.`: `gate.weight` [E, d] (the router) and
`experts.{j}.w1 / w3 / w2.weight` (gate, up, down, nn.Linear layouts): the
published files and what transformers 5 `save_pretrained` writes. An in-memory
transformers 5 state dict (fused `mlp.experts.gate_up_proj`) (or a safetensors file of it) reads too
(models/moe_shaped.py). `router_jitter_noise` (multiplicative noise on the
router input while training) is refused when non-zero: spillway does not add it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from spillway.models import hf, hf_rows, llama_shaped, moe_shaped
from spillway.models.llama_shaped import LlamaShapedConfig
from spillway.models.registry import Family, register_family


@dataclasses.dataclass(frozen=True)
class MixtralConfig(moe_shaped.MoERunFields, LlamaShapedConfig):
    """Mistral with an MoE layer of `num_experts` experts of hidden `mlp_hidden`, `top_k` a token, in every layer.

    The moe_* fields (models/moe_shaped.py MoERunFields) are how the layer runs, not what it is."""

    num_experts: int = 8
    top_k: int = 2
    sliding_window: int | None = None    # keys each query sees (itself included); None: all earlier keys
    rope_theta: float = 1e6
    max_seq_len: int = 32768

    POSITIVE_FIELDS = LlamaShapedConfig.POSITIVE_FIELDS + ("sliding_window", "num_experts", "top_k")
    BLOCK_FIELDS = LlamaShapedConfig.BLOCK_FIELDS + ("sliding_window",)

    def block_options(self) -> dict[str, Any]:
        return {"moe": moe_shaped.moe_layer(self, self.mlp_hidden, renormalize=True)}


_MIXTRAL_8X7B = dict(vocab_size=32000, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8, mlp_hidden=14336,
                     max_seq_len=32768)

PRESETS: dict[str, MixtralConfig] = {
    # mistralai/Mixtral-8x7B-v0.1 config.json.
    "mixtral_8x7b": MixtralConfig(**_MIXTRAL_8X7B),
    # mistralai/Mixtral-8x22B-v0.1 config.json (the base model; the Instruct one has 32768 rows).
    "mixtral_8x22b": MixtralConfig(vocab_size=32000, d_model=6144, num_layers=56, num_heads=48, num_kv_heads=8,
                                   mlp_hidden=16384, max_seq_len=65536),
    # Test and CPU sizes; "tiny_odd": top-2 of 5 experts, odd widths, a window shorter than the test sequences.
    "tiny": MixtralConfig(vocab_size=4096, d_model=256, num_layers=4, num_heads=8, num_kv_heads=4, mlp_hidden=384,
                          num_experts=4, max_seq_len=256),
    "tiny_odd": MixtralConfig(vocab_size=131, d_model=60, num_layers=3, num_heads=6, num_kv_heads=2, mlp_hidden=46,
                              num_experts=5, sliding_window=7, max_seq_len=64),
}


# --- Hugging Face ----------------------------------------------------------------

# transformers' MixtralConfig defaults, for keys a config.json omits.
_HF_DEFAULTS = {"num_key_value_heads": 8, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096 * 32,
                "sliding_window": None, "tie_word_embeddings": False, "num_local_experts": 8,
                "num_experts_per_tok": 2, "router_jitter_noise": 0.0, "rope_theta": 1e6}
_PREFIX = "model.layers.{i}.block_sparse_moe."
_EXPERT_NAMES = dict(gate="w1", up="w3", down="w2")


def config_from_hf(hf_config: Mapping[str, Any]) -> MixtralConfig:
    hf_config = {**_HF_DEFAULTS, **hf_config}
    jitter = float(hf_config["router_jitter_noise"] or 0.0)
    hf.refuse(jitter != 0.0, f"router_jitter_noise={jitter} is not supported: spillway's Mixtral router adds no "
                             f"noise to its input")
    window = hf_config["sliding_window"]
    return MixtralConfig(**llama_shaped.fields_from_hf(hf_config, "Mixtral"),
                         **moe_shaped.moe_fields_from_hf(hf_config, "Mixtral"),
                         sliding_window=None if window is None else int(window))


def fields_to_hf(cfg: MixtralConfig) -> dict[str, Any]:
    return {**llama_shaped.fields_to_hf(cfg),
            "sliding_window": cfg.sliding_window, "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.top_k, "router_jitter_noise": 0.0}


def weights(cfg: MixtralConfig) -> list[hf.HFWeight]:
    """Mistral's tensors with the MLP replaced by the router and the per-expert w1 / w3 / w2."""
    dense_mlp = {w.path for w in hf_rows.gated_mlp()}
    table = [w for w in llama_shaped.weights(cfg) if w.path not in dense_mlp]
    return table + moe_shaped.expert_weights(_PREFIX, **_EXPERT_NAMES)


def fused_views(cfg: MixtralConfig) -> dict[str, tuple[str, tuple]]:
    return moe_shaped.fused_expert_views(range(cfg.num_layers), cfg.num_experts, cfg.mlp_hidden,
                                         checkpoint_prefix=_PREFIX, module_prefix="model.layers.{i}.mlp.",
                                         **_EXPERT_NAMES)


FAMILY = register_family(Family(
    name="mixtral",
    config_cls=MixtralConfig,
    presets=PRESETS,
    description="Mixtral 8x7B / 8x22B: Mistral with a top-2 of 8 mixture-of-experts MLP in every layer",
    hf=hf.HFTable(model_types=("mixtral",), architecture="MixtralForCausalLM",
                  config_from_hf=config_from_hf, fields_to_hf=fields_to_hf, weights=weights, views=fused_views,
                  base_prefix=hf_rows.BASE_PREFIX),
))
