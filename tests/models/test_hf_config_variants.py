"""config.json variants that people's checkpoints carry, read as transformers reads them.

* A `rope_scaling` beside transformers 5's `rope_parameters` (a transformers 5
  save with the scaling a model card says to add for a longer context): transformers
  reads the `rope_scaling` over `rope_parameters` (its base from itself or the top
  level, never from `rope_parameters`); spillway read `rope_parameters` alone and
  loaded the model without its scaling, other logits without a word. A kind
  spillway has no RoPE for (linear) is now refused by name. Gemma 3 lays it over
  its global layers' parameters, as transformers does.
* Gemma 3's per-layer-type parameters without a `rope_theta`: transformers takes
  the top-level `rope_theta` / `rope_local_base_freq`; spillway took the defaults.
* A top-level `original_max_position_embeddings` (Phi-3's place for it), which
  transformers 5 takes over the scaling's own: it was not read, so the llama3
  scaling was computed from another length. Where the two differ, transformers
  4 reads the other: refused, naming both.
* RoPE settings of another type (a string, a null base) are one-line errors;
  they were internal errors (AttributeError, TypeError).
* A quantized checkpoint (GPTQ, AWQ, bitsandbytes, FP8: `quantization_config`)
  is refused naming its method; its packed weights and scales were a list of
  every projection missing, which the fine-tune called a config.json to fix.

The expected values are written out (no torch); one test checks them against
transformers' own config classes where the parity extra is installed.
"""

import copy
import re

import pytest

from spillway.layers.rope import RopeScaling
from spillway.models.hf import HFCheckpointError, family_config_from_hf

LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
         "max_position_embeddings": 64}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
GEMMA3 = {"model_type": "gemma3_text", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
          "query_pre_attn_scalar": 16, "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"],
          "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}}

# (config.json, the base and scaling transformers computes with)
BOTH_SPELLINGS = {
    "scaling-and-top-level-base": (
        dict(LLAMA, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rope_scaling=LLAMA3,
             rope_theta=500000.0), (500000.0, RopeScaling(8.0, 1.0, 4.0, 16))),
    # the scaling replaces rope_parameters whole: its base goes with it, for the class default
    "scaling-without-base": (
        dict(LLAMA, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rope_scaling=LLAMA3),
        (10000.0, RopeScaling(8.0, 1.0, 4.0, 16))),
    "null-scaling": (
        dict(LLAMA, rope_parameters=dict(LLAMA3, rope_theta=20000.0), rope_scaling=None),
        (20000.0, RopeScaling(8.0, 1.0, 4.0, 16))),
}


@pytest.mark.parametrize("name", BOTH_SPELLINGS)
def test_a_rope_scaling_beside_rope_parameters_is_read_as_transformers_reads_it(name):
    hf_config, (theta, scaling) = BOTH_SPELLINGS[name]
    _, cfg = family_config_from_hf(hf_config)
    assert (cfg.rope_theta, cfg.rope_scaling) == (theta, scaling)


def test_a_linear_rope_scaling_beside_rope_parameters_is_refused_not_dropped():
    hf_config = dict(LLAMA, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                     rope_scaling={"type": "linear", "factor": 4.0})
    with pytest.raises(HFCheckpointError, match="unsupported rope_type 'linear'"):
        family_config_from_hf(hf_config)
    with pytest.raises(HFCheckpointError, match="rope scaling .*'linear'.* is not supported for Gemma 2"):
        family_config_from_hf(dict(GEMMA3, model_type="gemma2", rope_parameters=None, rope_theta=10000.0,
                                   rope_scaling={"rope_type": "linear", "factor": 4.0}))


def test_gemma3_lays_a_rope_scaling_over_its_global_layers_parameters():
    _, cfg = family_config_from_hf(dict(GEMMA3, rope_scaling={"rope_type": "linear", "factor": 4.0}))
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_global_scale) == (5000.0, 500.0, 4.0)


