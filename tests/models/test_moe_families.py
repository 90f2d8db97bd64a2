"""The mixture-of-experts families, Mixtral and Qwen3-MoE: published sizes (total and active parameters), config
mapping, runs of dense and sparse layers, float32 parity with transformers, Hugging Face round trip, bad input.

Parity: tiny random transformers models with odd sizes (hidden 60, 6 heads over
2 KV heads, top-2 of 5 experts of hidden 46 or 22, vocabulary 131), every
parameter perturbed (norm scales 1 + 0.1 N(0, 1), so a norm read as its init
shows), saved with `save_pretrained` (the per-expert layout of the published
checkpoints), give the same float32 logits as the spillway model `from_hf`
reads from that directory and from the model's in-memory state dict (the fused
`experts.gate_up_proj` layout of transformers 5; also as a safetensors file,
read a slice at a time). Three references: Mixtral
with a sliding window shorter than the sequence; Qwen3-MoE with layer 1 dense
among sparse ones (mlp_only_layers, three runs); Qwen3-MoE with
decoder_sparse_step 2 (dense, sparse, dense, sparse: four runs) and
norm_topk_prob off (the top-k weights not renormalised). What spillway exports
is what transformers saved, tensor for tensor, and loads back into it.
"""

import dataclasses

import numpy as np
import pytest
from safetensors.numpy import load_file

from llama_shaped_checks import forward, hf_logits, numpy_state_dict, perturbed_hf_model
from spillway.layers.errors import ConfigError
from spillway.models.decoder import DecoderLM
from spillway.models.hf import HFCheckpointError, export_hf_state_dict, from_hf, to_hf
from spillway.models.mixtral import config_from_hf as mixtral_from_hf
from spillway.models.registry import family_of_config, preset_config
from spillway.models.qwen3_moe import config_from_hf as qwen3_moe_from_hf

# Exact counts (module docstrings of models/mixtral.py and models/qwen3_moe.py). The published figures, rounded:
# Mixtral 8x7B "46.7B parameters, 12.9B active" and 8x22B "141B, 39B active" (Mistral AI's announcements);
# Qwen3-30B-A3B "30.5B, 3.3B activated" and 235B-A22B "235B, 22B activated" (the Qwen3 model cards).
COUNTS = {  # preset: (total, active)
    "mixtral_8x7b": (46_702_792_704, 12_879_925_248),
    "mixtral_8x22b": (140_620_634_112, 39_152_031_744),
    "qwen3_30b_a3b": (30_532_122_624, 3_353_032_704),
    "qwen3_235b_a22b": (235_093_634_560, 22_190_763_520),
}
PUBLISHED = {"mixtral_8x7b": (46.7e9, 12.9e9), "mixtral_8x22b": (141e9, 39e9),
             "qwen3_30b_a3b": (30.5e9, 3.3e9), "qwen3_235b_a22b": (235e9, 22e9)}

# Published config.json files (the keys that describe the model).
MIXTRAL_8X7B_HF = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 1e6,
    "sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
MIXTRAL_8X22B_HF = dict(MIXTRAL_8X7B_HF, hidden_size=6144, intermediate_size=16384, num_hidden_layers=56,
                        num_attention_heads=48, max_position_embeddings=65536, router_jitter_noise=0.0,
                        router_aux_loss_coef=0.001)
QWEN3_30B_A3B_HF = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_scaling": None, "use_sliding_window": False,
    "sliding_window": None, "max_window_layers": 48, "attention_bias": False, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "output_router_logits": False, "router_aux_loss_coef": 0.001, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
QWEN3_235B_A22B_HF = dict(QWEN3_30B_A3B_HF, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                          num_hidden_layers=94, num_attention_heads=64, max_window_layers=94)
PUBLISHED_HF = {"mixtral_8x7b": MIXTRAL_8X7B_HF, "mixtral_8x22b": MIXTRAL_8X22B_HF,
                "qwen3_30b_a3b": QWEN3_30B_A3B_HF, "qwen3_235b_a22b": QWEN3_235B_A22B_HF}


