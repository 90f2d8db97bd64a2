"""A recipe whose model differs from an `hf:` checkpoint's config.json: every differing field in one line, with
the --set flags that match it.

A new user matching a transformers-written checkpoint needed four runs (one field named per run), was told
`--set model.rope_scaling=...`, which is a group of fields, and read "the checkpoint's config.json has None"
for a head_dim its config.json wrote out as 16 (the default, d_model / num_heads).
"""

import json

import pytest

from spillway.recipes.config import apply_overrides
from spillway.recipes.registry import get_recipe
from spillway.recipes.train.init_weights import check_model_matches

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
         "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "max_position_embeddings": 128,
         "tie_word_embeddings": False, "hidden_act": "silu",
         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64}}


# the recipe settings that build LLAMA's model
MATCHING = ["model.vocab_size=512", "model.d_model=64", "model.num_layers=2", "model.num_heads=4",
            "model.num_kv_heads=2", "model.mlp_hidden=128", "model.norm_eps=1e-6", "model.rope_theta=500000",
            "model.rope_scaling.factor=8", "model.rope_scaling.original_max_position=64"]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """LLAMA's weights (a differing recipe is checked against them too: a config.json that contradicts its
    own weights is named as such)."""
    from flax import nnx

    from spillway.models.hf import to_hf

    folder = tmp_path_factory.mktemp("weights")
    to_hf(apply_overrides(get_recipe("tiny"), MATCHING + ["model.head_dim=16"]).build_model(nnx.Rngs(0)), folder)
    return folder / "model.safetensors"


@pytest.fixture
def checkpoint(tmp_path, weights):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    (tmp_path / "model.safetensors").symlink_to(weights)
    return tmp_path


def test_every_differing_field_is_named_with_the_flags_that_match_it(checkpoint):
    with pytest.raises(ValueError) as raised:
        check_model_matches(get_recipe("tiny"), checkpoint)
    line = str(raised.value)
    assert len(line.splitlines()) == 1
    for named in ("model.vocab_size (recipe 2048, checkpoint 512)", "model.num_layers (recipe 4, checkpoint 2)",
                  "model.rope_theta (recipe 10000.0, checkpoint 500000.0)"):
        assert named in line
    flags = line.split("match it with ")[1].split(", or pick")[0].split(" --set ")
    matched = apply_overrides(get_recipe("tiny"), [flag.removeprefix("--set ") for flag in flags])
    check_model_matches(matched, checkpoint)   # the flags it gave are all it takes
    assert matched.model.rope_scaling.original_max_position == 64


def test_a_head_dim_written_out_as_its_default_is_the_same_model(checkpoint):
    sets = MATCHING
    check_model_matches(apply_overrides(get_recipe("tiny"), sets + ["model.head_dim=16"]), checkpoint)
    with pytest.raises(ValueError, match=r"model.head_dim \(recipe 8, checkpoint 16\); match it with "
                                         r"--set model.head_dim=16,"):
        check_model_matches(apply_overrides(get_recipe("tiny"), sets + ["model.head_dim=8"]), checkpoint)
