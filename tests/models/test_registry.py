"""models/registry.py: one row a family (FAMILY_MODULES), each row's module registers the family it names, and
the one generic preset lookup every family shares."""

import importlib

import pytest

from spillway.layers.errors import ConfigError
from spillway.models import registry
from spillway.models.registry import FAMILIES, FAMILY_MODULES, Family, family_names, get_family, preset_config


def test_every_row_names_the_family_its_module_registers():
    family_names()
    assert set(FAMILIES) == set(FAMILY_MODULES)
    for name, module in FAMILY_MODULES.items():
        registered = {family.name for family in vars(importlib.import_module(module)).values()
                      if isinstance(family, Family)}
        assert name in registered, (name, module)


def test_a_family_without_a_row_is_refused_by_name():
    family = get_family("llama")
    with pytest.raises(ValueError, match="model family 'llama_x' has no row in models/registry.py FAMILY_MODULES"):
        registry.register_family(Family(name="llama_x", config_cls=family.config_cls, presets={}, description=""))
    assert "llama_x" not in FAMILIES


def test_preset_config_is_the_family_preset_with_fields_replaced():
    assert preset_config("llama", "tiny", num_layers=2) == get_family("llama").config("tiny", num_layers=2)
    with pytest.raises(ConfigError, match="unknown model family 'llama9'"):
        preset_config("llama9", "tiny")
    with pytest.raises(ConfigError, match="unknown llama preset 'huge'"):
        preset_config("llama", "huge")


def test_export_writes_architecture_and_model_type_from_the_table():
    table = get_family("gemma3").hf
    config = table.config_to_hf(preset_config("gemma3", "tiny"))
    assert (config["architectures"], config["model_type"]) == (["Gemma3ForCausalLM"], "gemma3_text")
    assert config["model_type"] == table.model_types[0]
