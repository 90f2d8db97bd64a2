"""Hugging Face Llama import and export (models/hf.py with models/llama.py's table), and KV-cache decoding.

Parity: a tiny random `transformers.LlamaForCausalLM` with odd sizes (hidden 60,
6 heads over 2 KV heads, head_dim 10, intermediate 92, 3 layers, vocabulary
131), with and without Llama 3 RoPE scaling, tied and untied, gives the same
float32 logits as the spillway Llama that imports its weights, from an
in-memory state dict and from `save_pretrained` directories (one file and
sharded). What spillway exports loads back into transformers unchanged.

The config, error and round-trip tests use numpy weights only; the parity tests
skip when torch or transformers is missing (`pip install -e '.[dev]'`; only the Python 3.11
environment has them, see the Makefile).
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from spillway.layers.rope import RopeScaling
from spillway.layers.mesh import MeshConfig
from spillway.layers.sharding import make_mesh
from spillway.models.hf import export_hf_state_dict, family_config_from_hf, from_hf, to_hf
from spillway.models.llama import config_from_hf as llama_config_from_hf
from spillway.models.llama import FAMILY as LLAMA
from spillway.models.registry import preset_config

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 131, 60, 3, 6, 2, 10, 92
SEQ = 40
# With theta 1e4 and head_dim 10 the RoPE wavelengths are 6.3, 40, 251, ... positions.
# An original context of 16 puts the first in llama3's interpolated band and the
# rest in its slowed band, so 40 positions are enough for the scaling to matter.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
# Measured: max |difference| is about 5e-6 on logits of magnitude about 4.
PARITY_RTOL = PARITY_ATOL = 1e-5
FLOAT32 = dict(dtype="float32", param_dtype="float32")

# Jitted with the model as an argument: models with the same config share one compile.
forward = jax.jit(lambda model, tokens_bt: model(tokens_bt))
decode = jax.jit(lambda model, tokens_bt, cache, index: model(tokens_bt, cache=cache, cache_index=index))


def hf_config(*, rope_scaling=None, tie=False) -> dict:
    """A HF Llama config dict in the transformers < 5 spelling (rope_theta / rope_scaling)."""
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, intermediate_size=INTERMEDIATE, head_dim=HEAD_DIM,
                rope_theta=10000.0, rope_scaling=rope_scaling, rms_norm_eps=1e-5, tie_word_embeddings=tie,
                max_position_embeddings=64, hidden_act="silu", attention_bias=False, model_type="llama")


def hf_shapes(num_layers=LAYERS, tie=False) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of the tiny model in transformers' order, written out apart from the importer."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, HIDDEN), p + "self_attn.k_proj.weight": (kv, HIDDEN),
            p + "self_attn.v_proj.weight": (kv, HIDDEN), p + "self_attn.o_proj.weight": (HIDDEN, q),
            p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN), p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
            p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
        })
    shapes["model.norm.weight"] = (HIDDEN,)
    if not tie:
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return shapes


def random_state_dict(seed=0, tie=False) -> dict[str, np.ndarray]:
    """Unit-scale weights (norm scales near 1): a wrong transpose, head split or norm shows in the logits."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in hf_shapes(tie=tie).items():
        if len(shape) == 1:
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    return out


TOKENS = np.random.default_rng(1).integers(0, VOCAB, (2, SEQ))


# --- config mapping (no torch) ---------------------------------------------------

LLAMA31_8B_HF = {  # the published config.json of Llama 3.1 8B, transformers 4 spelling
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
    "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "max_position_embeddings": 131072, "attention_bias": False, "mlp_bias": False,
    "torch_dtype": "bfloat16",
}


def test_published_llama31_config_maps_to_the_preset():
    assert llama_config_from_hf(LLAMA31_8B_HF) == preset_config("llama", "llama3_1_8b")


