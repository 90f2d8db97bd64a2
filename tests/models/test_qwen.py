"""The Qwen2 (Qwen2.5) and Qwen3 families: published sizes, config mapping, parity with transformers,
Hugging Face round trip, offload presets.

Parity: tiny random `transformers` models with odd sizes (hidden 60, 6 heads
over 2 KV heads, intermediate 92, 3 layers, vocabulary 131; Qwen3 with
head_dim 14, not 60 // 6), every parameter perturbed including the q/k/v
biases (DecoderLM) and the q/k norms (DecoderLM), saved with `save_pretrained`, give
the same float32 logits as the spillway model `from_hf` reads from that
directory; what spillway exports loads back into transformers bit for bit.
"""

import re

import numpy as np
import pytest
from flax import nnx

from llama_shaped_checks import forward, hf_logits, numpy_state_dict, perturbed_hf_model, transformers_param_count
from no_remat_reference import assert_every_plan_matches_no_remat
from spillway.models.decoder import DecoderLM, count_params
from spillway.models.hf import export_hf_state_dict, family_config_from_hf, from_hf, to_hf
from spillway.models.qwen import QWEN2, QWEN3
from spillway.models.registry import preset_config

# Published parameter counts (model cards / safetensors metadata).
PUBLISHED = {
    "qwen2_5_0_5b": 494_032_768, "qwen2_5_1_5b": 1_543_714_304, "qwen2_5_7b": 7_615_616_512,
    "qwen3_0_6b": 596_049_920, "qwen3_1_7b": 1_720_574_976, "qwen3_4b": 4_022_468_096, "qwen3_8b": 8_190_735_360,
}
FAMILY_OF = {"qwen2": (QWEN2, DecoderLM), "qwen3": (QWEN3, DecoderLM)}

# Published config.json files (transformers 4 spelling), the keys that describe the model.
QWEN2_5_0_5B_HF = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "hidden_act": "silu", "max_position_embeddings": 32768, "max_window_layers": 24, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "use_sliding_window": False, "use_mrope": False,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}
QWEN2_5_7B_HF = dict(QWEN2_5_0_5B_HF, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                     max_position_embeddings=131072, max_window_layers=28, sliding_window=131072,
                     tie_word_embeddings=False)
QWEN3_0_6B_HF = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960, "max_window_layers": 28,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "use_sliding_window": False, "attention_bias": False, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}
QWEN3_8B_HF = dict(QWEN3_0_6B_HF, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                   num_attention_heads=32, max_window_layers=36, tie_word_embeddings=False)

SEQ = 40
TINY_HF = {
    "qwen2": dict(model_type="qwen2", vocab_size=131, hidden_size=60, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=2, intermediate_size=92, rope_theta=1e6, rms_norm_eps=1e-6,
                  max_position_embeddings=64, use_sliding_window=False, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", vocab_size=131, hidden_size=60, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=14, intermediate_size=92, rope_theta=1e6, rms_norm_eps=1e-6,
                  max_position_embeddings=64, use_sliding_window=False, tie_word_embeddings=False),
}
TINY_PRESET = {"qwen2": preset_config("qwen2", "tiny_odd", tie_embeddings=True), "qwen3": preset_config("qwen3", "tiny_odd")}
HF_CONFIG_CLASS = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
# The parameters that make each family differ from Llama; the parity must be able to see them.
DISTINCT_PARAMS = {"qwen2": ("_proj.bias", 0.0), "qwen3": ("_norm.weight", 1.0)}   # (name suffix, init value)
TOKENS = np.random.default_rng(1).integers(0, 131, (2, SEQ))
# Measured: max |difference| 3.0e-6 (DecoderLM) and 3.7e-6 (DecoderLM) on logits up to 3.7 (float32).
PARITY_RTOL = PARITY_ATOL = 1e-5
FLOAT32 = dict(dtype="float32", param_dtype="float32")


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def reference(request, transformers, tmp_path_factory):
    """(family name, directory, transformers model, its logits): a tiny perturbed model saved with save_pretrained."""
    name = request.param
    model = perturbed_hf_model(transformers, HF_CONFIG_CLASS[name], TINY_HF[name])
    directory = tmp_path_factory.mktemp(f"{name}_tiny")
    model.save_pretrained(directory)
    return name, directory, model, hf_logits(model, TOKENS)


