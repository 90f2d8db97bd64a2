"""The Hugging Face tensor rows that transformers' decoders name alike, for the family tables to compose.

Llama-shaped checkpoints (models/llama_shaped.py) and Gemma's (models/gemma_hf.py)
share the embedding, the q/k/v/o projections, the per-head q/k norms, the gated
MLP's three projections, the final norm and the untied head, under the same
names and layouts; they differ in their layer norms (Gemma's
`post_attention_layernorm` is a post-norm) and biases, which each table lists
itself. Each function returns rows in the order a table lists them.
"""

from __future__ import annotations

from spillway.models import hf

LAYER = "model.layers.{i}."      # a decoder layer's prefix; `{i}` is the layer index
# transformers' base_model_prefix of these decoders: a base model's save (LlamaModel, Qwen3Model) names its
# tensors without it, and the causal LM transformers loads from it is the same model where its head is tied
BASE_PREFIX = "model."


def embedding() -> list[hf.HFWeight]:
    return [hf.HFWeight("model.embed_tokens.weight", ("embed", "table"), hf.COPY)]


def attention_projections() -> list[hf.HFWeight]:
    """q/k/v/o of `self_attn` ([out, in] nn.Linear, the heads split out on our side)."""
    W, p = hf.HFWeight, LAYER + "self_attn."
    return [W(p + "q_proj.weight", ("attn", "wq"), hf.IN_HEADS), W(p + "k_proj.weight", ("attn", "wk"), hf.IN_HEADS),
            W(p + "v_proj.weight", ("attn", "wv"), hf.IN_HEADS), W(p + "o_proj.weight", ("attn", "wo"), hf.OUT_HEADS)]


def qk_norms() -> list[hf.HFWeight]:
    """The per-head RMSNorm scales on q and k (Qwen3, Gemma 3)."""
    return [hf.HFWeight(LAYER + f"self_attn.{x}_norm.weight", ("attn", f"{x}_norm", "scale"), hf.VECTOR) for x in "qk"]


def gated_mlp() -> list[hf.HFWeight]:
    """gate/up/down of a gated MLP (SwiGLU, GeGLU)."""
    W, p = hf.HFWeight, LAYER + "mlp."
    return [W(p + "gate_proj.weight", ("mlp", "w_gate"), hf.LINEAR),
            W(p + "up_proj.weight", ("mlp", "w_up"), hf.LINEAR),
            W(p + "down_proj.weight", ("mlp", "w_down"), hf.LINEAR)]


def final(tie_embeddings: bool) -> list[hf.HFWeight]:
    """The final norm, and the head unless it is the embedding."""
    rows = [hf.HFWeight("model.norm.weight", ("final_norm", "scale"), hf.VECTOR)]
    if not tie_embeddings:
        rows.append(hf.HFWeight("lm_head.weight", ("head", "w"), hf.LINEAR))
    return rows