def test_transformers5_and_legacy_rope_spellings_agree():
    v5 = {k: v for k, v in LLAMA31_8B_HF.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = dict(LLAMA31_8B_HF["rope_scaling"], rope_theta=500000.0)
    legacy = dict(LLAMA31_8B_HF, rope_scaling={k if k != "rope_type" else "type": v
                                               for k, v in LLAMA31_8B_HF["rope_scaling"].items()})
    assert llama_config_from_hf(v5) == llama_config_from_hf(legacy) == preset_config("llama", "llama3_1_8b")
    default_rope = dict(v5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg = llama_config_from_hf(default_rope)
    assert cfg.rope_scaling is None and cfg.rope_theta == 10000.0


def test_config_round_trips_and_defaults():
    cfg = llama_config_from_hf(hf_config(rope_scaling=LLAMA3_ROPE, tie=True))
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 16) and cfg.tie_embeddings
    assert llama_config_from_hf(LLAMA.hf.config_to_hf(cfg)) == cfg
    sparse = {k: LLAMA31_8B_HF[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                            "num_attention_heads", "intermediate_size")}
    cfg = llama_config_from_hf(sparse)  # transformers' LlamaConfig defaults fill the rest
    assert (cfg.num_kv_heads, cfg.norm_eps, cfg.rope_theta, cfg.max_seq_len) == (32, 1e-6, 10000.0, 2048)


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_type 'yarn'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "unsupported rope_type 'linear'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks ['low_freq_factor'"),
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"model_type": "falcon"}, "model_type 'falcon' is not supported"),
    ({"model_type": None}, "has no model_type"),
    ({"vocab_size": None}, "lacks ['vocab_size']"),
    ({"hidden_size": "4096"}, "Llama config's hidden_size='4096' is not a number"),   # was a TypeError
    ({"num_hidden_layers": True, "vocab_size": [1]}, "vocab_size=[1], num_hidden_layers=True are not a number"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_unsupported_configs_fail_by_name(change, message):
    """Through the dispatch on model_type, as from_hf reads a config.json."""
    with pytest.raises(ValueError, match=re.escape(message)):
        family_config_from_hf(dict(LLAMA31_8B_HF, **change))


# --- checkpoint checks and round trip (no torch) ----------------------------------

@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_export_inverts_import(tie):
    state_dict = random_state_dict(tie=tie)
    model = from_hf(state_dict, config=hf_config(rope_scaling=LLAMA3_ROPE, tie=tie), **FLOAT32)
    exported = export_hf_state_dict(model)
    assert list(exported) == list(hf_shapes(tie=tie))  # transformers' order, no lm_head when tied
    for name, array in state_dict.items():
        np.testing.assert_array_equal(exported[name], array, err_msg=name)


def test_a_transformers_config_object_is_read_as_its_dict():
    """from_hf's docstring takes one; transformers 5's config classes are dataclasses, which read as a
    spillway family config: 'LlamaConfig is no registered family's config'."""
    transformers = pytest.importorskip("transformers")
    state_dict = random_state_dict()
    config = transformers.LlamaConfig(**hf_config())
    model = from_hf(state_dict, config=config, **FLOAT32)
    expected = from_hf(state_dict, config=hf_config(), **FLOAT32)
    tokens = jnp.arange(12, dtype=jnp.int32)[None]
    np.testing.assert_array_equal(np.asarray(forward(model, tokens)), np.asarray(forward(expected, tokens)))


def test_tied_checkpoint_may_list_the_head_only_as_the_embedding():
    state_dict = random_state_dict(tie=True)
    config = hf_config(tie=True)
    # transformers' state_dict() lists a tied head under its own name: accepted when it is the embedding.
    from_hf(dict(state_dict, **{"lm_head.weight": state_dict["model.embed_tokens.weight"]}), config=config)
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        from_hf(dict(state_dict, **{"lm_head.weight": np.zeros((VOCAB, HIDDEN), np.float32)}), config=config)


def test_checkpoint_errors_name_the_tensors():
    config = hf_config()
    state_dict = random_state_dict()
    del state_dict["model.layers.1.mlp.up_proj.weight"]
    state_dict["model.layers.0.self_attn.q_proj.bias"] = np.zeros(HEADS * HEAD_DIM, np.float32)
    state_dict["model.layers.2.self_attn.k_proj.weight"] = np.zeros((HEAD_DIM, HIDDEN), np.float32)
    state_dict["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros(HEAD_DIM // 2, np.float32)  # ignored
    with pytest.raises(ValueError) as err:
        from_hf(state_dict, config=config)
    message = str(err.value)
    assert "missing tensors (1): ['model.layers.1.mlp.up_proj.weight']" in message
    assert "unexpected tensors (1): ['model.layers.0.self_attn.q_proj.bias']" in message
    assert "model.layers.2.self_attn.k_proj.weight: checkpoint (10, 60), config expects (20, 60)" in message
    with pytest.raises(ValueError, match=re.escape("missing tensors (9)")):  # a 4-layer config, 3-layer checkpoint
        from_hf(random_state_dict(), config=dict(config, num_hidden_layers=4))
    with pytest.raises(ValueError, match="needs config="):
        from_hf(random_state_dict())


def test_saved_directory_loads_back_in_bfloat16(tmp_path):
    model = from_hf(random_state_dict(), config=hf_config(rope_scaling=LLAMA3_ROPE), **FLOAT32)
    to_hf(model, tmp_path, dtype="bfloat16")
    loaded = from_hf(tmp_path, **FLOAT32)  # config from config.json; bf16 tensors via ml_dtypes
    assert loaded.config == model.config
    exported = export_hf_state_dict(loaded)
    for name, array in export_hf_state_dict(model).items():
        np.testing.assert_array_equal(exported[name], array.astype(jnp.bfloat16).astype(np.float32), err_msg=name)


def test_load_onto_a_mesh_shards_the_parameters():
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))  # 8 CPU devices (tests/conftest.py)
    model = from_hf(random_state_dict(), config=hf_config(), mesh=mesh, **FLOAT32)
    assert model.layers.blocks.attn.wq[...].sharding.spec == PartitionSpec(None, "fsdp", "tensor", None)
    np.testing.assert_array_equal(np.asarray(model.layers.blocks.attn.wq[...])[1, :, :, 0],
                                  random_state_dict()["model.layers.1.self_attn.q_proj.weight"].T[:, ::HEAD_DIM])