def _preset(name):
    return preset_config("mixtral", name) if name.startswith("mixtral") else preset_config("qwen3_moe", name)


def _from_hf(hf_config):
    return (mixtral_from_hf if hf_config["model_type"] == "mixtral" else qwen3_moe_from_hf)(hf_config)


# --- sizes and configs (no torch) -------------------------------------------------------

@pytest.mark.parametrize("preset", sorted(COUNTS))
def test_total_and_active_parameters(preset):
    spec = _preset(preset).decoder_spec()
    total, active = COUNTS[preset]
    assert (spec.num_params(), spec.num_active_params()) == (total, active)
    published_total, published_active = PUBLISHED[preset]
    assert abs(total - published_total) / published_total < 0.005
    assert abs(active - published_active) / published_active < 0.02


def test_active_parameters_by_hand():
    """Mixtral 8x7B: of each layer's 8 experts (3 x 4096 x 14336 each) a token uses 2; the router is 4096 x 8."""
    cfg = preset_config("mixtral", "mixtral_8x7b")
    expert = 3 * 4096 * 14336
    router = 4096 * 8
    spec = cfg.decoder_spec()
    assert spec.num_params() - spec.num_active_params() == 32 * 6 * expert
    dense_part = spec.num_params() - 32 * (8 * expert + router)
    assert spec.num_active_params() == dense_part + 32 * (2 * expert + router)


@pytest.mark.parametrize("preset", sorted(PUBLISHED_HF))
def test_published_configs_map_to_the_presets(preset):
    assert _from_hf(PUBLISHED_HF[preset]) == _preset(preset)


def test_config_round_trips():
    for cfg in (preset_config("mixtral", "tiny_odd"), preset_config("qwen3_moe", "tiny_odd"),
                preset_config("qwen3_moe", "tiny", decoder_sparse_step=2, norm_topk_prob=False)):
        table = family_of_config(cfg).hf
        assert table.config_from_hf(table.config_to_hf(cfg)) == cfg


def test_transformers5_spells_the_qwen3_moe_expert_count_num_local_experts():
    v5 = {k: v for k, v in QWEN3_30B_A3B_HF.items() if k != "num_experts"} | {"num_local_experts": 128}
    assert qwen3_moe_from_hf(v5) == preset_config("qwen3_moe", "qwen3_30b_a3b")


def test_dense_and_sparse_layers_are_runs():
    """transformers' rule: layer i is sparse unless listed in mlp_only_layers, and only if (i + 1) % step == 0."""
    def kinds(cfg):
        return [(run.num_layers, run.block.moe is not None) for run in cfg.decoder_spec().stack_runs()]

    assert kinds(preset_config("qwen3_moe", "qwen3_30b_a3b")) == [(48, True)]
    assert kinds(preset_config("qwen3_moe", "tiny_odd")) == [(1, True), (1, False), (1, True)]
    assert kinds(preset_config("qwen3_moe", "tiny", decoder_sparse_step=2)) == [(1, False), (1, True)] * 2
    assert kinds(preset_config("qwen3_moe", "tiny", num_layers=6, mlp_only_layers=(0, 1))) == [(2, False), (4, True)]
    assert kinds(preset_config("mixtral", "tiny")) == [(4, True)]
    # The dense layers count a dense MLP, the sparse ones the experts.
    spec = preset_config("qwen3_moe", "tiny_odd").decoder_spec()
    dense, sparse = spec.layer_params(1), spec.layer_params(0)
    assert dense - sparse == 3 * 60 * 92 - (5 * 3 * 60 * 22 + 60 * 5)


