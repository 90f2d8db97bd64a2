"""The Mistral family: published sizes, config mapping, parity with transformers through a sliding window,
Hugging Face round trip, offload presets, cached decoding past the window.

Parity: a tiny random `transformers.MistralForCausalLM` (hidden 60, 6 heads
over 2 KV heads, intermediate 92, 3 layers, vocabulary 131, sliding window 7)
saved with `save_pretrained` gives the same float32 logits over 40 tokens,
far past the window, as the spillway Mistral that `from_hf` reads from that
directory. The window must matter: without it the logits are far off.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llama_shaped_checks import forward, hf_logits, numpy_state_dict, perturbed_hf_model, transformers_param_count
from no_remat_reference import assert_every_plan_matches_no_remat
from spillway.models.decoder import DecoderLM, count_params
from spillway.models.hf import export_hf_state_dict, family_config_from_hf, from_hf, to_hf
from spillway.layers.execution import Execution
from spillway.models.mistral import FAMILY, PRESETS
from spillway.models.registry import preset_config

# Published parameter counts (model cards / safetensors metadata).
PUBLISHED = {"mistral_7b_v0_1": 7_241_732_096, "mistral_7b_v0_3": 7_248_023_552}

# The published config.json files (transformers 4 spelling), the keys that describe the model.
MISTRAL_7B_V01_HF = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
MISTRAL_7B_V03_HF = dict(MISTRAL_7B_V01_HF, vocab_size=32768, rope_theta=1000000.0, sliding_window=None)

WINDOW, SEQ = 7, 40
TINY_HF = dict(vocab_size=131, hidden_size=60, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
               intermediate_size=92, sliding_window=WINDOW, rope_theta=10000.0, rms_norm_eps=1e-5,
               max_position_embeddings=64, tie_word_embeddings=False, hidden_act="silu", model_type="mistral")
TOKENS = np.random.default_rng(1).integers(0, TINY_HF["vocab_size"], (2, SEQ))
# Measured: max |difference| 3.8e-6 (xla) and 5.0e-6 (flash) on logits up to 4.0 (float32).
PARITY_RTOL = PARITY_ATOL = 1e-5
FLOAT32 = dict(dtype="float32", param_dtype="float32")


@pytest.fixture(scope="module")
def reference(transformers, tmp_path_factory):
    """(directory, transformers model, its logits): a tiny perturbed Mistral saved with save_pretrained."""
    model = perturbed_hf_model(transformers, "MistralConfig", TINY_HF)
    directory = tmp_path_factory.mktemp("mistral_tiny")
    model.save_pretrained(directory)
    return directory, model, hf_logits(model, TOKENS)


# --- sizes and configs (no torch) ---------------------------------------------------

@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_parameter_counts_match_published(preset):
    assert PRESETS[preset].num_params() == PUBLISHED[preset]
    assert count_params(lambda: DecoderLM(PRESETS[preset], rngs=nnx.Rngs(0))) == PUBLISHED[preset]


def test_transformers_counts_the_same_parameters(transformers):
    for preset, published in PUBLISHED.items():
        assert transformers_param_count(transformers, FAMILY.hf.config_to_hf(PRESETS[preset])) == published, preset


@pytest.mark.parametrize("hf_config, preset", [(MISTRAL_7B_V01_HF, "mistral_7b_v0_1"),
                                               (MISTRAL_7B_V03_HF, "mistral_7b_v0_3")], ids=["v0.1", "v0.3"])
def test_published_configs_map_to_the_presets(hf_config, preset):
    family, cfg = family_config_from_hf(hf_config)
    assert family.name == "mistral" and cfg == PRESETS[preset]
    assert family.hf.config_from_hf(family.hf.config_to_hf(cfg)) == cfg


def test_sliding_window_null_is_none_and_absent_is_transformers_default():
    assert family_config_from_hf(dict(MISTRAL_7B_V01_HF, sliding_window=None))[1].sliding_window is None
    absent = {k: v for k, v in MISTRAL_7B_V01_HF.items() if k != "sliding_window"}
    assert family_config_from_hf(absent)[1].sliding_window == 4096  # MistralConfig's default
    sparse = {k: MISTRAL_7B_V01_HF[k] for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                                                "num_attention_heads", "intermediate_size")}
    cfg = family_config_from_hf(sparse)[1]  # transformers' MistralConfig defaults fill the rest
    assert (cfg.num_kv_heads, cfg.norm_eps, cfg.max_seq_len, cfg.rope_theta) == (8, 1e-6, 131072, 10000.0)


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_type 'yarn'"),
    ({"sliding_window": 0}, "sliding_window must be positive"),
    ({"num_key_value_heads": 5}, "num_kv_heads (5) does not divide num_heads (32)"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_unsupported_configs_fail_by_name(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        family_config_from_hf(dict(MISTRAL_7B_V01_HF, **change))


def test_layer_types_decide_the_window_as_transformers_auto_classes_read_them():
    """AutoConfig reads a mistral config.json with layer_types as Ministral: only sliding_attention layers window.
    Windowing every layer alike gave other logits than AutoModelForCausalLM (6.9 apart on a tiny model)."""
    layers = MISTRAL_7B_V01_HF["num_hidden_layers"]
    of = lambda types: family_config_from_hf(dict(MISTRAL_7B_V01_HF, layer_types=types))[1].sliding_window  # noqa: E731
    assert of(["sliding_attention"] * layers) == 4096
    assert of(["full_attention"] * layers) is None
    with pytest.raises(ValueError, match=r"layer_types mixes full and sliding-window attention layers \(a Ministral"):
        of(["full_attention"] + ["sliding_attention"] * (layers - 1))
    assert family_config_from_hf(dict(MISTRAL_7B_V01_HF, sliding_window=None,
                                      layer_types=["full_attention", "sliding_attention"] * (layers // 2))
                                 )[1].sliding_window is None   # no window to slide: every layer sees all
    with pytest.raises(ValueError, match=r"layer_types holds \['chunked_attention'\]"):
        of(["chunked_attention"] * layers)


def test_unknown_preset_is_named():
    with pytest.raises(ValueError, match="unknown mistral preset 'mistral_8x7b'"):
        preset_config("mistral", "mistral_8x7b")


# --- parity with transformers -------------------------------------------------------

def test_logits_match_transformers_through_the_window(reference):
    directory, _, expected = reference
    model = from_hf(directory, remat="save_all", **FLOAT32)  # config.json as this transformers writes it
    assert model.config == PRESETS["tiny_odd"] and isinstance(model, DecoderLM)
    np.testing.assert_allclose(np.asarray(forward(model, TOKENS)), expected, rtol=PARITY_RTOL, atol=PARITY_ATOL)
    # The comparison must be able to see the window: without it the logits are far off.
    unwindowed = from_hf(directory, remat="save_all", sliding_window=None, **FLOAT32)
    assert np.abs(np.asarray(forward(unwindowed, TOKENS)) - expected).max() > 100 * PARITY_ATOL


def test_flash_attention_matches_transformers_through_the_window(reference):
    directory, _, expected = reference
    model = from_hf(directory, remat="offload_dots", execution=Execution(attention_impl="flash", flash_block_size=8))
    np.testing.assert_allclose(np.asarray(forward(model, TOKENS)), expected, rtol=PARITY_RTOL, atol=PARITY_ATOL)


def test_export_round_trips_exactly_and_transformers_loads_it(transformers, reference, tmp_path):
    directory, hf_model, expected = reference
    model = from_hf(directory, remat="save_all", **FLOAT32)
    to_hf(model, tmp_path)
    again = from_hf(tmp_path, **FLOAT32)
    assert again.config == model.config
    exported, original = export_hf_state_dict(again), numpy_state_dict(hf_model)
    assert sorted(exported) == sorted(original)
    for name, array in exported.items():
        np.testing.assert_array_equal(array, original[name], err_msg=name)
    reloaded = transformers.MistralForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert reloaded.config.sliding_window == WINDOW
    np.testing.assert_array_equal(hf_logits(reloaded, TOKENS), expected)


def test_missing_and_misshapen_tensors_are_named(reference):
    _, hf_model, _ = reference
    state = numpy_state_dict(hf_model)
    del state["model.layers.2.mlp.gate_proj.weight"]
    state["model.layers.0.self_attn.v_proj.weight"] = np.zeros((10, 60), np.float32)
    with pytest.raises(ValueError) as err:
        from_hf(state, config=TINY_HF)
    message = str(err.value)
    assert "missing tensors (1): ['model.layers.2.mlp.gate_proj.weight']" in message
    assert "model.layers.0.self_attn.v_proj.weight: checkpoint (10, 60), config expects (20, 60)" in message


# --- offload and decoding (no torch) ---------------------------------------------------

@pytest.mark.slow  # in `make test-slow` (CI runs it): minutes on 2 cores
def test_every_offload_plan_gives_the_no_remat_loss_and_gradients():
    tokens = np.random.default_rng(2).integers(0, 131, (2, 17))  # 16 positions, past the window of 7
    assert_every_plan_matches_no_remat(DecoderLM, preset_config("mistral", "tiny_odd"), tokens)


def test_cached_decode_past_the_window_matches_full_recompute():
    """Prefill 5 tokens, then decode one at a time to position 11: the cache's mask must apply the window."""
    cfg = preset_config("mistral", "tiny_odd")
    model = DecoderLM(cfg, rngs=nnx.Rngs(3), remat="save_all")
    decode = jax.jit(lambda model, tokens, cache, index: model(tokens, cache=cache, cache_index=index))
    prompt_len, total = 5, 12
    sequence = jnp.asarray(TOKENS[:, :total], jnp.int32)
    cache = model.init_cache(batch=2, max_len=total)
    logits, cache = decode(model, sequence[:, :prompt_len], cache, jnp.int32(0))
    full = forward(model, sequence)
    np.testing.assert_allclose(logits, full[:, :prompt_len], rtol=1e-5, atol=1e-5)
    for position in range(prompt_len, total):
        logits, cache = decode(model, sequence[:, position:position + 1], cache, jnp.int32(position))
        np.testing.assert_allclose(logits[:, 0], full[:, position], rtol=1e-5, atol=1e-5, err_msg=str(position))

