"""`lora.targets`: Hugging Face module names (q_proj, ..., down_proj) turned into the block weights they are.

A family's Hugging Face table (models/) already says which spillway weight
each checkpoint tensor is: `model.layers.{i}.self_attn.q_proj.weight` is the
block's ("attn", "wq"). The projections LoRA can adapt are the table's
per-layer weight matrices, `nn.Linear` (stored [out, in]) or `Conv1D` (GPT-2,
stored [in, out]); PEFT's lora_A [r, in] / lora_B [out, r] are the same for
both, so an adapter is PEFT's as is. Their module names are the part of the
tensor name between the layer index and `.weight` (`self_attn.q_proj`). A
tensor that fuses several block weights (GPT-2's `attn.c_attn`, q | k | v) is
one projection whose adapter is one matrix over them (layers/lora.py
FusedLoraAdapter), as PEFT adapts it. A target matches a projection as PEFT's
`target_modules` does: the whole name, or its last part (`q_proj`). A target
that matches nothing is a ConfigError naming the projections the model has;
`lora.targets` left at PEFT's default for Llama-shaped models (q_proj, v_proj)
on a family without those takes the family's own PEFT default (GPT-2: c_attn).
The routed experts' projections (Mixtral's
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
# PEFT's default target_modules for Llama-shaped models, recipes/config.py LoraConfig's default.
PEFT_LLAMA_DEFAULT = ("q_proj", "v_proj")
# Every routed expert projection (an MoE layer's stacked gate/up/down), by one name.
EXPERTS = "experts"


def projections(model_config) -> dict[str, tuple[tuple[str, str], ...]]:
    """{Hugging Face module name inside a layer ("self_attn.q_proj"): the (module, weight) pairs in the block it
    holds}: one pair, or a fused tensor's parts in their order (GPT-2's "attn.c_attn": wq, wk, wv)."""
    family = family_of_config(model_config)
    if family.hf is None:
        return {}
    found: dict[str, list[tuple[int, tuple[str, str]]]] = {}
    for w in family.hf.weights(model_config):
        if not w.per_layer or w.per_expert or w.layout.split < 1:
            continue   # embeddings, norms, biases (vectors), per-expert tensors
        if len(w.path) != 2 or not w.hf_name.endswith(_WEIGHT_SUFFIX) or _LAYER_INDEX not in w.hf_name:
            continue
        module = w.hf_name.split(_LAYER_INDEX, 1)[1][:-len(_WEIGHT_SUFFIX)]
        found.setdefault(module, []).append((0 if w.part is None else w.part[1], (w.path[0], w.path[1])))
    return {module: tuple(path for _, path in sorted(parts)) for module, parts in found.items()}


def stored_in_out(model_config) -> bool:
    """Whether the family's projections are stored [in, out] (Conv1D: PEFT's `fan_in_fan_out`), not nn.Linear's
    [out, in]."""
    family = family_of_config(model_config)
    return family.hf is not None and any(
        w.per_layer and not w.per_expert and w.layout.split >= 1 and not w.layout.transpose and len(w.path) == 2
        and w.hf_name.endswith(_WEIGHT_SUFFIX) for w in family.hf.weights(model_config))


def expert_projections(model_config) -> dict[str, tuple[str, str]]:
    """{Hugging Face module name of a routed experts' projection ("block_sparse_moe.experts.{j}.w1"): (module,
    weight) of the stacked experts in the block ("mlp", "w_gate")}."""
    family = family_of_config(model_config)
    if family.hf is None:
        return {}
    return {w.hf_name.split(_LAYER_INDEX, 1)[1][:-len(_WEIGHT_SUFFIX)]: (w.path[0], w.path[1])
            for w in family.hf.weights(model_config)
            if w.per_layer and w.per_expert and len(w.path) == 2 and w.hf_name.endswith(_WEIGHT_SUFFIX)}


def names_module(target: str, module: str) -> bool:
    """Whether a lora.targets entry names this Hugging Face module: the whole name, or its last parts."""
    return module == target or module.endswith("." + target)


def lora_spec(lora, model_config, param_dtype: str) -> LoraSpec:
    """The LoraSpec of a recipe's `lora` section (rank > 0) for its model; ConfigError for a target that
    names no projection of the model."""
    available, experts = projections(model_config), expert_projections(model_config)
    short = sorted({name.rsplit(".", 1)[-1] for name in (*available, *experts)})
    family = family_of_config(model_config)
    if lora.rank > model_config.d_model:   # every projection has d_model on one side: a rank past it adds nothing
        raise ConfigError(f"lora.rank={lora.rank} is larger than the model's d_model ({model_config.d_model}), "
                          f"the most rank an adapter of its projections can have; LoRA ranks are 4 to 64, "
                          f"typically")
    if not short:
        raise ConfigError(f"LoRA: the {family.name} model has no projection it can adapt (its Hugging Face table "
                          f"names no per-layer weight matrix); fine-tune every weight instead (lora.rank=0)")
    requested = tuple(lora.targets)
    default = family.hf.lora_default_targets
    if requested == PEFT_LLAMA_DEFAULT and default and not any(
            names_module(t, m) for t in requested for m in (*available, *experts)):
        requested = default   # PEFT's default for this model type, as PEFT takes it for target_modules=None
    targets: set[tuple[str, str]] = set()
    fused: set[tuple[str, tuple[str, ...]]] = set()
    expert_targets: set[tuple[str, str]] = set()
    for target in requested:
        hits = [paths for module, paths in available.items() if names_module(target, module)]
        routed = [path for module, path in experts.items() if target == EXPERTS or names_module(target, module)]
        if not hits and not routed:
            raise ConfigError(f"lora.targets: {target!r} names no projection of the {family.name} model; it has "
                              f"{short}")
        for paths in hits:
            if len(paths) == 1:
                targets.add(paths[0])
            else:   # a fused tensor: one adapter over its parts (all in one module)
                fused.add((paths[0][0], tuple(weight for _, weight in paths)))
        expert_targets.update(routed)
    if expert_targets and lora.dropout:
        raise ConfigError(f"lora.dropout={lora.dropout} with the routed experts adapted: their adapters are merged "
                          f"into the expert weights each pass, which leaves no per-token input to drop; set "
                          f"lora.dropout=0 or adapt no expert projection")
    return LoraSpec(rank=lora.rank, alpha=lora.alpha, targets=frozenset(targets), dropout=lora.dropout,
                    param_dtype=param_dtype, expert_targets=frozenset(expert_targets),
                    fused_targets=frozenset(fused))


def hf_modules(model_config, spec: LoraSpec) -> list[str]:
    """The Hugging Face module names (inside a layer) of the block weights `spec` adapts, sorted."""
    adapted = set(spec.targets) | {(module, part) for module, parts in spec.fused_targets for part in parts}
    return sorted([module for module, paths in projections(model_config).items() if set(paths) <= adapted]
                  + [module for module, path in expert_projections(model_config).items()
                     if path in spec.expert_targets])
