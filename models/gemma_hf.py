"""Gemma 2 and Gemma 3's Hugging Face mapping: config.json fields both ways, and every tensor.

    gemma2       Gemma2ForCausalLM checkpoints
    gemma3_text  Gemma3ForCausalLM checkpoints (Gemma 3 1B, and text-only saves of the larger ones)
    gemma3       Gemma3ForConditionalGeneration (4B, 12B, 27B): the text tower is read from
                 `text_config` and the `model.language_model.*` tensors (`language_model.model.*` in the
                 files Google published); the vision tower and projector are not read. Export writes a
                 `gemma3_text` checkpoint.

The layer pattern comes from `layer_types` (one "sliding_attention" or
"full_attention" per layer; older files give `sliding_window_pattern` and
transformers derives the list, as here): it becomes the shortest period that
repeats to that list. A type spillway has no layer for, or a list whose length
is not the depth, is a one-line error.

Gemma's four norms per layer keep their meaning: `post_attention_layernorm`
is the norm on the attention output (spillway's `post_attn_norm`), not the
pre-MLP norm it names in Llama's table; `pre_feedforward_layernorm` is the
pre-MLP norm. Norm weights are stored as Gemma stores them (w of (1 + w)).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from spillway.models import hf, hf_rows

SLIDING, FULL = "sliding_attention", "full_attention"
_KIND = {SLIDING: "L", FULL: "G"}

# (checkpoint prefix, table prefix) of the text tower in a multimodal Gemma 3 checkpoint: transformers >= 4.52
# saves `model.language_model.*`; the files Google published hold `language_model.model.*`.
GEMMA3_TEXT_TOWER = (("model.language_model.", "model."), ("language_model.model.", "model."),
                     ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))

# transformers' Gemma2Config / Gemma3TextConfig defaults, for keys a config.json omits (google/gemma-3-4b's
# text_config omits its heads, 8 and 4: the defaults). The sizes a config.json always states stay required.
_GEMMA2_DEFAULTS = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
                    "max_position_embeddings": 8192, "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                    "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
                    "hidden_activation": "gelu_pytorch_tanh"}
_GEMMA3_DEFAULTS = {"vocab_size": 262208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "rms_norm_eps": 1e-6, "max_position_embeddings": 131072, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
                    "sliding_window": 4096, "final_logit_softcapping": None, "attn_logit_softcapping": None,
                    "hidden_activation": "gelu_pytorch_tanh", "sliding_window_pattern": 6}
_TANH_GELU = ("gelu_pytorch_tanh", "gelu_tanh")


def layer_pattern_from_hf(hf_config: Mapping[str, Any], family: str, default_period: int) -> str:
    """The shortest period of "L"/"G" letters that repeats to the checkpoint's layer types."""
    num_layers = hf_config["num_hidden_layers"]
    types = hf_config.get("layer_types")
    if types is None:   # as transformers derives them: the last layer of each period is global
        period = int(hf_config.get("sliding_window_pattern") or default_period)
        types = [SLIDING if (i + 1) % period else FULL for i in range(num_layers)]
    types = list(types)
    hf.refuse(len(types) != num_layers, f"the Hugging Face {family} config lists {len(types)} layer_types for "
                                        f"{num_layers} layers (num_hidden_layers)")
    unknown = sorted({t for t in types if t not in _KIND})
    hf.refuse(bool(unknown), f"the Hugging Face {family} config has layer_types {unknown}, which spillway's "
                             f"{family} cannot express: its layers are {SLIDING!r} or {FULL!r}")
    kinds = "".join(_KIND[t] for t in types)
    for period in range(1, num_layers + 1):
        if all(kinds[i] == kinds[i % period] for i in range(num_layers)):
            return kinds[:period]
    raise AssertionError("unreachable: the whole list is a period")


def layer_types_to_hf(cfg) -> list[str]:
    return [SLIDING if kind == "L" else FULL for kind in cfg.layer_kinds()]