@pytest.mark.parametrize("make, message", [
    (lambda: preset_config("qwen3_moe", "tiny", mlp_only_layers=(1, 4)),
     r"Qwen3MoeConfig.mlp_only_layers names layer\(s\) \[4\], outside the model's 4 layers"),
    (lambda: preset_config("qwen3_moe", "tiny", top_k=9), r"moe.top_k \(9\) is more than moe.num_experts \(8\)"),
    (lambda: preset_config("mixtral", "tiny", num_experts=0), "num_experts"),
    (lambda: preset_config("mixtral", "tiny", moe_dispatch="sorted"), "moe.dispatch must be one of"),
    (lambda: preset_config("qwen3_moe", "tiny", moe_capacity_factor=0.0), "capacity_factor"),
    (lambda: preset_config("qwen3_moe", "tiny", decoder_sparse_step=0), "decoder_sparse_step"),
])
def test_bad_configs_fail_in_one_line(make, message):
    with pytest.raises(ConfigError, match=message) as err:
        make()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("hf_config, message", [
    (dict(QWEN3_30B_A3B_HF, mlp_only_layers=[0, 48]),
     r"mlp_only_layers names layer\(s\) \[48\], outside its 48 layers"),
    (dict(QWEN3_30B_A3B_HF, use_sliding_window=True, sliding_window=4096), "use_sliding_window=True"),
    (dict(MIXTRAL_8X7B_HF, router_jitter_noise=0.1), "router_jitter_noise=0.1"),
    (dict(MIXTRAL_8X7B_HF, hidden_act="gelu"), "hidden_act 'gelu'"),
    ({k: v for k, v in MIXTRAL_8X7B_HF.items() if k != "num_local_experts"} | {"num_local_experts": None},
     "no expert count"),
])
def test_unsupported_hf_configs_fail_in_one_line(hf_config, message):
    with pytest.raises(HFCheckpointError, match=message) as err:
        _from_hf(hf_config)
    assert "\n" not in str(err.value)


# --- against transformers ----------------------------------------------------------------