def _preset(name):
    return (QWEN2 if name.startswith("qwen2") else QWEN3).presets[name]


# --- sizes and configs (no torch) ---------------------------------------------------

@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_parameter_counts_match_published(preset):
    assert _preset(preset).num_params() == PUBLISHED[preset]


@pytest.mark.parametrize("preset", ["qwen2_5_0_5b", "qwen3_0_6b"])
def test_built_model_has_the_counted_parameters(preset):
    assert count_params(lambda: DecoderLM(_preset(preset), rngs=nnx.Rngs(0))) == PUBLISHED[preset]


def test_transformers_counts_the_same_parameters(transformers):
    for preset, published in PUBLISHED.items():
        family = QWEN2 if preset.startswith("qwen2") else QWEN3
        assert transformers_param_count(transformers, family.hf.config_to_hf(_preset(preset))) == published, preset


@pytest.mark.parametrize("hf_config, preset", [
    (QWEN2_5_0_5B_HF, "qwen2_5_0_5b"), (QWEN2_5_7B_HF, "qwen2_5_7b"),
    (QWEN3_0_6B_HF, "qwen3_0_6b"), (QWEN3_8B_HF, "qwen3_8b"),
], ids=["qwen2.5-0.5b", "qwen2.5-7b", "qwen3-0.6b", "qwen3-8b"])
def test_published_configs_map_to_the_presets(hf_config, preset):
    family, cfg = family_config_from_hf(hf_config)
    assert cfg == _preset(preset)
    assert family.hf.config_from_hf(family.hf.config_to_hf(cfg)) == cfg


def test_qwen3_head_dim_defaults_to_128_like_transformers():
    absent = {k: v for k, v in QWEN3_8B_HF.items() if k != "head_dim"}
    assert family_config_from_hf(absent)[1].head_dim == 128
    assert family_config_from_hf(dict(QWEN3_8B_HF, head_dim=64))[1].head_dim == 64


@pytest.mark.parametrize("hf_config", [QWEN2_5_0_5B_HF, QWEN3_0_6B_HF], ids=["qwen2", "qwen3"])
def test_a_window_on_no_layer_is_accepted(hf_config):
    # use_sliding_window with max_window_layers == num_hidden_layers: transformers windows no layer.
    on_no_layer = dict(hf_config, use_sliding_window=True, sliding_window=4096)
    assert family_config_from_hf(on_no_layer)[1] == family_config_from_hf(hf_config)[1]