def _common_fields(hf_config: Mapping[str, Any], family: str, pattern: str) -> dict[str, Any]:
    hf.require(hf_config, ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size"), family)
    hf.refuse(bool(hf_config.get("attention_bias", False)),
              f"attention_bias=True is not supported: {family} has no projection biases")
    hf.refuse(bool(hf_config.get("use_bidirectional_attention")),
              f"use_bidirectional_attention=True is not supported: spillway's {family} is a causal decoder")
    act = hf_config.get("hidden_activation") or hf_config.get("hidden_act")
    hf.refuse(act not in _TANH_GELU, f"hidden_activation {act!r} is not supported: spillway's {family} MLP is the "
                                     f"tanh-approximated GELU ({_TANH_GELU[0]!r})")
    window = hf_config.get("sliding_window")
    hf.refuse("L" in pattern and not window, f"the Hugging Face {family} config has sliding_attention layers but "
                                        f"sliding_window={window!r}")
    return dict(
        vocab_size=int(hf_config["vocab_size"]), d_model=int(hf_config["hidden_size"]),
        num_layers=int(hf_config["num_hidden_layers"]), num_heads=int(hf_config["num_attention_heads"]),
        num_kv_heads=int(hf_config["num_key_value_heads"]), head_dim=int(hf_config["head_dim"]),
        mlp_hidden=int(hf_config["intermediate_size"]), sliding_window=int(window or 4096),
        query_pre_attn_scalar=float(hf_config["query_pre_attn_scalar"]),
        attn_softcap=_cap(hf_config.get("attn_logit_softcapping")),
        final_softcap=_cap(hf_config.get("final_logit_softcapping")),
        norm_eps=float(hf_config["rms_norm_eps"]), tie_embeddings=bool(hf_config["tie_word_embeddings"]),
        max_seq_len=int(hf_config["max_position_embeddings"]), layer_pattern=pattern)


def _with_defaults(defaults: Mapping[str, Any], hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """`hf_config` over the family's defaults. A null stands for the default, except where null is a value: no
    cap, or no window (refused with sliding layers, which transformers cannot build either; read as the default
    4096, the refusal named a window the file does not hold)."""
    return {**defaults, **{k: v for k, v in hf_config.items()
                           if v is not None or k == "sliding_window" or k.endswith("capping")}}


def _integral(value: float) -> int:
    """transformers types query_pre_attn_scalar as an int (and refuses a config.json holding 12.5): whole numbers
    are written as one, and another number has no config.json that loads."""
    hf.refuse(not float(value).is_integer(),
              f"model.query_pre_attn_scalar={value} is not a whole number, which transformers' Gemma configs hold "
              f"(it refuses the config.json): no Hugging Face folder computes this model")
    return int(value)


def _cap(value) -> float | None:
    return None if value is None else float(value)


def gemma2_fields_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma2Config's fields from a gemma2 config (models/gemma.py builds the class from them)."""
    hf_config = _with_defaults(_GEMMA2_DEFAULTS, hf_config)
    fields = _common_fields(hf_config, "Gemma 2", layer_pattern_from_hf(hf_config, "Gemma 2", 2))
    theta, scaling = hf.rope_settings(hf_config)
    hf.refuse(scaling is not None, f"rope scaling {scaling} is not supported for Gemma 2 (it has none)")
    return {**fields, "rope_theta": theta, "rope_local_theta": theta}


def _gemma3_rope(hf_config: Mapping[str, Any]) -> dict[str, float]:
    """(global base, local base, global linear scale) from either config generation."""
    params = hf_config.get("rope_parameters")
    if isinstance(params, Mapping) and (FULL in params or SLIDING in params):   # transformers >= 5: per layer type
        full, sliding = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
        # a rope_scaling beside them (added by hand, as for the older files) is laid over the global layers'
        # parameters, as transformers 5 does: read apart, the scaling it computes was dropped without a word
        full.update(hf_config.get("rope_scaling") or {})
    else:                                                                      # rope_theta, rope_local_base_freq
        full = dict(hf_config.get("rope_scaling") or {})
        older = full.get("type", "default")
        # transformers 5 lays rope_scaling over {"rope_type": "default"}: an older "type" key is then not read
        # (the model without scaling); transformers 4 read it. Two readings of one file: neither is taken.
        hf.refuse("rope_type" not in full and older != "default",
                  f"rope_scaling names its kind with the older key \"type\" ({older!r}), which transformers 5 does "
                  f"not read for Gemma 3 (no scaling) and transformers 4 did: rename it to \"rope_type\" in "
                  f"config.json, as Google's Gemma 3 configs spell it, so that both read the model you mean")
        sliding = {"rope_type": "default"}
    # a base the per-type parameters omit is the top-level one, as transformers fills it (it was the default)
    full.setdefault("rope_theta", hf_config.get("rope_theta", 1_000_000.0))
    sliding.setdefault("rope_theta", hf_config.get("rope_local_base_freq", 10_000.0))
    out = {"rope_theta": float(full["rope_theta"]), "rope_local_theta": float(sliding["rope_theta"]),
           "rope_global_scale": 1.0}
    for where, params in (("full_attention", full), ("sliding_attention", sliding)):
        kind = params.get("rope_type", params.get("type", "default"))
        if kind == "linear" and where == "full_attention":
            out["rope_global_scale"] = float(params["factor"])
        else:
            hf.refuse(kind != "default", f"rope_type {kind!r} on the {where} layers is not supported: spillway's "
                                         f"Gemma 3 has linear scaling on the global layers only")
    return out


def gemma3_fields_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma3Config's fields from a gemma3_text config, or a multimodal gemma3 config's text tower."""
    if hf_config.get("model_type") == "gemma3":
        text = hf_config.get("text_config")
        hf.refuse(not isinstance(text, Mapping), "the multimodal gemma3 config has no text_config: spillway reads "
                                                 "only the text tower of a Gemma 3 checkpoint")
        # the lm_head belongs to the multimodal model: transformers ties it by the top-level flag, whatever
        # text_config says (save_pretrained of an untied model writes false there and true in text_config)
        tied = hf_config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
        hf_config = {**text, "tie_word_embeddings": tied}
    hf_config = _with_defaults(_GEMMA3_DEFAULTS, hf_config)
    fields = _common_fields(hf_config, "Gemma 3", layer_pattern_from_hf(hf_config, "Gemma 3", 6))
    # transformers' Gemma 3 attention keeps attn_logit_softcapping but never applies it (Gemma 2's does), and
    # no Gemma 3 sets it: read as transformers computes, a config that names a cap is the model without one
    return {**fields, **_gemma3_rope(hf_config), "attn_softcap": None}


def _fields_to_hf(cfg) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.mlp_hidden, "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_seq_len, "query_pre_attn_scalar": _integral(cfg.query_pre_attn_scalar),
        "sliding_window": cfg.sliding_window, "layer_types": layer_types_to_hf(cfg),
        "attn_logit_softcapping": cfg.attn_softcap, "final_logit_softcapping": cfg.final_softcap,
        "attention_bias": False,
    }


def gemma2_fields_to_hf(cfg) -> dict[str, Any]:
    if cfg.rope_local_theta != cfg.rope_theta or cfg.rope_global_scale != 1.0:
        raise hf.HFCheckpointError("a Gemma 2 with two RoPE bases or a RoPE scaling has no Hugging Face gemma2 "
                                   "config (transformers' Gemma 2 has one base for every layer)")
    return {**_fields_to_hf(cfg), "rope_theta": cfg.rope_theta}


def gemma3_fields_to_hf(cfg) -> dict[str, Any]:
    if cfg.attn_softcap is not None:
        raise hf.HFCheckpointError(f"a Gemma 3 with model.attn_softcap={cfg.attn_softcap} has no Hugging Face "
                                   f"gemma3_text config: transformers' Gemma 3 does not apply "
                                   f"attn_logit_softcapping, so it would compute other logits than this model")
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_global_scale != 1.0:
        full = {"rope_type": "linear", "factor": cfg.rope_global_scale, "rope_theta": cfg.rope_theta}
    return {**_fields_to_hf(cfg),
            "rope_parameters": {FULL: full, SLIDING: {"rope_type": "default", "rope_theta": cfg.rope_local_theta}}}


def weights(cfg) -> list[hf.HFWeight]:
    """Every tensor of a Gemma 2 / Gemma 3 text checkpoint (Gemma 3: with the q/k norms)."""
    W, p = hf.HFWeight, hf_rows.LAYER
    table = hf_rows.embedding() + hf_rows.attention_projections()
    if cfg.QK_NORM:   # Gemma 3's per-head q/k norms, where transformers lists them
        table += hf_rows.qk_norms()
    table += hf_rows.gated_mlp() + [
        W(p + "input_layernorm.weight", ("attn_norm", "scale"), hf.VECTOR),
        # A post-norm in Gemma (on the attention output), not the pre-MLP norm of Llama's table.
        W(p + "post_attention_layernorm.weight", ("post_attn_norm", "scale"), hf.VECTOR),
        W(p + "pre_feedforward_layernorm.weight", ("mlp_norm", "scale"), hf.VECTOR),
        W(p + "post_feedforward_layernorm.weight", ("post_mlp_norm", "scale"), hf.VECTOR),
    ]
    return table + hf_rows.final(cfg.tie_embeddings)
