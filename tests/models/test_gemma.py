"""The Gemma 2 and Gemma 3 families: published sizes, configs, parity with transformers, round trip, errors.

Parity: tiny random `transformers` Gemma 2 and Gemma 3 text models with odd
sizes (hidden 60, 6 heads over 2 KV heads of head_dim 10, intermediate 92,
vocabulary 131), a layer pattern with both kinds whose depth is not a multiple
of its period (Gemma 2: 3 layers of "LG"; Gemma 3: 5 layers of "LLG"), a
7-token window inside 40-token sequences, soft-caps small enough to bite
(Gemma 2), two RoPE bases and linear scaling on the global layers (Gemma 3),
every parameter perturbed (transformers starts Gemma's norm weights at zero,
so an untouched model could not tell w from 1 + w), saved with
`save_pretrained`: `from_hf` gives the same float32 logits. A multimodal
Gemma 3 checkpoint's text tower reads the same, in both tensor layouts. What
spillway exports loads back into transformers bit for bit.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llama_shaped_checks import forward, hf_logits, numpy_state_dict, transformers_param_count
from spillway.layers.errors import ConfigError
from spillway.layers.execution import Execution
from spillway.models.decoder import DecoderLM, count_params
from spillway.models.gemma import GEMMA2, GEMMA3
from spillway.models.hf import export_hf_state_dict, family_config_from_hf, from_hf, to_hf
from spillway.models.registry import family_names, get_family, preset_config

# Published parameter counts: Gemma 2 (Keras Hub presets, model cards); Gemma 3 text towers as Google's
# JAX/Keras releases count them (Keras Hub gemma3 presets: 262,144 embedding rows; the Hugging Face text
# towers of 4B, 12B and 27B have 262,208 rows, 64 * d_model parameters more).
PUBLISHED = {
    "gemma2_2b": 2_614_341_888, "gemma2_9b": 9_241_705_984, "gemma2_27b": 27_227_128_320,
    "gemma3_1b": 999_885_952, "gemma3_4b": 3_880_099_328, "gemma3_12b": 11_765_788_416,
    "gemma3_27b": 27_009_002_240,
}
HF_EXTRA_ROWS = {"gemma3_4b": 64, "gemma3_12b": 64, "gemma3_27b": 64}


def _preset(name):
    return (GEMMA2 if name.startswith("gemma2") else GEMMA3).presets[name]


SEQ = 40
TOKENS = np.random.default_rng(1).integers(0, 131, (2, SEQ))
# Measured: max |difference| about 2e-6 on logits of magnitude about 3 (float32).
PARITY_RTOL = PARITY_ATOL = 1e-5
FLOAT32 = dict(dtype="float32", param_dtype="float32")
_TINY = dict(vocab_size=131, hidden_size=60, num_attention_heads=6, num_key_value_heads=2, head_dim=10,
             intermediate_size=92, rms_norm_eps=1e-6, max_position_embeddings=64, sliding_window=7,
             query_pre_attn_scalar=12, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
TINY_HF = {
    "gemma2": dict(_TINY, model_type="gemma2", num_hidden_layers=3, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "gemma3_text": dict(_TINY, model_type="gemma3_text", num_hidden_layers=5,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 1
                        + ["sliding_attention", "sliding_attention"],
                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                            "rope_theta": 1_000_000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
}
HF_CONFIG_CLASS = {"gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig"}
EXPECTED = {
    "gemma2": preset_config("gemma2", "tiny_odd", attn_softcap=5.0, final_softcap=3.0),
    "gemma3_text": preset_config("gemma3", "tiny_odd", num_layers=5, layer_pattern="LLG", rope_global_scale=8.0),
}


def model_family(model_type: str) -> str:
    return "gemma2" if model_type == "gemma2" else "gemma3"


def perturb(model, seed: int = 0):
    """Every parameter random: matrices N(0, 1) / sqrt(fan_in), norm weights w = 0.1 N(0, 1).

    transformers starts Gemma's norm weights at zero, where a model that
    multiplied by w instead of (1 + w) would still agree; w near zero keeps the
    (1 + w) gains near one, so float32 rounding is not amplified layer by layer
    (with w near one, each of the four norms of a layer doubles the stream and
    the logits differ by up to 4e-5 from rounding alone).
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in model.named_parameters():   # a tied head is the embedding, visited once
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(0.1 * noise if param.ndim == 1 else noise / param.shape[-1] ** 0.5)
    return model