@pytest.mark.parametrize("hf_config", [QWEN2_5_0_5B_HF, QWEN3_0_6B_HF], ids=["qwen2", "qwen3"])
@pytest.mark.parametrize("change, message", [
    ({"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 21},
     "use_sliding_window=True is not supported: this {family} config windows layers [21, 22, 23"),
    ({"use_sliding_window": True, "sliding_window": 64, "layer_types": ["sliding_attention"] * 24 + ["full"] * 4},
     "windows layers [0, 1, 2"),
    ({"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 0},
     "windows every layer to 4096 positions, and spillway's {family} has no sliding window"),
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     "unsupported rope_type 'yarn'"),
], ids=["max_window_layers", "layer_types", "every_layer", "attention_bias", "mlp_bias", "hidden_act", "yarn"])
def test_unsupported_configs_fail_by_name(hf_config, change, message):
    family = "Qwen2" if hf_config["model_type"] == "qwen2" else "Qwen3"
    with pytest.raises(ValueError, match=re.escape(message.format(family=family))):
        family_config_from_hf(dict(hf_config, **change))


def test_a_per_layer_window_pattern_is_refused_by_name():
    # Half the layers windowed: the stack could express it (Gemma does), spillway's Qwen config has no field for it.
    half = dict(QWEN3_0_6B_HF, use_sliding_window=True, sliding_window=4096, max_window_layers=14)
    with pytest.raises(ValueError) as err:
        family_config_from_hf(half)
    assert "windows layers [14, 15," in str(err.value) and "and the others not" in str(err.value)
    assert "no per-layer windows" in str(err.value)


def test_unknown_presets_are_named():
    with pytest.raises(ValueError, match="unknown qwen3 preset 'qwen3_32b'"):
        preset_config("qwen3", "qwen3_32b")
    with pytest.raises(ValueError, match="Qwen2Config has no field"):
        preset_config("qwen2", "tiny", qk_norm=True)


# --- parity with transformers -------------------------------------------------------

def test_logits_match_transformers(reference):
    name, directory, _, expected = reference
    model = from_hf(directory, remat="save_all", **FLOAT32)  # config.json as this transformers writes it
    assert model.config == TINY_PRESET[name] and isinstance(model, FAMILY_OF[name][1])
    np.testing.assert_allclose(np.asarray(forward(model, TOKENS)), expected, rtol=PARITY_RTOL, atol=PARITY_ATOL)


def test_the_family_specific_parameters_matter(reference):
    """Set the q/k/v biases (DecoderLM) or the q/k norms (DecoderLM) to their init values: the logits move far."""
    name, _, hf_model, expected = reference
    suffix, init = DISTINCT_PARAMS[name]
    state = numpy_state_dict(hf_model)
    changed = [k for k in state if k.endswith(suffix)]
    assert len(changed) == 3 * (3 if name == "qwen2" else 2)   # per layer: q, k, v biases / q, k norms
    state.update({k: np.full_like(state[k], init) for k in changed})
    model = from_hf(state, config=TINY_HF[name], remat="save_all", **FLOAT32)
    assert np.abs(np.asarray(forward(model, TOKENS)) - expected).max() > 100 * PARITY_ATOL


def test_export_round_trips_exactly_and_transformers_loads_it(transformers, reference, tmp_path):
    name, directory, hf_model, expected = reference
    model = from_hf(directory, remat="save_all", **FLOAT32)
    to_hf(model, tmp_path)
    again = from_hf(tmp_path, **FLOAT32)
    assert again.config == model.config
    exported = export_hf_state_dict(again)
    original = {k: v for k, v in numpy_state_dict(hf_model).items()
                if not (model.config.tie_embeddings and k == "lm_head.weight")}  # a tied head is not stored
    assert sorted(exported) == sorted(original)
    for key, array in exported.items():
        np.testing.assert_array_equal(array, original[key], err_msg=key)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(reloaded) is type(hf_model)
    np.testing.assert_array_equal(hf_logits(reloaded, TOKENS), expected)


def test_missing_and_misshapen_tensors_are_named(reference):
    name, _, hf_model, _ = reference
    state = numpy_state_dict(hf_model)
    if name == "qwen2":
        del state["model.layers.1.self_attn.k_proj.bias"]
        state["model.layers.2.self_attn.q_proj.bias"] = np.zeros(59, np.float32)
        missing, misshapen = "model.layers.1.self_attn.k_proj.bias", "q_proj.bias: checkpoint (59,), config expects (60,)"
    else:
        del state["model.layers.1.self_attn.k_norm.weight"]
        state["model.layers.2.self_attn.q_norm.weight"] = np.ones(10, np.float32)  # d_model // heads, not head_dim
        missing, misshapen = "model.layers.1.self_attn.k_norm.weight", "q_norm.weight: checkpoint (10,), config expects (14,)"
    with pytest.raises(ValueError) as err:
        from_hf(state, config=TINY_HF[name])
    message = str(err.value)
    assert f"missing tensors (1): ['{missing}']" in message
    assert misshapen in message


# --- offload (no torch) -------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
@pytest.mark.slow  # in `make test-slow` (CI runs it): minutes on 2 cores
def test_every_offload_plan_gives_the_no_remat_loss_and_gradients(name):
    tokens = np.random.default_rng(2).integers(0, 131, (2, 17))
    assert_every_plan_matches_no_remat(FAMILY_OF[name][1], TINY_PRESET[name], tokens)
