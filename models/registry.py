"""The family spec: what generic code (train loop, planner, FLOP model, generate, HF engine) may ask of a family.

A family is one file in models/ that registers a `Family` (its frozen config
class, architecture only, dtypes and kernels being the recipe's `Execution`;
presets at published sizes; its Hugging Face table), plus its row in
`FAMILY_MODULES` below. A family config answers:

    config.vocab_size, config.num_layers, config.max_seq_len
    config.decoder_spec(execution) -> DecoderSpec    shapes, per-layer values and runs,
                                                     parameter count, KV-cache layout

and the `Family` names the rest: its block class (`block_cls`, which a
recipe's `block` replaces), its model class (the generic `DecoderLM` unless a
family needs its own) and its Hugging Face table. `preset_config(family,
preset, **overrides)` is a preset with fields replaced, for every family.
Everything else follows from the spec: `Family.build` makes the model
(abstractly too, under nnx.eval_shape), models/flops.py counts training
FLOPs layer by layer from the spec's per-layer configs (plain or gated MLP,
each layer's window), the KV cache is laid out from it, and models/hf.py reads
and writes checkpoints through the family's `HFTable`. Generic code names no
family: it looks one up here by name, by config class, or by Hugging Face
`model_type`.

Layers that differ are the spec's (models/decoder.py DecoderSpec): per-layer
values (Gemma's windows and RoPE bases) scanned beside one weight stack, and
runs of layers of another structure (a mixture-of-experts family's dense
layers among sparse ones). Llama-shaped families share their config base and
Hugging Face mapping (models/llama_shaped.py).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any

from flax import nnx

from spillway.layers.block import TransformerBlock
from spillway.layers.errors import ConfigError
from spillway.layers.execution import Execution
from spillway.models.decoder import DecoderLM, DecoderSpec


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    config_cls: type                       # frozen dataclass with decoder_spec(execution)
    presets: Mapping[str, Any]             # published sizes (and test sizes) by name
    description: str
    hf: Any = None                         # models/hf.py HFTable, or None (no Hugging Face mapping)
    model_cls: type = DecoderLM
    block_cls: type = TransformerBlock     # the family's block; a recipe's `block` replaces it

    def config(self, preset: str, **overrides):
        """A preset's config with fields replaced; unknown presets and fields are errors that name them."""
        try:
            base = self.presets[preset]
        except KeyError:
            raise ConfigError(f"unknown {self.name} preset {preset!r}; known presets: {sorted(self.presets)}") \
                from None
        fields = {f.name for f in dataclasses.fields(base)}
        unknown = set(overrides) - fields
        if unknown:
            raise ConfigError(f"{self.config_cls.__name__} has no field(s) {sorted(unknown)}; fields: {sorted(fields)}")
        return dataclasses.replace(base, **overrides)

    def spec(self, config, execution: Execution = Execution()) -> DecoderSpec:
        return config.decoder_spec(execution)

    def build(self, config, execution: Execution = Execution(), *, rngs: nnx.Rngs,
              remat="recompute_all", block_cls: type | None = None):
        """The model of `config` (call under nnx.eval_shape for shapes only); `block_cls` None: the family's."""
        return self.model_cls(config, execution, rngs=rngs, remat=remat, block_cls=block_cls or self.block_cls)

    def abstract(self, config, execution: Execution = Execution(), **kwargs):
        """The model with ShapeDtypeStructs for parameters: nothing allocated."""
        return nnx.eval_shape(lambda: self.build(config, execution, rngs=nnx.Rngs(0), **kwargs))


FAMILIES: dict[str, Family] = {}

# The registry's rows: each family's name and the module that registers it. A new family is its file in
# models/ and its row here. Imported on first lookup, so that `models.registry` itself stays import-light
# and a family module can import this one.
FAMILY_MODULES: dict[str, str] = {
    "llama": "spillway.models.llama",
    "gpt2": "spillway.models.gpt2",
    "mistral": "spillway.models.mistral",
    "qwen2": "spillway.models.qwen",
    "qwen3": "spillway.models.qwen",
    "gemma2": "spillway.models.gemma",
    "gemma3": "spillway.models.gemma",
    "mixtral": "spillway.models.mixtral",
    "qwen3_moe": "spillway.models.qwen3_moe",
}


def register_family(family: Family) -> Family:
    if family.name in FAMILIES and FAMILIES[family.name] is not family:
        raise ValueError(f"model family {family.name!r} registered twice")
    if family.name not in FAMILY_MODULES:
        raise ValueError(f"model family {family.name!r} has no row in models/registry.py FAMILY_MODULES")
    FAMILIES[family.name] = family
    return family


def _load_all() -> None:
    for module in dict.fromkeys(FAMILY_MODULES.values()):
        importlib.import_module(module)


def family_names() -> list[str]:
    _load_all()   # callers read FAMILIES[name] next
    return sorted(FAMILY_MODULES)


def get_family(name: str) -> Family:
    if name not in FAMILY_MODULES:
        raise ConfigError(f"unknown model family {name!r}; known families: {family_names()}")
    importlib.import_module(FAMILY_MODULES[name])
    return FAMILIES[name]


def preset_config(family: str, preset: str, **overrides):
    """A family's preset config with fields replaced: `preset_config("llama", "tiny", num_layers=2)`."""
    return get_family(family).config(preset, **overrides)


def family_of_config(config) -> Family:
    """The family whose config class `config` is."""
    _load_all()
    for family in FAMILIES.values():
        if type(config) is family.config_cls:
            return family
    raise ConfigError(f"{type(config).__name__} is no registered family's config; "
                     f"families: {sorted(FAMILIES)}")


def family_of_hf_model_type(model_type: str) -> Family:
    """The family that reads Hugging Face checkpoints of `model_type` (config.json's "model_type")."""
    _load_all()
    for family in FAMILIES.values():
        if family.hf is not None and model_type in family.hf.model_types:
            return family
    known = sorted(t for f in FAMILIES.values() if f.hf is not None for t in f.hf.model_types)
    raise ValueError(f"Hugging Face model_type {model_type!r} is not supported; spillway reads {known}")