def _transformers_counts(transformers, hf_config: dict) -> tuple[int, int]:
    """(total, active) of transformers' model of `hf_config` on the meta device: active takes top_k / E of the
    expert tensors (named ...experts...) and all of everything else."""
    import torch

    config = transformers.AutoConfig.for_model(**hf_config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    experts = config.num_local_experts if hasattr(config, "num_local_experts") else config.num_experts
    total = active = 0
    for name, param in model.named_parameters():
        total += param.numel()
        active += param.numel() * config.num_experts_per_tok // experts if ".experts." in name else param.numel()
    return total, active


@pytest.mark.parametrize("preset", sorted(COUNTS))
def test_transformers_counts_the_same_total_and_active_parameters(transformers, preset):
    assert _transformers_counts(transformers, PUBLISHED_HF[preset]) == COUNTS[preset]


SEQ = 40
TOKENS = np.random.default_rng(1).integers(0, 131, (2, SEQ))
_QWEN_TINY = dict(model_type="qwen3_moe", vocab_size=131, hidden_size=60, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=14, intermediate_size=92, moe_intermediate_size=22, num_experts=5,
                  num_experts_per_tok=2, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=64,
                  use_sliding_window=False, tie_word_embeddings=False)
TINY_HF = {
    "mixtral": ("MixtralConfig", dict(
        model_type="mixtral", vocab_size=131, hidden_size=60, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, intermediate_size=46, num_local_experts=5, num_experts_per_tok=2, sliding_window=7,
        rope_theta=1e6, rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=False)),
    "qwen3_moe_mlp_only": ("Qwen3MoeConfig", dict(_QWEN_TINY, num_hidden_layers=3, mlp_only_layers=[1],
                                                  norm_topk_prob=True)),
    "qwen3_moe_step2": ("Qwen3MoeConfig", dict(_QWEN_TINY, num_hidden_layers=4, decoder_sparse_step=2,
                                               norm_topk_prob=False)),
}
TINY_PRESET = {"mixtral": preset_config("mixtral", "tiny_odd"), "qwen3_moe_mlp_only": preset_config("qwen3_moe", "tiny_odd"),
               "qwen3_moe_step2": preset_config("qwen3_moe", "tiny_odd", num_layers=4, mlp_only_layers=(),
                                                   decoder_sparse_step=2, norm_topk_prob=False)}
# Measured: max |difference| 4.7e-6, 5.1e-6 and 2.9e-6 on logits up to 3.8, 4.9 and 3.8 (float32).
PARITY_RTOL = PARITY_ATOL = 1e-5
FLOAT32 = dict(dtype="float32", param_dtype="float32")


@pytest.fixture(scope="module", params=sorted(TINY_HF))
def reference(request, transformers, tmp_path_factory):
    """(name, directory, transformers model, its logits): a tiny perturbed model saved with save_pretrained."""
    name = request.param
    config_cls, config = TINY_HF[name]
    # The eager experts loop: the grouped_mm one needs 16-byte strides, which odd sizes do not have.
    model = perturbed_hf_model(transformers, config_cls, dict(config, experts_implementation="eager"))
    directory = tmp_path_factory.mktemp(name)
    model.save_pretrained(directory)
    return name, directory, model, hf_logits(model, TOKENS)


def test_the_saved_checkpoint_holds_one_tensor_per_expert(reference):
    """transformers 5 writes the published layout (its conversion undone on save), not its fused modules."""
    name, directory, _, _ = reference
    saved = load_file(directory / "model.safetensors")
    experts = "block_sparse_moe.experts" if name == "mixtral" else "mlp.experts"
    layer = 1 if name == "qwen3_moe_step2" else 0   # its layer 0 is dense
    assert f"model.layers.{layer}.{experts}.4.{'w2' if name == 'mixtral' else 'down_proj'}.weight" in saved
    assert not any(k.endswith("gate_up_proj") for k in saved)


def test_logits_match_transformers_from_the_saved_directory(reference):
    name, directory, _, expected = reference
    model = from_hf(directory, remat="save_all", **FLOAT32)
    assert model.config == TINY_PRESET[name] and isinstance(model, DecoderLM)
    np.testing.assert_allclose(np.asarray(forward(model, TOKENS)), expected, rtol=PARITY_RTOL, atol=PARITY_ATOL)


def test_logits_match_transformers_from_its_fused_state_dict(reference):
    """model.state_dict() of transformers 5 holds experts.gate_up_proj [E, 2f, d] and experts.down_proj."""
    name, _, hf_model, expected = reference
    state = numpy_state_dict(hf_model)
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    model = from_hf(state, config=TINY_HF[name][1], remat="save_all", **FLOAT32)
    np.testing.assert_allclose(np.asarray(forward(model, TOKENS)), expected, rtol=PARITY_RTOL, atol=PARITY_ATOL)


def test_a_fused_safetensors_file_reads_slice_by_slice(reference, tmp_path):
    """The fused layout on disk (a state dict saved as it is): each expert's slice is read from the file."""
    import json

    from safetensors.numpy import save_file

    name, directory, hf_model, expected = reference
    save_file(numpy_state_dict(hf_model), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] in ("mixtral", "qwen3_moe")
    model = from_hf(tmp_path, remat="save_all", **FLOAT32)
    np.testing.assert_allclose(np.asarray(forward(model, TOKENS)), expected, rtol=PARITY_RTOL, atol=PARITY_ATOL)


@pytest.mark.parametrize("reference", ["qwen3_moe_mlp_only"], indirect=True)   # one reference is enough
@pytest.mark.parametrize("dispatch", [dict(moe_grouped_matmul="blocked", moe_block_rows=8),
                                      dict(moe_dispatch="capacity", moe_capacity_factor=2.5)],
                         ids=["blocked", "capacity_dropping_nothing"])
def test_every_dispatch_matches_transformers(reference, dispatch):
    """Top-2 of 5 with capacity factor 5 / 2 = 2.5 gives every expert a slot per token: nothing dropped."""
    name, directory, _, expected = reference
    model = from_hf(directory, remat="save_all", **FLOAT32, **dispatch)
    np.testing.assert_allclose(np.asarray(forward(model, TOKENS)), expected, rtol=PARITY_RTOL, atol=PARITY_ATOL)


def test_the_experts_and_router_matter(reference):
    """Swap two experts of layer 0: the logits move far (a mapping that mixed up experts would be caught)."""
    name, directory, _, expected = reference
    state = load_file(directory / "model.safetensors")
    names = ("w1", "w3", "w2") if name == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    layer = 0 if name != "qwen3_moe_step2" else 1
    prefix = f"model.layers.{layer}.{'block_sparse_moe' if name == 'mixtral' else 'mlp'}.experts."
    for n in names:
        a, b = f"{prefix}0.{n}.weight", f"{prefix}3.{n}.weight"
        state[a], state[b] = state[b], state[a]
    model = from_hf(state, config=TINY_HF[name][1], remat="save_all", **FLOAT32)
    assert np.abs(np.asarray(forward(model, TOKENS)) - expected).max() > 100 * PARITY_ATOL


def test_export_is_what_transformers_saved_and_loads_back(transformers, reference, tmp_path):
    name, directory, hf_model, expected = reference
    model = from_hf(directory, remat="save_all", **FLOAT32)
    exported = export_hf_state_dict(model)
    saved = load_file(directory / "model.safetensors")
    assert sorted(exported) == sorted(saved)
    for key, array in exported.items():
        np.testing.assert_array_equal(array, saved[key], err_msg=key)
    to_hf(model, tmp_path)
    again = from_hf(tmp_path, **FLOAT32)
    assert again.config == model.config
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager",
                                                                 experts_implementation="eager").eval()
    assert type(reloaded) is type(hf_model)
    np.testing.assert_array_equal(hf_logits(reloaded, TOKENS), expected)


