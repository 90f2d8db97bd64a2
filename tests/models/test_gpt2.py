"""The GPT-2 family: published parameter counts, Hugging Face import and export against transformers,
every offload preset against no remat, and KV-cache generation with learned positions.

Parity: a tiny random `transformers.GPT2LMHeadModel` with odd sizes (n_embd 60,
5 heads of 12, n_inner 92, 3 layers, vocabulary 131, 48 positions), every
parameter perturbed (transformers initialises LayerNorms to ones and zeros and
biases to zeros, which would hide a swapped scale/bias or a missing bias),
saved with `save_pretrained`, gives the same float32 logits as the spillway
GPT-2 that imports it; what spillway exports loads back into transformers with
the same logits.

The config, checkpoint-error and round-trip tests use numpy weights only; the
parity tests skip when torch or transformers is missing (`pip install -e '.[dev]'`).
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from no_remat_reference import PLANS, NoRematReference, plan_params
from spillway.layers import names
from spillway.layers.sharding import create_sharded
from spillway.models.decoder import DecoderLM, count_params
from spillway.models.gpt2 import FAMILY, PRESETS, config_from_hf
from spillway.models.hf import HFCheckpointError, export_hf_state_dict, family_config_from_hf, from_hf, to_hf
from spillway.models.registry import preset_config
from spillway.recipes.sampling import generate

# Parameter counts of transformers' GPT2LMHeadModel at the published sizes, the tied head counted once
# (test_published_counts_are_what_transformers_builds checks them against transformers itself).
PUBLISHED = {
    "gpt2_124m": 124_439_808,      # gpt2
    "gpt2_355m": 354_823_168,      # gpt2-medium
    "gpt2_774m": 774_030_080,      # gpt2-large
    "gpt2_1_5b": 1_557_611_200,    # gpt2-xl
}
HF_SIZES = {"gpt2_124m": (768, 12, 12), "gpt2_355m": (1024, 24, 16), "gpt2_774m": (1280, 36, 20),
            "gpt2_1_5b": (1600, 48, 25)}   # (n_embd, n_layer, n_head)

VOCAB, HIDDEN, LAYERS, HEADS, HEAD_DIM, INNER, POSITIONS = 131, 60, 3, 5, 12, 92, 48
SEQ = 40
# Measured: max |difference| about 2e-6 on logits of magnitude about 3.
PARITY_RTOL = PARITY_ATOL = 1e-5
FLOAT32 = dict(dtype="float32", param_dtype="float32")
TOKENS = np.random.default_rng(1).integers(0, VOCAB, (2, SEQ))

# Jitted with the model as an argument: models with the same config share one compile.
forward = jax.jit(lambda model, tokens_bt: model(tokens_bt))


def hf_config(**changes) -> dict:
    """A config.json of the tiny odd GPT-2, as transformers writes one."""
    return dict(dict(model_type="gpt2", vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                     n_inner=INNER, n_positions=POSITIONS, layer_norm_epsilon=1e-5, activation_function="gelu_new",
                     tie_word_embeddings=True), **changes)


def hf_shapes(num_layers=LAYERS) -> dict[str, tuple[int, ...]]:
    """HF names and shapes in transformers' order, written out apart from the importer (Conv1D is [in, out])."""
    shapes = {"transformer.wte.weight": (VOCAB, HIDDEN), "transformer.wpe.weight": (POSITIONS, HIDDEN)}
    for i in range(num_layers):
        p = f"transformer.h.{i}."
        shapes.update({
            p + "ln_1.weight": (HIDDEN,), p + "ln_1.bias": (HIDDEN,),
            p + "attn.c_attn.weight": (HIDDEN, 3 * HIDDEN), p + "attn.c_attn.bias": (3 * HIDDEN,),
            p + "attn.c_proj.weight": (HIDDEN, HIDDEN), p + "attn.c_proj.bias": (HIDDEN,),
            p + "ln_2.weight": (HIDDEN,), p + "ln_2.bias": (HIDDEN,),
            p + "mlp.c_fc.weight": (HIDDEN, INNER), p + "mlp.c_fc.bias": (INNER,),
            p + "mlp.c_proj.weight": (INNER, HIDDEN), p + "mlp.c_proj.bias": (HIDDEN,),
        })
    shapes.update({"transformer.ln_f.weight": (HIDDEN,), "transformer.ln_f.bias": (HIDDEN,)})
    return shapes


