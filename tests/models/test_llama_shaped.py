"""The shared Llama-shaped config base (models/llama_shaped.py): families stay apart, errors name the family.

Each family's own behaviour (sizes, Hugging Face parity, offload plans) is
tested in its file; here, what sharing a base must not break: generic code
tells the families apart by their config's exact class, a recipe refuses a
sibling family's config, and a bad field is named with the family's class.
"""

import dataclasses
import itertools

import pytest

from spillway.layers.errors import ConfigError
from spillway.models.llama_shaped import LlamaShapedConfig
from spillway.models.registry import FAMILIES, family_names, family_of_config
from spillway.recipes.config import Recipe
from spillway.recipes.registry import get_recipe

LLAMA_SHAPED = [name for name in family_names() if issubclass(FAMILIES[name].config_cls, LlamaShapedConfig)]


def test_the_llama_shaped_families_are_the_expected_ones():
    # Mixtral and Qwen3-MoE: the Llama-shaped base with MoE layers (models/moe_shaped.py).
    assert sorted(LLAMA_SHAPED) == ["llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe"]


@pytest.mark.parametrize("a, b", list(itertools.permutations(family_names(), 2)))
def test_no_family_config_is_another_familys(a, b):
    # A subclass would pass Recipe's isinstance check for the other family.
    assert not issubclass(FAMILIES[a].config_cls, FAMILIES[b].config_cls)


@pytest.mark.parametrize("name", LLAMA_SHAPED)
def test_each_preset_is_found_by_its_own_family(name):
    for config in FAMILIES[name].presets.values():
        assert family_of_config(config) is FAMILIES[name]


def test_a_recipes_family_is_its_model_configs_and_a_recipe_json_naming_a_sibling_is_refused():
    """The family is derived from the model config's class (no second field to disagree with it); a
    recipe.json that names a sibling family for a Mistral model fails on the field only Mistral has."""
    mistral = get_recipe("mistral_tiny")
    assert mistral.family == "mistral" and mistral.to_dict()["family"] == "mistral"
    saved = dict(mistral.to_dict(), family="llama")
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['sliding_window'\] in model"):
        Recipe.from_dict(saved)
    with pytest.raises(ConfigError, match="is no registered family's config"):
        dataclasses.replace(mistral, model=object())


@pytest.mark.parametrize("name, field, value", [
    ("llama", "d_model", 0), ("mistral", "sliding_window", 0), ("qwen2", "num_kv_heads", -1),
    ("qwen3", "head_dim", 0), ("qwen3", "norm_eps", 0.0),
])
def test_a_bad_field_is_named_with_the_familys_class(name, field, value):
    family = FAMILIES[name]
    with pytest.raises(ConfigError, match=f"{family.config_cls.__name__}.{field} must be positive"):
        family.config("tiny", **{field: value})


@pytest.mark.parametrize("name, switch", [("qwen2", "qkv_bias"), ("qwen3", "qk_norm")])
def test_a_familys_fixed_block_switch_is_on_and_the_others_off(name, switch):
    block = FAMILIES[name].presets["tiny"].block_config()
    switches = {s: getattr(block, s) for s in ("qkv_bias", "qk_norm", "out_bias", "mlp_bias")}
    assert switches == {s: s == switch for s in switches}
    assert (block.norm, block.mlp_kind, block.rope) == ("rms", "swiglu", True)