def perturbed_hf_model(transformers, config_cls: str, config: dict):
    hf_config = getattr(transformers, config_cls)(**config, attn_implementation="eager")
    return perturb(transformers.AutoModelForCausalLM.from_config(hf_config).eval())


@pytest.fixture(scope="module", params=["gemma2", "gemma3_text"])
def reference(request, transformers, tmp_path_factory):
    """(model_type, directory, transformers model, its logits): a tiny perturbed model saved with save_pretrained."""
    name = request.param
    model = perturbed_hf_model(transformers, HF_CONFIG_CLASS[name], TINY_HF[name])
    directory = tmp_path_factory.mktemp(f"{name}_tiny")
    model.save_pretrained(directory)
    return name, directory, model, hf_logits(model, TOKENS)


# --- sizes (no torch) -------------------------------------------------------------------

def test_gemma_is_a_registered_family():
    assert {"gemma2", "gemma3"} <= set(family_names())


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_parameter_counts_match_published(preset):
    cfg = _preset(preset)
    assert cfg.num_params() - HF_EXTRA_ROWS.get(preset, 0) * cfg.d_model == PUBLISHED[preset]


@pytest.mark.parametrize("preset", ["gemma2_2b", "gemma3_1b"])
def test_built_model_has_the_counted_parameters(preset):
    assert count_params(lambda: DecoderLM(_preset(preset), rngs=nnx.Rngs(0))) == _preset(preset).num_params()


def test_transformers_counts_the_same_parameters(transformers):
    for preset in PUBLISHED:
        family = GEMMA2 if preset.startswith("gemma2") else GEMMA3
        cfg = _preset(preset)
        assert transformers_param_count(transformers, family.hf.config_to_hf(cfg)) == cfg.num_params(), preset


def test_the_layer_patterns_are_the_published_ones():
    assert _preset("gemma2_9b").layer_kinds() == "LG" * 21
    assert _preset("gemma3_1b").layer_kinds() == "LLLLLG" * 4 + "LL"   # 26 layers: four periods and two more
    local, global_ = _preset("gemma3_12b").layer_settings()[0], _preset("gemma3_12b").layer_settings()[5]
    assert (local.sliding_window, local.rope_theta, local.rope_scale) == (1024, 10_000.0, 1.0)
    assert (global_.sliding_window, global_.rope_theta, global_.rope_scale) == (None, 1_000_000.0, 8.0)
    assert _preset("gemma3_1b").layer_settings()[5].rope_scale == 1.0     # no scaling below 4B
    spec = _preset("gemma2_2b").decoder_spec()
    assert spec.final_logit_softcap == 30.0 and spec.block.attn_softcap == 50.0
    assert spec.embed_scale == pytest.approx(48.0) and spec.tie_embeddings
    assert spec.block.query_scale == pytest.approx(256 ** -0.5)
    assert _preset("gemma2_27b").decoder_spec().block.query_scale == pytest.approx(144 ** -0.5)


# --- configs and errors (no torch) ------------------------------------------------------

GEMMA2_2B_HF = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
    "intermediate_size": 9216, "max_position_embeddings": 8192, "num_attention_heads": 8, "num_hidden_layers": 26,
    "num_key_value_heads": 4, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "sliding_window": 4096, "vocab_size": 256000, "torch_dtype": "float32",
}
# google/gemma-3-12b-pt as published (transformers 4.50 spelling), the keys that describe the text tower.
GEMMA3_12B_HF = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "mm_tokens_per_image": 256,
    "text_config": {"hidden_size": 3840, "intermediate_size": 15360, "model_type": "gemma3_text",
                    "num_attention_heads": 16, "num_hidden_layers": 48, "num_key_value_heads": 8,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152},
}
# google/gemma-3-4b-pt as published: its text_config leaves the heads (8, and 4 KV heads) to transformers'
# Gemma3TextConfig defaults, as it leaves the vocabulary.
GEMMA3_4B_HF = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "mm_tokens_per_image": 256,
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152},
}
GEMMA3_1B_HF = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attn_logit_softcapping": None,
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "intermediate_size": 6912, "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 26,
    "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "vocab_size": 262144,
}


