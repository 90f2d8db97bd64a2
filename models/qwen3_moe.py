"""Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3 with mixture-of-experts layers, presets at published sizes, HF table.

Qwen3-MoE is dense Qwen3 (models/qwen.py: per-head q/k RMSNorm, head_dim its
own field, GQA, no biases) whose MLP is, in the sparse layers, an MoE layer
(layers/moe.py): a router to `num_experts` experts, softmax in float32, the
top `top_k`, their probabilities renormalised to sum to 1 when
`norm_topk_prob` (every published Qwen3-MoE; transformers' default is off),
each expert a SwiGLU MLP of `moe_hidden` (moe_intermediate_size).

Which layers are sparse is transformers' rule (`Qwen3MoeDecoderLayer`): layer
i is sparse unless it is in `mlp_only_layers`, and only when
(i + 1) % decoder_sparse_step == 0; the others are a dense SwiGLU MLP of
`mlp_hidden` (intermediate_size). The two structures are runs of the family
spec (layers/layer_pattern.py StackRun): each stretch of consecutive dense or
sparse layers is one run, its own weight stack and scan. Every published size
has decoder_sparse_step 1 and no mlp_only_layers: one sparse run.

Parameters (exact, from the shapes; tests/models/test_moe_families.py checks
them against transformers' own model on the meta device). Active: the
embedding and head, every attention and norm (q/k norms too), and of each
layer the router and the top-8 experts:

    qwen3_30b_a3b      30,532,122,624 total,  3,353,032,704 active   (published: "30.5B", "3.3B")
    qwen3_235b_a22b   235,093,634,560 total, 22,190,763,520 active   (published: "235B", "22B")

Hugging Face: Qwen3's tensors, with each sparse layer's `model.layers.{i}.mlp.`
holding `gate.weight` [E, d] (the router) and `experts.{j}.gate_proj /
up_proj / down_proj.weight` (the published files and what transformers 5
`save_pretrained` writes) and each dense layer Qwen3's gate/up/down_proj. An
in-memory transformers 5 state dict (fused `mlp.experts.gate_up_proj`) (or a safetensors file of it) reads
too (models/moe_shaped.py). A config whose mlp_only_layers names a layer past
the depth, or with a sliding window, is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from spillway.layers.errors import ConfigError, require_positive
from spillway.layers.execution import Execution
from spillway.layers.layer_pattern import StackRun
from spillway.models import hf, hf_rows, llama_shaped, moe_shaped
from spillway.models.decoder import DecoderSpec
from spillway.models.llama_shaped import LlamaShapedConfig
from spillway.models.registry import Family, register_family


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(moe_shaped.MoERunFields, LlamaShapedConfig):
    """Qwen3 with MoE layers: `num_experts` experts of hidden `moe_hidden`, `top_k` a token, in the sparse layers
    (`decoder_sparse_step`, `mlp_only_layers`: the module docstring); dense layers have `mlp_hidden`.

    The moe_* fields (models/moe_shaped.py MoERunFields) are how the layer runs, not what it is."""

    head_dim: int = 128
    rope_theta: float = 1e6
    norm_eps: float = 1e-6
    max_seq_len: int = 40960
    num_experts: int = 128
    top_k: int = 8
    moe_hidden: int = 768
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    POSITIVE_FIELDS = LlamaShapedConfig.POSITIVE_FIELDS + ("num_experts", "top_k", "moe_hidden",
                                                          "decoder_sparse_step")

    def __post_init__(self):
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        require_positive(type(self).__name__, **{name: getattr(self, name) for name in self.POSITIVE_FIELDS})
        outside = sorted(i for i in self.mlp_only_layers if not 0 <= i < self.num_layers)
        if outside:
            raise ConfigError(f"Qwen3MoeConfig.mlp_only_layers names layer(s) {outside}, outside the model's "
                              f"{self.num_layers} layers (0 to {self.num_layers - 1})")
        super().__post_init__()

    def block_options(self) -> dict[str, Any]:
        return {"qk_norm": True}

    def sparse_layers(self) -> tuple[bool, ...]:
        """Whether each layer is an MoE layer (transformers' Qwen3MoeDecoderLayer rule)."""
        return tuple(i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
                     for i in range(self.num_layers))

    def decoder_spec(self, execution: Execution = Execution()) -> DecoderSpec:
        dense = self.block_config(execution)
        sparse = dataclasses.replace(dense, moe=moe_shaped.moe_layer(self, self.moe_hidden, self.norm_topk_prob))
        runs: list[StackRun] = []
        for is_sparse in self.sparse_layers():
            block = sparse if is_sparse else dense
            if runs and runs[-1].block == block:
                runs[-1] = StackRun(block, runs[-1].num_layers + 1)
            else:
                runs.append(StackRun(block, 1))
        return DecoderSpec(vocab_size=self.vocab_size, num_layers=self.num_layers, max_seq_len=self.max_seq_len,
                           block=runs[0].block, tie_embeddings=self.tie_embeddings,
                           runs=None if len(runs) == 1 else tuple(runs))


_QWEN_VOCAB = 151936

PRESETS: dict[str, Qwen3MoeConfig] = {
    # Qwen/Qwen3-30B-A3B-Base config.json.
    "qwen3_30b_a3b": Qwen3MoeConfig(vocab_size=_QWEN_VOCAB, d_model=2048, num_layers=48, num_heads=32,
                                    num_kv_heads=4, mlp_hidden=6144, moe_hidden=768),
    # Qwen/Qwen3-235B-A22B config.json.
    "qwen3_235b_a22b": Qwen3MoeConfig(vocab_size=_QWEN_VOCAB, d_model=4096, num_layers=94, num_heads=64,
                                      num_kv_heads=4, mlp_hidden=12288, moe_hidden=1536),
    # Test and CPU sizes. "tiny_odd": top-2 of 5 experts, head_dim (14) not d_model // num_heads, and layer 1
    # dense among sparse ones (three runs).
    "tiny": Qwen3MoeConfig(vocab_size=4096, d_model=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64,
                           mlp_hidden=704, num_experts=8, top_k=2, moe_hidden=128, max_seq_len=256),
    "tiny_odd": Qwen3MoeConfig(vocab_size=131, d_model=60, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=14,
                               mlp_hidden=92, num_experts=5, top_k=2, moe_hidden=22, mlp_only_layers=(1,),
                               max_seq_len=64),
}


# --- Hugging Face ----------------------------------------------------------------

# transformers' Qwen3MoeConfig defaults, for keys a config.json omits.
_HF_DEFAULTS = {"num_key_value_heads": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                "tie_word_embeddings": False, "use_sliding_window": False, "decoder_sparse_step": 1,
                "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128, "norm_topk_prob": False,
                "mlp_only_layers": []}
_PREFIX = "model.layers.{i}.mlp."
_EXPERT_NAMES = dict(gate="gate_proj", up="up_proj", down="down_proj")


def config_from_hf(hf_config: Mapping[str, Any]) -> Qwen3MoeConfig:
    hf_config = {**_HF_DEFAULTS, **hf_config}
    hf.refuse(bool(hf_config["use_sliding_window"]),
              f"use_sliding_window=True is not supported: spillway's Qwen3-MoE has no sliding window "
              f"(sliding_window={hf_config.get('sliding_window')})")
    fields = llama_shaped.fields_from_hf(hf_config, "Qwen3-MoE")
    # transformers' Qwen3-MoE attention takes head_dim when the config has one, else hidden // heads.
    fields["head_dim"] = int(hf_config.get("head_dim") or fields["d_model"] // fields["num_heads"])
    layers = fields["num_layers"]
    mlp_only = [int(i) for i in hf_config["mlp_only_layers"] or []]
    outside = sorted(i for i in mlp_only if not 0 <= i < layers)
    hf.refuse(bool(outside), f"the Hugging Face Qwen3-MoE config's mlp_only_layers names layer(s) {outside}, "
                             f"outside its {layers} layers (num_hidden_layers)")
    return Qwen3MoeConfig(**fields, **moe_shaped.moe_fields_from_hf(hf_config, "Qwen3-MoE"),
                          moe_hidden=int(hf_config["moe_intermediate_size"]),
                          norm_topk_prob=bool(hf_config["norm_topk_prob"]),
                          decoder_sparse_step=int(hf_config["decoder_sparse_step"]),
                          mlp_only_layers=tuple(sorted(set(mlp_only))))


def fields_to_hf(cfg: Qwen3MoeConfig) -> dict[str, Any]:
    return {**llama_shaped.fields_to_hf(cfg),
            "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
            "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.top_k,
            "moe_intermediate_size": cfg.moe_hidden, "norm_topk_prob": cfg.norm_topk_prob,
            "decoder_sparse_step": cfg.decoder_sparse_step, "mlp_only_layers": list(cfg.mlp_only_layers)}


def weights(cfg: Qwen3MoeConfig) -> list[hf.HFWeight]:
    """Qwen3's tensors; the dense MLP's where some layer is dense, the router and experts where some is sparse
    (models/hf.py maps each per-layer tensor onto the runs that hold it)."""
    sparse = cfg.sparse_layers()
    sparse_layers = frozenset(i for i, is_sparse in enumerate(sparse) if is_sparse)
    dense_layers = frozenset(range(cfg.num_layers)) - sparse_layers
    dense_mlp = {w.path for w in hf_rows.gated_mlp()}
    table = [dataclasses.replace(w, layers=dense_layers) if w.path in dense_mlp else w
             for w in llama_shaped.weights(cfg) if dense_layers or w.path not in dense_mlp]
    if sparse_layers:
        table += [dataclasses.replace(w, layers=sparse_layers) for w in moe_shaped.expert_weights(_PREFIX, **_EXPERT_NAMES)]
    return table


def fused_views(cfg: Qwen3MoeConfig) -> dict[str, tuple[str, tuple]]:
    layers = [i for i, is_sparse in enumerate(cfg.sparse_layers()) if is_sparse]
    return moe_shaped.fused_expert_views(layers, cfg.num_experts, cfg.moe_hidden, checkpoint_prefix=_PREFIX,
                                         module_prefix=_PREFIX, **_EXPERT_NAMES)


FAMILY = register_family(Family(
    name="qwen3_moe",
    config_cls=Qwen3MoeConfig,
    presets=PRESETS,
    description="Qwen3-MoE 30B-A3B / 235B-A22B: Qwen3 with top-8 of 128 experts (dense layers where configured)",
    hf=hf.HFTable(model_types=("qwen3_moe",), architecture="Qwen3MoeForCausalLM",
                  config_from_hf=config_from_hf, fields_to_hf=fields_to_hf, weights=weights, views=fused_views,
                  base_prefix=hf_rows.BASE_PREFIX),
))