# --- parity with transformers ------------------------------------------------------

@pytest.fixture(scope="module")
def hf(transformers):
    # tests/models/conftest.py's fixture skips, saying why, where the parity extra is missing.
    import torch
    return torch, transformers


def hf_model(hf, config: dict, seed=0):
    """A float32 LlamaForCausalLM in eval mode with unit-scale random weights (see random_state_dict)."""
    torch, transformers = hf
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, attn_implementation="eager")).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():  # a tied head is the embedding, visited once
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if param.ndim == 1 else noise / param.shape[-1] ** 0.5)
    return model


def hf_logits(hf, model) -> np.ndarray:
    torch, _ = hf
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS)).logits.numpy()


def numpy_state_dict(model) -> dict[str, np.ndarray]:
    return {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}


def assert_parity(ours, theirs):
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=PARITY_RTOL, atol=PARITY_ATOL)


@pytest.mark.parametrize("rope_scaling, tie, remat", [
    (LLAMA3_ROPE, False, "save_all"),
    (None, True, "save_all"),
    (LLAMA3_ROPE, True, "offload_dots"),
    (None, False, "offload_dots:1,save_all"),
], ids=["llama3_rope-untied-save_all", "default_rope-tied-save_all", "llama3_rope-tied-offload_dots",
        "default_rope-untied-offload_dots:1,save_all"])
def test_logits_match_transformers(hf, rope_scaling, tie, remat):
    config = hf_config(rope_scaling=rope_scaling, tie=tie)
    reference = hf_model(hf, config)
    expected = hf_logits(hf, reference)
    model = from_hf(numpy_state_dict(reference), config=config, remat=remat, **FLOAT32)
    assert_parity(forward(model, TOKENS), expected)
    if rope_scaling is not None and remat == "save_all":
        # The comparison must be able to see the scaling: without it the logits are far off.
        unscaled = from_hf(numpy_state_dict(reference), config=dict(config, rope_scaling=None),
                                 remat=remat, **FLOAT32)
        assert np.abs(np.asarray(forward(unscaled, TOKENS)) - expected).max() > 100 * PARITY_ATOL


@pytest.mark.parametrize("max_shard_size", [None, "20KB"], ids=["one_file", "sharded"])
def test_logits_match_from_save_pretrained_directory(hf, tmp_path, max_shard_size):
    reference = hf_model(hf, hf_config(rope_scaling=LLAMA3_ROPE))
    sharding = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    reference.save_pretrained(tmp_path, safe_serialization=True, **sharding)
    assert (tmp_path / "model.safetensors.index.json").exists() == (max_shard_size is not None)
    model = from_hf(tmp_path, remat="save_all", **FLOAT32)  # config.json as this transformers writes it
    assert model.config == llama_config_from_hf(hf_config(rope_scaling=LLAMA3_ROPE))
    assert_parity(forward(model, TOKENS), hf_logits(hf, reference))


def test_exported_model_loads_in_transformers(hf, tmp_path):
    _, transformers = hf
    config = hf_config(rope_scaling=LLAMA3_ROPE, tie=True)
    reference = hf_model(hf, config)
    model = from_hf(numpy_state_dict(reference), config=config, remat="save_all", **FLOAT32)
    to_hf(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    np.testing.assert_array_equal(hf_logits(hf, reloaded), hf_logits(hf, reference))


# --- KV-cache decoding (no torch) ---------------------------------------------------

def test_cached_greedy_decode_matches_full_recompute():
    """Greedy continuation: logits from prefill + one-token cached steps equal a full forward each step.

    Two remat segments (offload, then none) so the per-segment caches are split and rejoined.
    """
    prompt_len, new_tokens = 5, 3
    model = from_hf(random_state_dict(), config=hf_config(rope_scaling=LLAMA3_ROPE),
                          remat="offload_dots:1,save_all", **FLOAT32)
    prompt = jnp.asarray(TOKENS[:, :prompt_len], jnp.int32)
    cache = model.init_cache(batch=2, max_len=prompt_len + new_tokens)
    step_logits, cache = decode(model, prompt, cache, jnp.int32(0))  # prefill
    sequence = prompt
    for step in range(new_tokens + 1):
        full_logits = forward(model, sequence)[:, -1]
        np.testing.assert_allclose(step_logits[:, -1], full_logits, rtol=1e-5, atol=1e-5,
                                   err_msg=f"step {step} (position {sequence.shape[1] - 1})")
        if step == new_tokens:
            break
        next_token = jnp.argmax(full_logits, axis=-1)[:, None].astype(jnp.int32)
        sequence = jnp.concatenate([sequence, next_token], axis=1)
        step_logits, cache = decode(model, next_token, cache, jnp.int32(sequence.shape[1] - 1))
    assert cache["k"].shape == (LAYERS, 2, prompt_len + new_tokens, KV_HEADS, HEAD_DIM)