@pytest.mark.parametrize("hf_config, preset", [(GEMMA2_2B_HF, "gemma2_2b"), (GEMMA3_1B_HF, "gemma3_1b"),
                                               (GEMMA3_4B_HF, "gemma3_4b"), (GEMMA3_12B_HF, "gemma3_12b")],
                         ids=["gemma-2-2b", "gemma-3-1b", "gemma-3-4b multimodal", "gemma-3-12b multimodal"])
def test_published_configs_map_to_the_presets(hf_config, preset):
    family, cfg = family_config_from_hf(hf_config)
    if preset in ("gemma3_4b", "gemma3_12b"):   # their text_config leaves the vocabulary to transformers' default
        assert cfg.vocab_size == 262_208
    assert cfg == _preset(preset)
    assert family.hf.config_from_hf(family.hf.config_to_hf(cfg)) == cfg


def test_layer_types_become_the_shortest_period():
    cfg = family_config_from_hf(dict(GEMMA3_1B_HF, num_hidden_layers=7,
                                     layer_types=["sliding_attention", "full_attention"] * 3
                                     + ["sliding_attention"]))[1]
    assert cfg.layer_pattern == "LG" and cfg.layer_kinds() == "LGLGLGL"
    odd = ["full_attention", "sliding_attention", "sliding_attention"]   # no period shorter than the depth
    assert family_config_from_hf(dict(GEMMA3_1B_HF, num_hidden_layers=3, layer_types=odd))[1].layer_pattern == "GLL"


