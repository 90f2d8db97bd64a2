"""`lora.targets`: Hugging Face module names (q_proj, ..., down_proj) turned into the block weights they are.

A family's Hugging Face table (models/) already says which spillway weight
each checkpoint tensor is: `model.layers.{i}.self_attn.q_proj.weight` is the
block's ("attn", "wq"). The projections LoRA can adapt are the table's
per-layer `nn.Linear` weights (stored [out, in], so an adapter is PEFT's
lora_A / lora_B as is); their module names are the part of the tensor name
between the layer index and `.weight` (`self_attn.q_proj`). A target matches a
projection as PEFT's `target_modules` does: the whole name, or its last part
(`q_proj`). A target that matches nothing is a ConfigError naming the
projections the model has. The routed experts' projections (Mixtral's
`block_sparse_moe.experts.{j}.w1`, Qwen3-MoE's `mlp.experts.{j}.gate_proj`)
match the same way (`w1`, `gate_proj`; `experts` names all of them) and get
an adapter per expert (layers/lora.py ExpertLoraAdapter), without dropout.
"""

from __future__ import annotations

from spillway.layers.errors import ConfigError
from spillway.layers.lora import LoraSpec
from spillway.models.registry import family_of_config

_LAYER_INDEX = "{i}."
_WEIGHT_SUFFIX = ".weight"
# Every routed expert projection (an MoE layer's stacked gate/up/down), by one name.
EXPERTS = "experts"


def projections(model_config) -> dict[str, tuple[str, str]]:
    """{Hugging Face module name inside a layer ("self_attn.q_proj"): (module, weight) in the block}."""
    family = family_of_config(model_config)
    if family.hf is None:
        return {}
    found = {}
    for w in family.hf.weights(model_config):
        if not w.per_layer or w.per_expert or w.part is not None or not w.layout.transpose:
            continue   # embeddings, norms, biases, fused or per-expert tensors, Conv1D layouts
        if len(w.path) != 2 or not w.hf_name.endswith(_WEIGHT_SUFFIX) or _LAYER_INDEX not in w.hf_name:
            continue
        module = w.hf_name.split(_LAYER_INDEX, 1)[1][:-len(_WEIGHT_SUFFIX)]
        found[module] = (w.path[0], w.path[1])
    return found


def expert_projections(model_config) -> dict[str, tuple[str, str]]:
    """{Hugging Face module name of a routed experts' projection ("block_sparse_moe.experts.{j}.w1"): (module,
    weight) of the stacked experts in the block ("mlp", "w_gate")}."""
    family = family_of_config(model_config)
    if family.hf is None:
        return {}
    return {w.hf_name.split(_LAYER_INDEX, 1)[1][:-len(_WEIGHT_SUFFIX)]: (w.path[0], w.path[1])
            for w in family.hf.weights(model_config)
            if w.per_layer and w.per_expert and len(w.path) == 2 and w.hf_name.endswith(_WEIGHT_SUFFIX)}


def _matches(target: str, module: str) -> bool:
    return module == target or module.endswith("." + target)


def lora_spec(lora, model_config, param_dtype: str) -> LoraSpec:
    """The LoraSpec of a recipe's `lora` section (rank > 0) for its model; ConfigError for a target that
    names no projection of the model."""
    available, experts = projections(model_config), expert_projections(model_config)
    short = sorted({name.rsplit(".", 1)[-1] for name in (*available, *experts)})
    family = family_of_config(model_config).name
    if lora.rank > model_config.d_model:   # every projection has d_model on one side: a rank past it adds nothing
        raise ConfigError(f"lora.rank={lora.rank} is larger than the model's d_model ({model_config.d_model}), "
                          f"the most rank an adapter of its projections can have; LoRA ranks are 4 to 64, "
                          f"typically")
    if not short:   # GPT-2: Conv1D projections, q|k|v fused in one c_attn, which PEFT adapts as one matrix
        raise ConfigError(f"LoRA: the {family} model has no projection it can adapt in this "
                          f"version (its Hugging Face weights are Conv1D, q, k and v fused in one c_attn, which a "
                          f"PEFT adapter would adapt as one matrix); fine-tune every weight instead (lora.rank=0)")
    targets: set[tuple[str, str]] = set()
    expert_targets: set[tuple[str, str]] = set()
    for target in lora.targets:
        hits = [path for module, path in available.items() if _matches(target, module)]
        routed = [path for module, path in experts.items() if target == EXPERTS or _matches(target, module)]
        if not hits and not routed:
            raise ConfigError(f"lora.targets: {target!r} names no projection of the {family} model; it has "
                              f"{short}")
        targets.update(hits)
        expert_targets.update(routed)
    if expert_targets and lora.dropout:
        raise ConfigError(f"lora.dropout={lora.dropout} with the routed experts adapted: their adapters are merged "
                          f"into the expert weights each pass, which leaves no per-token input to drop; set "
                          f"lora.dropout=0 or adapt no expert projection")
    return LoraSpec(rank=lora.rank, alpha=lora.alpha, targets=frozenset(targets), dropout=lora.dropout,
                    param_dtype=param_dtype, expert_targets=frozenset(expert_targets))


def hf_modules(model_config, targets: frozenset[tuple[str, str]],
               expert_targets: frozenset[tuple[str, str]] = frozenset()) -> list[str]:
    """The Hugging Face module names (inside a layer) of the adapted block weights, sorted."""
    return sorted([module for module, path in projections(model_config).items() if path in targets]
                  + [module for module, path in expert_projections(model_config).items() if path in expert_targets])