def perturbed(name: str, noise: np.ndarray) -> np.ndarray:
    """Norm scales near 1, biases near 0, matrices at unit output scale: every mistake shows in the logits."""
    if name.endswith(".bias"):
        return 0.1 * noise
    if noise.ndim == 1:
        return 1.0 + 0.1 * noise
    return noise / np.sqrt(noise.shape[0])


def random_state_dict(seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: perturbed(name, rng.standard_normal(shape)).astype(np.float32)
            for name, shape in hf_shapes().items()}


# --- sizes (no torch) ------------------------------------------------------------------

@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_parameter_counts_match_published(preset):
    cfg = PRESETS[preset]
    assert cfg.num_params() == PUBLISHED[preset]
    assert count_params(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0))) == PUBLISHED[preset]  # the built (abstract) model


def test_forward_shapes_odd_sizes():
    cfg = preset_config("gpt2", "tiny_odd")
    model = create_sharded(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)))
    assert model.positions.table.shape == (POSITIONS, HIDDEN) and model.head is None
    assert model.layers.blocks.mlp.w_up.shape == (LAYERS, HIDDEN, INNER)
    logits = model(jnp.zeros((3, 7), jnp.int32))
    assert logits.shape == (3, 7, VOCAB)
    assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize("field,value,message", [
    ("num_heads", 7, r"num_heads \(7\) does not divide d_model \(60\)"),
    ("mlp_hidden", 0, r"mlp_hidden must be positive \(or None for 4 \* d_model\)"),
    ("vocab_size", 0, "vocab_size must be positive"),
    ("max_seq_len", 0, "max_seq_len must be positive"),
])
def test_config_errors_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        preset_config("gpt2", "tiny_odd", **{field: value})


def test_unknown_preset_is_named():
    with pytest.raises(ValueError, match="unknown gpt2 preset 'gpt3'"):
        preset_config("gpt2", "gpt3")


# --- config mapping (no torch) -----------------------------------------------------------

GPT2_124M_HF = {  # the published config.json of openai-community/gpt2
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
    "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12,
    "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": None, "summary_first_dropout": 0.1,
    "summary_proj_to_labels": True, "summary_type": "cls_index", "summary_use_proj": True,
    "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}}, "vocab_size": 50257,
}


def test_published_config_maps_to_the_preset():
    assert family_config_from_hf(GPT2_124M_HF)[1] == preset_config("gpt2", "gpt2_124m")
    xl = dict(GPT2_124M_HF, n_embd=1600, n_head=25, n_layer=48, n_inner=4 * 1600)  # explicit 4 * d is the default
    assert config_from_hf(xl) == preset_config("gpt2", "gpt2_1_5b")


def test_config_round_trips():
    cfg = config_from_hf(hf_config())
    assert cfg == preset_config("gpt2", "tiny_odd")
    assert config_from_hf(FAMILY.hf.config_to_hf(cfg)) == cfg
    assert FAMILY.hf.config_to_hf(preset_config("gpt2", "gpt2_355m"))["n_inner"] is None   # transformers reads None as 4 * n_embd


