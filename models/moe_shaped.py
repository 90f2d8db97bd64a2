"""What the mixture-of-experts families share: their dispatch settings, the MoE layer they build, their experts'
Hugging Face tensors.

Mixtral (models/mixtral.py) and Qwen3-MoE (models/qwen3_moe.py) are Llama-shaped
(models/llama_shaped.py) with the MLP of some or all layers replaced by an MoE
layer (layers/moe.py): a router to `num_experts` experts, the `top_k` of them a
token goes through, each a SwiGLU MLP of `expert_hidden`. Both families' configs
carry the same four fields on how the layer runs; they are the recipe's choice
(`--set model.moe_dispatch=capacity`), not the checkpoint's, and never change
which parameters exist:

    moe_dispatch          "dropless" (every token copy computed) | "capacity" (fixed slots, copies
                          over an expert's slots dropped and counted); layers/moe_dispatch.py
    moe_grouped_matmul    dropless only: "ragged_dot" | "blocked" (layers/grouped_matmul.py)
    moe_capacity_factor   capacity only: slots per expert = ceil(factor * k * tokens / E)
    moe_block_rows        rows per block of the "blocked" grouped matmul

Hugging Face. Published checkpoints, and the safetensors files transformers 5
`save_pretrained` writes, hold one tensor per expert (`...experts.{j}.w1.weight`,
an nn.Linear [f, d]); spillway stacks them into [E, d, f] (`expert_weights`,
with `{j}` for the expert index, models/hf.py). transformers 5's modules hold
the experts fused (`experts.gate_up_proj` [E, 2f, d], `experts.down_proj`
[E, d, f]) and convert on load and save; an in-memory `state_dict()` of such a
model is in the fused layout, which `fused_expert_views` maps onto the
per-expert names (slices, so nothing is copied whole).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from spillway.layers.moe import MoEConfig
from spillway.models import hf

@dataclasses.dataclass(frozen=True)
class MoERunFields:
    """The four fields on how an MoE family's layer runs (the module docstring), declared once.

    A family config lists it before its config base (`class MixtralConfig(MoERunFields, LlamaShapedConfig)`),
    so that these defaulted fields follow the base's required ones."""

    moe_dispatch: str = "dropless"
    moe_grouped_matmul: str = "ragged_dot"
    moe_capacity_factor: float = 1.25
    moe_block_rows: int = 128



def moe_layer(cfg, expert_hidden: int, renormalize: bool) -> MoEConfig:
    """The MoE layer of a family config with `num_experts`, `top_k` and the MoERunFields.

    Its execution is the block's (layers/block.py BlockConfig aligns it)."""
    return MoEConfig(d_model=cfg.d_model, num_experts=cfg.num_experts, top_k=cfg.top_k, expert_hidden=expert_hidden,
                     mlp_kind="swiglu", renormalize=renormalize, dispatch=cfg.moe_dispatch,
                     capacity_factor=cfg.moe_capacity_factor, grouped_matmul=cfg.moe_grouped_matmul,
                     grouped_matmul_block=cfg.moe_block_rows)


def expert_weights(prefix: str, gate: str, up: str, down: str) -> list[hf.HFWeight]:
    """The router and per-expert tensors of one MoE layer under `prefix` (with `{i}`): `prefix + "gate.weight"`
    for the router and `prefix + "experts.{j}." + name + ".weight"` for each expert's gate, up and down."""
    W, e = hf.HFWeight, prefix + "experts.{j}."
    return [
        W(prefix + "gate.weight", ("mlp", "router", "w"), hf.LINEAR),
        W(e + f"{gate}.weight", ("mlp", "w_gate"), hf.LINEAR),
        W(e + f"{up}.weight", ("mlp", "w_up"), hf.LINEAR),
        W(e + f"{down}.weight", ("mlp", "w_down"), hf.LINEAR),
    ]


def fused_expert_views(layers, num_experts: int, expert_hidden: int, *, checkpoint_prefix: str,
                       module_prefix: str, gate: str, up: str, down: str) -> dict[str, tuple[str, tuple]]:
    """{per-expert checkpoint name: (fused transformers-5 module name, index)} for the MoE layers `layers`.

    transformers 5 holds a layer's experts as `module_prefix + "experts.gate_up_proj"` [E, 2f, d] (gate rows
    first, then up) and `"experts.down_proj"` [E, d, f], and its router as `module_prefix + "gate.weight"`;
    the checkpoint names them under `checkpoint_prefix` (Mixtral renames block_sparse_moe to mlp)."""
    f = expert_hidden
    views: dict[str, tuple[str, tuple]] = {}
    for i in layers:
        ours, theirs = checkpoint_prefix.format(i=i), module_prefix.format(i=i)
        views[ours + "gate.weight"] = (theirs + "gate.weight", ())
        for j in range(num_experts):
            e = f"{ours}experts.{j}."
            views[e + f"{gate}.weight"] = (theirs + "experts.gate_up_proj", (j, slice(0, f)))
            views[e + f"{up}.weight"] = (theirs + "experts.gate_up_proj", (j, slice(f, 2 * f)))
            views[e + f"{down}.weight"] = (theirs + "experts.down_proj", (j,))
    return views


def moe_fields_from_hf(hf_config, family: str) -> dict[str, Any]:
    """`num_experts` and `top_k` of a Hugging Face MoE config (either spelling of the expert count:
    transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts`, the published files the former)."""
    experts = hf_config.get("num_local_experts", hf_config.get("num_experts"))
    hf.refuse(experts is None, f"the Hugging Face {family} config has no expert count (num_local_experts or "
                               f"num_experts)")
    hf.require(hf_config, ("num_experts_per_tok",), family)
    return {"num_experts": int(experts), "top_k": int(hf_config["num_experts_per_tok"])}
