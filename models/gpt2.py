"""GPT-2 (124M, 355M, 774M, 1.5B): config presets at the published sizes, and the Hugging Face table.

`GPT2Config` holds the architecture only (dtypes and kernels are the recipe's
`Execution`). The model is the generic `DecoderLM` (models/decoder.py) with
GPT-2's switches: learned absolute positions added to the token embedding
(`max_seq_len` is the size of that table, GPT-2's `n_positions`, so also the
longest sequence the model can see), pre-norm LayerNorm with bias, multi-head
attention without RoPE and with biases on the q/k/v and output projections, a
plain tanh-GELU MLP with biases, and the output head tied to the embedding.

Hugging Face: GPT-2 stores its projections as `Conv1D`, whose weight is
[in, out] (the transpose of `nn.Linear`), so no layout transposes. q, k and v
are fused in one `attn.c_attn` tensor [d, 3d] (bias [3d]) and read as three
parts of it. Published checkpoints carry `attn.bias` / `attn.masked_bias`
causal-mask buffers, which are ignored; and they were saved from the base
`GPT2Model`, so their names lack the `transformer.` prefix that
`GPT2LMHeadModel.save_pretrained` writes: both spellings are read
(`HFTable.base_prefix`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from spillway.layers.block import BlockConfig
from spillway.layers.execution import Execution
from spillway.models import hf
from spillway.models.decoder import DecoderSpec
from spillway.models.registry import Family, register_family

# transformers' names for GPT-2's tanh approximation of GELU; plain "gelu" there is the exact (erf) one.
TANH_GELU_NAMES = ("gelu_new", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    mlp_hidden: int | None = None    # None: 4 * d_model (GPT-2's n_inner)
    norm_eps: float = 1e-5
    max_seq_len: int = 1024          # rows of the learned position table (n_positions)

    def __post_init__(self):
        if self.mlp_hidden is not None and self.mlp_hidden <= 0:
            raise ValueError(f"GPT2Config.mlp_hidden must be positive (or None for 4 * d_model), "
                             f"got {self.mlp_hidden}")
        self.decoder_spec(Execution())  # validates sizes and the head layout, naming the field

    @property
    def resolved_mlp_hidden(self) -> int:
        return self.mlp_hidden or 4 * self.d_model

    def block_config(self, execution: Execution = Execution(), **extra) -> BlockConfig:
        return BlockConfig(
            d_model=self.d_model, num_heads=self.num_heads, num_kv_heads=self.num_heads,
            mlp_hidden=self.resolved_mlp_hidden, norm="layer", norm_eps=self.norm_eps, mlp_kind="gelu",
            mlp_bias=True, qkv_bias=True, out_bias=True, rope=False, execution=execution, **extra)

    def decoder_spec(self, execution: Execution = Execution()) -> DecoderSpec:
        return DecoderSpec(vocab_size=self.vocab_size, num_layers=self.num_layers, max_seq_len=self.max_seq_len,
                           block=self.block_config(execution), tie_embeddings=True, learned_positions=True)

    def num_params(self) -> int:
        return self.decoder_spec().num_params()


PRESETS: dict[str, GPT2Config] = {
    # Radford et al. 2019, as published on the Hugging Face Hub (gpt2, gpt2-medium, gpt2-large, gpt2-xl).
    "gpt2_124m": GPT2Config(vocab_size=50257, d_model=768, num_layers=12, num_heads=12),
    "gpt2_355m": GPT2Config(vocab_size=50257, d_model=1024, num_layers=24, num_heads=16),
    "gpt2_774m": GPT2Config(vocab_size=50257, d_model=1280, num_layers=36, num_heads=20),
    "gpt2_1_5b": GPT2Config(vocab_size=50257, d_model=1600, num_layers=48, num_heads=25),
    # Test and CPU sizes. Odd numbers on purpose in "tiny_odd" (5 heads of 12, an MLP that is not
    # 4 * d_model) to catch shape bugs.
    "tiny": GPT2Config(vocab_size=2048, d_model=192, num_layers=4, num_heads=6, max_seq_len=128),
    "tiny_odd": GPT2Config(vocab_size=131, d_model=60, num_layers=3, num_heads=5, mlp_hidden=92, max_seq_len=48),
}


# --- Hugging Face ----------------------------------------------------------------

# config.json switches of transformers' GPT-2 that change the model, with the value spillway implements.
_FIXED = {
    "scale_attn_weights": True,                 # False: scores not divided by sqrt(head_dim)
    "scale_attn_by_inverse_layer_idx": False,   # True: layer i's scores also divided by i + 1
    "reorder_and_upcast_attn": False,           # True: scores scaled before the matmul and upcast (other numerics)
    "add_cross_attention": False,               # True: encoder-decoder blocks with cross-attention
    "tie_word_embeddings": True,                # False: a separate output head
}


def config_from_hf(hf_config: Mapping[str, Any]) -> GPT2Config:
    hf.require(hf_config, ("vocab_size", "n_embd", "n_layer", "n_head"), "GPT-2")
    for field, honoured in _FIXED.items():
        value = hf_config.get(field, honoured)
        hf.refuse(bool(value) != honoured, f"{field}={value} is not supported: spillway's GPT-2 implements "
                                           f"only {field}={honoured}")
    activation = hf_config.get("activation_function", "gelu_new")
    hf.refuse(activation not in TANH_GELU_NAMES,
              f"activation_function {activation!r} is not supported: the GPT-2 MLP is the tanh GELU "
              f"({' or '.join(repr(n) for n in TANH_GELU_NAMES)})")
    d_model, mlp_hidden = hf_config["n_embd"], hf_config.get("n_inner")
    if mlp_hidden == 4 * d_model:
        mlp_hidden = None  # the default; left unset so configs compare equal to the presets
    # Dropout rates (resid/embd/attn_pdrop) are training settings with no effect on the weights or the
    # logits; spillway trains without dropout, so they are not carried over.
    return GPT2Config(
        vocab_size=hf_config["vocab_size"], d_model=d_model, num_layers=hf_config["n_layer"],
        num_heads=hf_config["n_head"], mlp_hidden=mlp_hidden,
        # transformers' own defaults, for keys a config.json omits.
        norm_eps=float(hf_config.get("layer_norm_epsilon", 1e-5)),
        max_seq_len=int(hf_config.get("n_positions", 1024)))


def fields_to_hf(cfg: GPT2Config) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size,
        "n_embd": cfg.d_model, "n_layer": cfg.num_layers, "n_head": cfg.num_heads, "n_inner": cfg.mlp_hidden,
        "n_positions": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new",
        **_FIXED,
        # spillway trains without dropout; transformers would default to 0.1.
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
    }


# Conv1D weights are [in, out], spillway's own order: only the head axes are flattened.
_QKV = hf.Layout(split=1)          # c_attn's q, k or v part [d, heads*hd] <-> [d, heads, hd]
_OUT = hf.Layout(split=2)          # c_proj [heads*hd, d] <-> [heads, hd, d]


def gpt2_weights(cfg: GPT2Config) -> list[hf.HFWeight]:
    """Every tensor of a GPT-2 checkpoint (GPT2LMHeadModel names; the head is tied to wte)."""
    W, p = hf.HFWeight, "transformer.h.{i}."
    weights = [
        W("transformer.wte.weight", ("embed", "table"), hf.COPY),
        W("transformer.wpe.weight", ("positions", "table"), hf.COPY),
        W(p + "ln_1.weight", ("attn_norm", "scale"), hf.VECTOR),
        W(p + "ln_1.bias", ("attn_norm", "bias"), hf.VECTOR),
    ]
    # c_attn fuses q | k | v along its output axis (axis 1 of the weight, 0 of the bias).
    for index, x in enumerate("qkv"):
        weights += [W(p + "attn.c_attn.weight", ("attn", f"w{x}"), _QKV, part=(1, index, 3)),
                    W(p + "attn.c_attn.bias", ("attn", f"b{x}"), hf.VECTOR, part=(0, index, 3))]
    weights += [
        W(p + "attn.c_proj.weight", ("attn", "wo"), _OUT),
        W(p + "attn.c_proj.bias", ("attn", "bo"), hf.VECTOR),
        W(p + "ln_2.weight", ("mlp_norm", "scale"), hf.VECTOR),
        W(p + "ln_2.bias", ("mlp_norm", "bias"), hf.VECTOR),
        W(p + "mlp.c_fc.weight", ("mlp", "w_up"), hf.COPY),
        W(p + "mlp.c_fc.bias", ("mlp", "b_up"), hf.VECTOR),
        W(p + "mlp.c_proj.weight", ("mlp", "w_down"), hf.COPY),
        W(p + "mlp.c_proj.bias", ("mlp", "b_down"), hf.VECTOR),
        W("transformer.ln_f.weight", ("final_norm", "scale"), hf.VECTOR),
        W("transformer.ln_f.bias", ("final_norm", "bias"), hf.VECTOR),
    ]
    return weights


FAMILY = register_family(Family(
    name="gpt2",
    config_cls=GPT2Config,
    presets=PRESETS,
    description="GPT-2 124M / 355M / 774M / 1.5B: LayerNorm, learned positions, GELU MLP, biases, tied head",
    hf=hf.HFTable(model_types=("gpt2",), architecture="GPT2LMHeadModel",
                  config_from_hf=config_from_hf, fields_to_hf=fields_to_hf, weights=gpt2_weights,
                  embed_name="transformer.wte.weight", head_name="lm_head.weight",
                  lora_default_targets=("c_attn",),   # PEFT's default for gpt2
                  # Causal-mask buffers older transformers versions saved with every layer.
                  ignored_suffixes=(".attn.bias", ".attn.masked_bias"),
                  base_prefix="transformer."),
))