@pytest.mark.parametrize("change, message", [
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True is not supported"),
    ({"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn=True is not supported"),
    ({"add_cross_attention": True}, "add_cross_attention=True is not supported"),
    ({"scale_attn_weights": False}, "scale_attn_weights=False is not supported"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings=False is not supported"),
    ({"activation_function": "gelu"}, "activation_function 'gelu' is not supported"),
    ({"activation_function": "relu"}, "activation_function 'relu' is not supported"),
    ({"n_head": None}, "lacks ['n_head']"),
    ({"n_embd": "768"}, "GPT-2 config's n_embd='768' is not a number"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_unsupported_configs_fail_by_name(change, message):
    """Through the dispatch on model_type, as from_hf reads a config.json."""
    with pytest.raises(HFCheckpointError, match=re.escape(message)):
        family_config_from_hf(dict(GPT2_124M_HF, **change))


def test_pytorch_tanh_gelu_is_the_same_model():
    assert config_from_hf(hf_config(activation_function="gelu_pytorch_tanh")) == preset_config("gpt2", "tiny_odd")


# --- checkpoint checks and round trip (no torch) ----------------------------------------

def test_export_inverts_import_bit_exactly():
    state_dict = random_state_dict()
    model = from_hf(state_dict, config=hf_config(), **FLOAT32)
    exported = export_hf_state_dict(model)
    assert list(exported) == list(hf_shapes())  # transformers' order, no lm_head (tied)
    for name, array in state_dict.items():
        np.testing.assert_array_equal(exported[name], array, err_msg=name)
    # The fused c_attn is split q | k | v along its output axis, heads in order within each part.
    c_attn = state_dict["transformer.h.1.attn.c_attn.weight"]
    wk = np.asarray(model.layers.blocks.attn.wk[...])[1]
    np.testing.assert_array_equal(wk[:, 2, :], c_attn[:, HIDDEN + 2 * HEAD_DIM:HIDDEN + 3 * HEAD_DIM])


def test_saved_directory_round_trips(tmp_path):
    model = from_hf(random_state_dict(), config=hf_config(), **FLOAT32)
    to_hf(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gpt2"
    loaded = from_hf(tmp_path, **FLOAT32)
    assert loaded.config == model.config
    for name, array in export_hf_state_dict(model).items():
        np.testing.assert_array_equal(export_hf_state_dict(loaded)[name], array, err_msg=name)


def test_base_model_names_and_mask_buffers_are_read():
    """The published files: saved from GPT2Model (no `transformer.` prefix), with causal-mask buffers."""
    state_dict = random_state_dict()
    base = {name.removeprefix("transformer."): array for name, array in state_dict.items()}
    for i in range(LAYERS):
        base[f"h.{i}.attn.bias"] = np.tril(np.ones((POSITIONS, POSITIONS), np.float32))[None, None]
        base[f"h.{i}.attn.masked_bias"] = np.asarray(-1e4, np.float32)
    exported = export_hf_state_dict(from_hf(base, config=hf_config(), **FLOAT32))
    for name, array in state_dict.items():
        np.testing.assert_array_equal(exported[name], array, err_msg=name)


def test_tied_checkpoint_may_list_the_head_only_as_the_embedding():
    state_dict = random_state_dict()
    wte = state_dict["transformer.wte.weight"]
    from_hf(dict(state_dict, **{"lm_head.weight": wte}), config=hf_config())
    with pytest.raises(HFCheckpointError, match="lm_head.weight differs from transformer.wte.weight"):
        from_hf(dict(state_dict, **{"lm_head.weight": wte + 1}), config=hf_config())


def test_checkpoint_errors_name_the_tensors():
    state_dict = random_state_dict()
    del state_dict["transformer.h.1.mlp.c_fc.weight"]
    state_dict["transformer.h.0.attn.q_proj.weight"] = np.zeros((HIDDEN, HIDDEN), np.float32)
    state_dict["transformer.h.2.attn.c_attn.weight"] = np.zeros((HIDDEN, 2 * HIDDEN), np.float32)
    with pytest.raises(HFCheckpointError) as err:
        from_hf(state_dict, config=hf_config())
    message = str(err.value)
    assert "missing tensors (1): ['transformer.h.1.mlp.c_fc.weight']" in message
    assert "unexpected tensors (1): ['transformer.h.0.attn.q_proj.weight']" in message
    assert "transformer.h.2.attn.c_attn.weight: checkpoint (60, 120), config expects (60, 180)" in message
    with pytest.raises(HFCheckpointError, match=re.escape("missing tensors (12)")):  # 4-layer config, 3-layer file
        from_hf(random_state_dict(), config=hf_config(n_layer=4))
    with pytest.raises(HFCheckpointError, match=re.escape("transformer.wpe.weight: checkpoint (48, 60), config "
                                                          "expects (64, 60)")):
        from_hf(random_state_dict(), config=hf_config(n_positions=64))


# --- every offload preset gives the no-remat loss and gradients (no torch) ------------------

@pytest.fixture(scope="module")
def no_remat():
    return NoRematReference(DecoderLM, preset_config("gpt2", "tiny_odd"), np.random.default_rng(2).integers(0, VOCAB, (2, 19)))


def test_the_block_tags_every_name_so_every_preset_applies():
    model = nnx.eval_shape(lambda: DecoderLM(preset_config("gpt2", "tiny_odd"), rngs=nnx.Rngs(0)))
    assert model.layers.block_names == frozenset(names.ACTIVATION_NAMES)


@pytest.mark.parametrize("remat", plan_params([plan for plan in PLANS if plan != "save_all"]))
def test_every_offload_plan_matches_no_remat(remat, no_remat):
    no_remat.check(remat)


def test_every_parameter_receives_a_gradient(no_remat):
    # The position table and every bias included: a part the loss cannot see would pass the plan checks.
    assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(no_remat.grads))


# --- KV-cache generation with learned positions (no torch) ------------------------------------

def test_greedy_generation_with_the_cache_equals_argmax_of_the_full_forward():
    """Up to the last learned position: the cache must index the position table as the full forward does."""
    model = from_hf(random_state_dict(), config=hf_config(), remat="offload_dots:1,save_all", **FLOAT32)
    prompt = [int(t) for t in TOKENS[0, :7]]
    new_tokens = POSITIONS - len(prompt)
    generated = generate(model, prompt, max_new_tokens=new_tokens, temperature=0.0)
    assert len(generated) == new_tokens
    sequence = np.asarray([prompt + generated], np.int32)
    # One full forward over the whole sequence: each generated token is the argmax after its prefix
    # (causal attention makes position t's logits depend only on tokens up to t).
    expected = np.argmax(np.asarray(forward(model, sequence[:, :-1]))[0, len(prompt) - 1:], axis=-1)
    np.testing.assert_array_equal(generated, expected)
    assert len(set(generated)) > 3  # not a degenerate repetition that any position mix-up would also produce
    with pytest.raises(ValueError, match=r"exceeds the model's max_seq_len \(48\)"):
        generate(model, prompt, max_new_tokens=new_tokens + 1, temperature=0.0)
    with pytest.raises(ValueError, match="exceeds the model's 48 learned positions"):
        model.init_cache(1, POSITIONS + 1)


# --- parity with transformers ---------------------------------------------------------------

@pytest.fixture(scope="module")
def hf(transformers):
    import torch
    return torch, transformers


def test_published_counts_are_what_transformers_builds(hf):
    torch, transformers = hf
    for preset, (n_embd, n_layer, n_head) in HF_SIZES.items():
        with torch.device("meta"):  # shapes only, nothing allocated
            model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=n_embd, n_layer=n_layer,
                                                                         n_head=n_head))
        unique = {id(p): p.numel() for p in model.parameters()}  # the tied head is the embedding
        assert sum(unique.values()) == PUBLISHED[preset], preset


def hf_model(hf, model_cls="GPT2LMHeadModel", seed=0):
    """A float32 transformers GPT-2 in eval mode with every parameter perturbed (see `perturbed`)."""
    torch, transformers = hf
    config = transformers.GPT2Config(**{k: v for k, v in hf_config().items() if k != "model_type"})
    model = getattr(transformers, model_cls)(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied head is the embedding, visited once
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float64).numpy()
            param.copy_(torch.from_numpy(perturbed(name, noise).astype(np.float32)))
    return model


def hf_logits(hf, model) -> np.ndarray:
    torch, _ = hf
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS)).logits.numpy()


def test_logits_match_transformers_from_save_pretrained(hf, tmp_path):
    reference = hf_model(hf)
    reference.save_pretrained(tmp_path)
    model = from_hf(tmp_path, remat="save_all", **FLOAT32)
    assert model.config == preset_config("gpt2", "tiny_odd")
    expected = hf_logits(hf, reference)
    np.testing.assert_allclose(np.asarray(forward(model, TOKENS)), expected, rtol=PARITY_RTOL, atol=PARITY_ATOL)
    # The comparison can see the learned positions: without them the logits are far off.
    no_positions = nnx.clone(model)
    no_positions.positions.table[...] = jnp.zeros_like(no_positions.positions.table[...])
    assert np.abs(np.asarray(forward(no_positions, TOKENS)) - expected).max() > 100 * PARITY_ATOL


def test_base_model_directory_loads_with_the_same_weights(hf, tmp_path):
    """GPT2Model.save_pretrained writes names without `transformer.`, as the published checkpoints have them."""
    reference = hf_model(hf, "GPT2Model")
    reference.save_pretrained(tmp_path)
    model = from_hf(tmp_path, **FLOAT32)
    exported = export_hf_state_dict(model)
    for name, tensor in reference.state_dict().items():
        np.testing.assert_array_equal(exported["transformer." + name], tensor.numpy(), err_msg=name)


def test_exported_model_loads_in_transformers(hf, tmp_path):
    _, transformers = hf
    reference = hf_model(hf)
    state_dict = {name: t.detach().numpy() for name, t in reference.state_dict().items()}
    model = from_hf(state_dict, config=hf_config(), remat="offload_dots:1,recompute_all", **FLOAT32)
    to_hf(model, tmp_path)
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    np.testing.assert_array_equal(hf_logits(hf, reloaded), hf_logits(hf, reference))
    np.testing.assert_allclose(np.asarray(forward(model, TOKENS)), hf_logits(hf, reloaded),
                               rtol=PARITY_RTOL, atol=PARITY_ATOL)