NESTED_WITHOUT_BASES = dict(GEMMA3, rope_theta=5000.0, rope_local_base_freq=300.0, rope_parameters={
    "full_attention": {"rope_type": "linear", "factor": 4.0}, "sliding_attention": {"rope_type": "default"}})


def test_gemma3_takes_the_top_level_bases_its_per_type_parameters_omit():
    _, cfg = family_config_from_hf(NESTED_WITHOUT_BASES)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_global_scale) == (5000.0, 300.0, 4.0)


def test_the_expected_values_are_transformers_own(transformers):
    for hf_config, (theta, scaling) in BOTH_SPELLINGS.values():
        theirs = transformers.LlamaConfig.from_dict(copy.deepcopy(hf_config)).rope_parameters   # it edits them
        assert theirs["rope_theta"] == theta
        assert (theirs["rope_type"], theirs["factor"], theirs["original_max_position_embeddings"]) == (
            "llama3", scaling.factor, scaling.original_max_position)
    gemma = transformers.Gemma3TextConfig.from_dict(copy.deepcopy(dict(GEMMA3, rope_scaling={"rope_type": "linear", "factor": 4.0})))
    full = gemma.rope_parameters["full_attention"]
    assert (full["rope_type"], full["factor"], full["rope_theta"]) == ("linear", 4.0, 5000.0)
    nested = transformers.Gemma3TextConfig.from_dict(copy.deepcopy(NESTED_WITHOUT_BASES)).rope_parameters
    assert (nested["full_attention"]["rope_theta"], nested["sliding_attention"]["rope_theta"]) == (5000.0, 300.0)


def test_a_top_level_original_max_position_is_read_and_two_of_them_refused():
    scaled = dict(LLAMA, rope_parameters=dict(LLAMA3, rope_theta=10000.0))
    del scaled["rope_parameters"]["original_max_position_embeddings"]
    _, cfg = family_config_from_hf(dict(scaled, original_max_position_embeddings=8))
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8)
    with pytest.raises(HFCheckpointError, match="original_max_position_embeddings twice, 8 at its top level and 16"):
        family_config_from_hf(dict(LLAMA, rope_parameters=LLAMA3, original_max_position_embeddings=8))


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": "linear"}, "config.json's rope_scaling is 'linear', not a dict of RoPE settings"),
    ({"rope_parameters": [10000.0]}, "config.json's rope_parameters is [10000.0], not a dict of RoPE settings"),
    ({"rope_theta": None}, "the Hugging Face RoPE config lacks ['rope_theta']"),
    ({"rope_theta": "1e4"}, "the Hugging Face RoPE config's rope_theta='1e4' is not a number"),
], ids=["scaling-a-string", "parameters-a-list", "null-base", "base-a-string"])
def test_rope_settings_of_another_type_are_one_line_errors_not_internal_ones(change, message):
    """A hand-edited config.json; these were an AttributeError, a TypeError and a ValueError of float()."""
    with pytest.raises(HFCheckpointError, match=re.escape(message)):
        family_config_from_hf(dict(LLAMA, **change))


@pytest.mark.parametrize("quantization", [{"quant_method": "gptq", "bits": 4}, {"quant_method": "bitsandbytes",
                                          "load_in_4bit": True}, {"quant_method": "fp8", "weight_block_size": [128, 128]}],
                         ids=lambda q: q["quant_method"])
def test_a_quantized_checkpoint_is_refused_naming_its_method(quantization):
    with pytest.raises(HFCheckpointError, match=re.escape(
            f"the Hugging Face checkpoint is quantized (quantization_config, quant_method "
            f"{quantization['quant_method']!r}): spillway reads unquantized weights")):
        family_config_from_hf(dict(LLAMA, quantization_config=quantization))
    _, cfg = family_config_from_hf(dict(LLAMA, quantization_config=None))   # as some unquantized files say
    assert cfg.d_model == 64