@pytest.mark.parametrize("change, message", [
    (dict(layer_types=["sliding_attention"] * 25 + ["chunked_attention"]),
     "layer_types ['chunked_attention'], which spillway's Gemma 3 cannot express"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "lists 2 layer_types for 26 layers"),
    (dict(hidden_activation="gelu"), "hidden_activation 'gelu' is not supported"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention=True is not supported"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 8.0}), "rope_type 'yarn' on the full_attention layers"),
    (dict(sliding_window=65536), "its window (65536) is larger than max_seq_len (32768)"),
    # transformers 5 reads the older key as no scaling, transformers 4 as linear: the two differed by 2.7 logits
    (dict(rope_scaling={"type": "linear", "factor": 8.0}), 'older key "type" (\'linear\'), which transformers 5'),
    # a null window was read as the default 4096, and the refusal named a window the file does not hold
    (dict(sliding_window=None), "has sliding_attention layers but sliding_window=None"),
], ids=["unknown layer type", "layer count", "activation", "bidirectional", "yarn", "window beyond max",
        "older rope key", "null window"])
def test_hf_configs_spillway_cannot_express_are_one_line_errors(change, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        family_config_from_hf(dict(GEMMA3_1B_HF, **change))
    assert "\n" not in str(err.value)


def test_gemma3_reads_attn_logit_softcapping_as_transformers_computes_it_and_does_not_export_one():
    """transformers' Gemma 3 attention keeps the cap but never applies it: applied here, the logits were 0.67
    apart on a tiny model, and an export wrote a cap transformers then ignored."""
    assert family_config_from_hf(dict(GEMMA3_1B_HF, attn_logit_softcapping=3.0))[1].attn_softcap is None
    capped = preset_config("gemma3", "tiny", attn_softcap=3.0)
    with pytest.raises(ValueError, match=r"model.attn_softcap=3.0 has no Hugging Face gemma3_text config: "
                                         r"transformers' Gemma 3 does not apply attn_logit_softcapping"):
        GEMMA3.hf.config_to_hf(capped)


def test_a_query_scale_transformers_cannot_hold_has_no_config_json():
    """transformers types query_pre_attn_scalar as an int and refused the export's 12.5 at from_pretrained."""
    with pytest.raises(ValueError, match=r"model.query_pre_attn_scalar=12.5 is not a whole number"):
        GEMMA2.hf.config_to_hf(preset_config("gemma2", "tiny", query_pre_attn_scalar=12.5))
    assert GEMMA2.hf.config_to_hf(preset_config("gemma2", "tiny", query_pre_attn_scalar=12.0))[
        "query_pre_attn_scalar"] == 12


def test_a_multimodal_gemma3_is_tied_as_its_top_level_config_says():
    """save_pretrained of an untied Gemma3ForConditionalGeneration writes tie_word_embeddings false at the top
    and true in text_config; transformers builds it untied (the lm_head is the multimodal model's)."""
    untied = dict(GEMMA3_12B_HF, tie_word_embeddings=False,
                  text_config=dict(GEMMA3_12B_HF["text_config"], tie_word_embeddings=True))
    assert family_config_from_hf(untied)[1].tie_embeddings is False
    no_top = {k: v for k, v in untied.items() if k != "tie_word_embeddings"}
    assert family_config_from_hf(no_top)[1].tie_embeddings is True


def test_a_multimodal_checkpoint_without_a_text_config_says_only_the_text_tower_is_read():
    with pytest.raises(ValueError, match="reads only the text tower"):
        family_config_from_hf({"model_type": "gemma3", "vision_config": {}})


@pytest.mark.parametrize("make, message", [
    (lambda: preset_config("gemma3", "tiny", num_layers=4), "layer_pattern 'LLLLLG' has 6 layers, more than the model's 4"),
    (lambda: preset_config("gemma2", "tiny", layer_pattern="LXG"), "layer_pattern must be a non-empty string"),
    (lambda: preset_config("gemma2", "tiny", layer_pattern=""), "layer_pattern must be a non-empty string"),
    (lambda: preset_config("gemma2", "tiny", final_softcap=0.0), "Gemma2Config.final_softcap must be positive"),
    (lambda: preset_config("gemma2", "tiny", attn_softcap=-1.0), "Gemma2Config.attn_softcap must be positive"),
    (lambda: preset_config("gemma2", "tiny", sliding_window=512), "its window (512) is larger than max_seq_len (128)"),
    (lambda: GEMMA2.presets["tiny"].decoder_spec(Execution(attention_impl="cudnn")), "no logit soft-capping"),
    (lambda: GEMMA3.presets["tiny"].decoder_spec(Execution(attention_impl="cudnn")),
     "attention_impl='cudnn' takes one static window"),
], ids=["pattern longer than depth", "unknown kind", "empty", "final cap 0", "attention cap < 0",
        "window beyond max", "cudnn soft-cap", "cudnn pattern"])
def test_bad_gemma_configs_are_one_line_config_errors(make, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        make()
    assert "\n" not in str(err.value)


def test_a_window_beyond_the_sequence_is_fine_where_every_layer_is_global():
    cfg = preset_config("gemma2", "tiny", layer_pattern="G", sliding_window=512)   # the window is never used
    assert cfg.decoder_spec().layer_settings[0].sliding_window is None


# --- the model's own behaviour (no torch) -----------------------------------------------

def _tiny(family: str, **overrides):
    cfg = preset_config(family, "tiny_odd", **overrides)
    return DecoderLM(cfg, Execution(dtype="float32"), rngs=nnx.Rngs(0), remat="save_all")


def test_the_final_soft_cap_bounds_the_logits_and_the_chunked_loss_applies_it():
    from spillway.recipes.train.loss import chunked_cross_entropy, cross_entropy

    model = _tiny("gemma2", final_softcap=0.1)
    tokens = jnp.asarray(TOKENS)
    targets = jnp.roll(tokens, -1, axis=1)

    @jax.jit
    def losses(model):
        x = model.hidden_states(tokens, jnp.broadcast_to(jnp.arange(SEQ), tokens.shape))[0]
        raw, logits = model.embed.attend(x), model(tokens)
        logits_fn, head = model.split_head()
        return raw, logits, chunked_cross_entropy(logits_fn, head, x, targets, 8), cross_entropy(logits, targets)

    raw, logits, chunked, whole = losses(model)
    assert float(jnp.abs(raw).mean()) > 0.1          # the cap has work to do
    np.testing.assert_allclose(logits, 0.1 * jnp.tanh(raw / 0.1), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(chunked, whole, rtol=1e-6)
    assert abs(float(cross_entropy(raw, targets)) - float(chunked)) > 1e-3


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_cached_decoding_gives_the_full_forward_logits(family):
    """Generation's path (a KV cache, one token at a time) applies the per-layer windows and the soft-cap."""

    model = _tiny(family)
    tokens = jnp.asarray(TOKENS[:1, :24])
    full = forward(model, tokens)
    graphdef, state = nnx.split(model)
    decode = jax.jit(lambda state, tokens, cache, index: nnx.merge(graphdef, state)(tokens, cache=cache,
                                                                                    cache_index=index))
    logits, cache = decode(state, tokens[:, :10], model.init_cache(1, 24), jnp.int32(0))
    steps = [logits]
    for t in range(10, 24):   # one compile: the index is traced
        logits, cache = decode(state, tokens[:, t:t + 1], cache, jnp.int32(t))
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=2e-5, atol=2e-5)


def test_embeddings_are_scaled_in_the_compute_dtype():
    model = DecoderLM(preset_config("gemma2", "tiny_odd"), Execution(dtype="bfloat16"), rngs=nnx.Rngs(0))
    tokens = jnp.asarray(TOKENS[:1, :4])
    x = model.embed_tokens(tokens, jnp.arange(4)[None])
    normalizer = jnp.asarray(60 ** 0.5, jnp.bfloat16)   # transformers: the normalizer cast to the hidden dtype
    expected = model.embed(tokens) * normalizer
    assert x.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(expected, np.float32))


# --- parity with transformers -----------------------------------------------------------

def test_logits_match_transformers(reference):
    name, directory, _, expected = reference
    model = from_hf(directory, remat="save_all", **FLOAT32)   # config.json as this transformers writes it
    assert model.config == EXPECTED[name] and isinstance(model, DecoderLM)
    assert model.layers.layer_settings is not None           # the layers differ: values are scanned
    np.testing.assert_allclose(np.asarray(forward(model, TOKENS)), expected, rtol=PARITY_RTOL, atol=PARITY_ATOL)


# Each family with the features it has: Gemma 3 has no soft-caps, Gemma 2 no RoPE scaling.
@pytest.mark.parametrize("reference, change", [
    ("gemma2", "pattern"), ("gemma2", "softcap"), ("gemma2", "post_norm"),
    ("gemma3_text", "pattern"), ("gemma3_text", "rope_scale"), ("gemma3_text", "post_norm"),
], indirect=["reference"])
def test_what_makes_gemma_gemma_shows_in_the_logits(reference, change):
    """Each Gemma feature the parity covers moves the logits far when taken away."""
    import dataclasses

    name, directory, hf_model, expected = reference
    cfg = EXPECTED[name]
    state = numpy_state_dict(hf_model)
    if change == "pattern":
        cfg = dataclasses.replace(cfg, layer_pattern="G")               # every layer global
    elif change == "softcap":
        cfg = dataclasses.replace(cfg, attn_softcap=None, final_softcap=None)
    elif change == "rope_scale":
        cfg = dataclasses.replace(cfg, rope_global_scale=1.0)
    else:   # post_attention_layernorm is the post-norm on the attention output, never Llama's pre-MLP norm
        table = {w.hf_name: w.path for w in get_family(model_family(name)).hf.weights(cfg)}
        assert table["model.layers.{i}.post_attention_layernorm.weight"] == ("post_attn_norm", "scale")
        assert table["model.layers.{i}.pre_feedforward_layernorm.weight"] == ("mlp_norm", "scale")
        for key in [k for k in state if k.endswith("post_attention_layernorm.weight")]:
            state[key] = np.zeros_like(state[key])
    model = from_hf(state, config=cfg, remat="save_all", **FLOAT32)
    assert np.abs(np.asarray(forward(model, TOKENS)) - expected).max() > 100 * PARITY_ATOL


def test_export_round_trips_exactly_and_transformers_loads_it(transformers, reference, tmp_path):
    name, directory, hf_model, expected = reference
    model = from_hf(directory, remat="save_all", **FLOAT32)
    to_hf(model, tmp_path)
    again = from_hf(tmp_path, **FLOAT32)
    assert again.config == model.config
    exported = export_hf_state_dict(again)
    original = {k: v for k, v in numpy_state_dict(hf_model).items() if k != "lm_head.weight"}   # tied
    assert list(exported) == [k for k in original]    # transformers' order
    for key, array in exported.items():
        np.testing.assert_array_equal(array, original[key], err_msg=key)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(reloaded) is type(hf_model)
    assert reloaded.config.layer_types == hf_model.config.layer_types
    np.testing.assert_array_equal(hf_logits(reloaded, TOKENS), expected)


def _tiny_multimodal(transformers):
    """A perturbed Gemma3ForConditionalGeneration whose text tower is the tiny Gemma 3 above."""
    text = {k: v for k, v in TINY_HF["gemma3_text"].items() if k != "model_type"}
    config = transformers.Gemma3Config(
        text_config=text, vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4, attn_implementation="eager")
    return perturb(transformers.Gemma3ForConditionalGeneration(config).eval())


def test_the_text_tower_of_a_multimodal_gemma3_checkpoint_is_read(transformers, tmp_path):
    model = _tiny_multimodal(transformers)
    model.save_pretrained(tmp_path)
    expected = hf_logits(model, TOKENS)   # text only: no image tokens
    ours = from_hf(tmp_path, remat="save_all", **FLOAT32)
    assert ours.config == EXPECTED["gemma3_text"]
    np.testing.assert_allclose(np.asarray(forward(ours, TOKENS)), expected, rtol=PARITY_RTOL, atol=PARITY_ATOL)
    # The layout Google published (language_model.model.*, vision_tower.*), from an in-memory state dict.
    state = {re.sub(r"^model\.language_model\.", "language_model.model.", re.sub(r"^model\.(vision_tower|multi_modal_projector)", r"\1", k)): v
             for k, v in numpy_state_dict(model).items() if k != "lm_head.weight"}
    assert any(k.startswith("vision_tower.") for k in state)
    old = from_hf(state, config=model.config.to_dict(), remat="save_all", **FLOAT32)
    np.testing.assert_allclose(np.asarray(forward(old, TOKENS)), expected, rtol=PARITY_RTOL, atol=PARITY_ATOL)


# --- offload (no torch) -----------------------------------------------------------------
# float32 rounding of the recomputed forward: measured at most 2.3e-6 of a gradient's largest element
# (Gemma 3, the two-segment plan), so each gradient is compared within 1e-5 of its largest element.
OFFLOAD_TOKENS = np.random.default_rng(3).integers(0, 131, (2, 33))   # 32 positions through a window of 7


def _check_plans(model_cls, cfg, plans):
    from no_remat_reference import NoRematReference

    reference = NoRematReference(model_cls, cfg, OFFLOAD_TOKENS)
    largest = max(float(np.abs(g).max()) for g in jax.tree.leaves(reference.grads))
    for plan in plans:
        reference.check(plan, rtol=1e-5, atol=1e-5 * largest)


def test_a_segmented_offload_plan_matches_no_remat_across_the_layer_pattern():
    """Segment boundaries inside the pattern (after layers 1 and 2 of "LLLLLG"): the values are sliced with
    the weights."""
    _check_plans(DecoderLM, preset_config("gemma3", "tiny_odd"), ["offload_dots:1,save_dots:1,recompute_all"])


@pytest.mark.slow  # in `make test-slow` (CI runs it): minutes on 2 cores
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_every_offload_plan_gives_the_no_remat_loss_and_gradients(family):
    from no_remat_reference import PLANS

    cfg = preset_config("gemma2", "tiny_odd") if family == "gemma2" else preset_config("gemma3", "tiny_odd")
    _check_plans(DecoderLM, cfg, PLANS)