@pytest.mark.parametrize("reference", sorted(set(TINY_HF) - {"qwen3_moe_step2"}), indirect=True)  # the two cover it
def test_missing_and_misshapen_expert_tensors_are_named(reference):
    name, directory, _, _ = reference
    state = load_file(directory / "model.safetensors")
    prefix = "model.layers.2." + ("block_sparse_moe" if name == "mixtral" else "mlp") + ".experts."
    down = "w2" if name == "mixtral" else "down_proj"
    del state[f"{prefix}4.{down}.weight"]
    state[f"{prefix}1.{down}.weight"] = state[f"{prefix}1.{down}.weight"][:, :-1]
    with pytest.raises(HFCheckpointError) as err:
        from_hf(state, config=TINY_HF[name][1])
    message = str(err.value)
    assert f"missing tensors (1): ['{prefix}4.{down}.weight']" in message
    assert f"{prefix}1.{down}.weight: checkpoint" in message


def test_an_hf_config_with_a_dense_layer_past_the_depth_is_refused():
    with pytest.raises(HFCheckpointError, match=r"mlp_only_layers names layer\(s\) \[3\], outside its 3 layers"):
        from_hf({}, config=dict(TINY_HF["qwen3_moe_mlp_only"][1], mlp_only_layers=[1, 3]))


def test_capacity_and_dropless_presets_differ_only_in_how_they_run():
    """The dispatch fields change no parameter: a recipe may switch them on a checkpoint."""
    base = preset_config("qwen3_moe", "qwen3_30b_a3b")
    capacity = dataclasses.replace(base, moe_dispatch="capacity", moe_capacity_factor=1.0)
    assert capacity.decoder_spec().num_params() == base.decoder_spec().num_params()
    assert capacity.decoder_spec().block.moe.dispatch == "capacity"
