"""LoRA end to end: a transformers checkpoint as the base, `spillway train` with lora.rank, a resume, and
`spillway export` (merged, and --adapter) read back by transformers and by peft.

References: transformers' logits of the merged export equal our model's (base +
adapters) on the same tokens; peft's logits of the base checkpoint with the
adapter folder loaded equal them too; a run stopped and resumed ends with the
adapters of the run that was not stopped.
"""

import json
import math

import numpy as np
import pytest

pytestmark = pytest.mark.needs_torch
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from spillway.recipes import cli  # noqa: E402

SOURCE = "builtin:stdlib:200000"
MODEL = ["model.vocab_size=512", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=2", "model.mlp_hidden=64", "model.max_seq_len=64"]


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    """A random tiny LlamaForCausalLM saved by transformers, with a byte-level BPE tokenizer beside it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from spillway.data import load_documents

    directory = tmp_path_factory.mktemp("hf-base")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    cache = tmp_path_factory.mktemp("cache")
    tokenizer.train_from_iterator((r["text"] for r in load_documents(SOURCE, cache_dir=cache / "datasets")), trainer)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(directory)
    return directory, cache


def train_args(hf_dir, cache, run_dir, *extra):
    sets = [f"checkpoint.init_from=hf:{hf_dir}", f"data.source={SOURCE}", f"data.cache_dir={cache}",
            "data.seq_len=32", *MODEL, "execution.dtype=float32", "train.global_batch=8", "train.steps=4",
            "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0", "optimizer.warmup_steps=1",
            "optimizer.learning_rate=3e-2", f"checkpoint.dir={run_dir}", "lora.rank=4", "lora.alpha=16",
            "lora.dropout=0.1", "lora.targets=q_proj,v_proj,o_proj,down_proj", *extra]
    return ["train", "tiny", *[a for s in sets for a in ("--set", s)]]


def our_logits(run_dir, tokens):
    import jax
    from flax import nnx

    from spillway.layers.mesh import MeshConfig
    from spillway.layers.sharding import make_mesh, state_shardings
    from spillway.recipes.readable_step import saved_recipe
    from spillway.recipes.train.checkpoint import resolve_step_dir
    from spillway.recipes.train.lora_state import restore_run_params
    from spillway.recipes.train.step import abstract_model, abstract_with_shardings

    step_dir = resolve_step_dir(run_dir)
    recipe = saved_recipe(step_dir)
    graphdef, abstract = abstract_model(recipe)
    mesh = make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1])
    params = restore_run_params(step_dir, recipe, abstract_with_shardings(abstract, state_shardings(abstract, mesh)))
    return np.asarray(nnx.merge(graphdef, params)(tokens)), params


def adapter_leaves(params):
    from flax import nnx
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(params) if isinstance(v, nnx.LoRAParam)}


def save_with_tokenizer(model, hf_dir, hf_base):
    """A transformers model saved as a Hugging Face folder, with the fixture's tokenizer beside it."""
    model.save_pretrained(hf_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (hf_dir / name).write_bytes((hf_base[0] / name).read_bytes())


def logits_of(model, tokens):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens)).logits.numpy()


def train_and_export_adapter(recipe, sets, run, adapter, capsys):
    """`spillway train RECIPE --set ...` into `run`, then `spillway export run adapter --adapter`."""
    assert cli.main(["train", recipe, *[a for s in sets for a in ("--set", s)]]) == 0, capsys.readouterr().err
    assert cli.main(["export", str(run), str(adapter), "--adapter"]) == 0, capsys.readouterr().err


@pytest.mark.slow   # three short CLI runs: a few minutes on 2 busy cores
def test_lora_trains_resumes_exactly_and_exports_to_transformers_and_peft(hf_base, tmp_path, capsys):
    hf_dir, cache = hf_base
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert cli.main(train_args(hf_dir, cache, straight)) == 0, capsys.readouterr().err
    assert cli.main(train_args(hf_dir, cache, stopped) + ["--stop-after", "2"]) == 0, capsys.readouterr().err
    assert cli.main(train_args(hf_dir, cache, stopped)) == 0, capsys.readouterr().err
    losses = [json.loads(line)["loss"] for line in open(straight / "metrics.jsonl") if '"loss"' in line]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses

    # The checkpoint holds the adapters only, and the resumed run ends where the straight one does.
    saved = json.loads(open(sorted((straight / "checkpoints").glob("[0-9]*"))[-1] / "params" / "_METADATA").read())
    assert saved["tree_metadata"] and all("lora_" in key for key in saved["tree_metadata"]), list(saved["tree_metadata"])
    tokens = np.random.default_rng(0).integers(0, 512, (2, 24))
    logits, params = our_logits(straight, tokens)
    resumed_logits, resumed = our_logits(stopped, tokens)
    for path, value in adapter_leaves(params).items():
        np.testing.assert_array_equal(adapter_leaves(resumed)[path], value, err_msg=str(path))
    np.testing.assert_array_equal(resumed_logits, logits)

    # generate reads a LoRA run back the same way: base from its pointer, adapters from the step.
    capsys.readouterr()
    assert cli.main(["generate", str(straight), "--prompt", "def", "--tokens", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def")

    # Merged: transformers loads the folder and computes our logits.
    merged = tmp_path / "merged"
    assert cli.main(["export", str(straight), str(merged)]) == 0, capsys.readouterr().err
    assert (merged / "tokenizer.json").is_file()
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    theirs = logits_of(hf_model, tokens)
    np.testing.assert_allclose(theirs, logits, atol=2e-4, rtol=1e-4)

    # Adapter: peft loads it onto the base checkpoint and computes our logits.
    adapter = tmp_path / "adapter"
    assert cli.main(["export", str(straight), str(adapter), "--adapter"]) == 0, capsys.readouterr().err
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 16.0, "LORA")
    assert sorted(config["target_modules"]) == ["down_proj", "o_proj", "q_proj", "v_proj"]
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, adapter).eval()
    peft_logits = logits_of(with_adapter, tokens)
    np.testing.assert_allclose(peft_logits, logits, atol=2e-4, rtol=1e-4)
    # ... and the adapters matter: the base alone (a fresh copy; peft adapted `base` in place) computes others.
    plain = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert not np.allclose(peft_logits, logits_of(plain, tokens), atol=1e-3)


def test_export_refuses_a_folder_with_another_checkpoint_and_adapter_without_lora(tmp_path, capsys):
    """Before anything is read: the same refusals as to_hf; --adapter on a run without LoRA."""
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "model-00001-of-00002.safetensors").write_bytes(b"x")
    run = tmp_path / "run" / "checkpoints" / "3"
    (run / "recipe").mkdir(parents=True)
    (run / "params").mkdir()
    from spillway.recipes.registry import get_recipe
    (run / "recipe" / "recipe.json").write_text(get_recipe("tiny").to_json())
    import orbax.checkpoint as ocp
    ocp.step.is_checkpoint_finalized  # noqa: B018 — resolve_step_dir asks orbax whether the step is finalised
    (run / "_CHECKPOINT_METADATA").write_text("{}")
    assert cli.main(["export", str(run), str(occupied), "--adapter"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--adapter" in err and "no LoRA adapters" in err and len(err.splitlines()) == 1, err
    # A LoRA run into a folder holding another checkpoint: refused before its (absent) weights are read.
    lora = get_recipe("tiny", ["lora.rank=4", "checkpoint.init_from=/nowhere"])
    (run / "recipe" / "recipe.json").write_text(lora.to_json())
    for extra in ([], ["--adapter"]):
        assert cli.main(["export", str(run), str(occupied), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert "already holds another checkpoint (model-00001-of-00002.safetensors)" in err, err
        assert len(err.splitlines()) == 1
    assert sorted(p.name for p in occupied.iterdir()) == ["model-00001-of-00002.safetensors"]


@pytest.mark.slow   # a transformers checkpoint, one LoRA run and its adapter export: about a minute on 2 cores
def test_the_adapter_of_a_model_with_several_runs_of_layers_loads_in_peft(hf_base, tmp_path, capsys):
    """Qwen3-MoE with a dense layer among the sparse ones keeps its layers in several runs: the adapter export
    failed with an internal error building its own refusal. Each run's layers are numbered from its first."""
    _, cache = hf_base
    hf_dir = tmp_path / "qwen3-moe"
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
        mlp_only_layers=[1], decoder_sparse_step=1, max_position_embeddings=64, tie_word_embeddings=False)
    save_with_tokenizer(transformers.Qwen3MoeForCausalLM(config), hf_dir, hf_base)
    run, adapter = tmp_path / "run", tmp_path / "adapter"
    sets = [f"checkpoint.init_from=hf:{hf_dir}", f"data.source={SOURCE}", f"data.cache_dir={cache}", "data.seq_len=32",
            "model.vocab_size=512", "model.d_model=32", "model.num_layers=3", "model.num_heads=4",
            "model.num_kv_heads=2", "model.head_dim=8", "model.num_experts=8", "model.top_k=2",
            "model.moe_hidden=16", "model.mlp_hidden=64", "model.mlp_only_layers=[1]", "model.max_seq_len=64", "model.rope_theta=10000.0",
            "model.norm_topk_prob=false",
            "execution.dtype=float32", "train.global_batch=8", "train.steps=2", "train.eval_every=0",
            "train.sample_tokens=0", "optimizer.learning_rate=3e-2", f"checkpoint.dir={run}", "lora.rank=4",
            "lora.targets=q_proj,v_proj"]
    train_and_export_adapter("qwen3_moe_tiny", sets, run, adapter, capsys)
    tokens = np.random.default_rng(1).integers(0, 512, (2, 24))
    logits, _ = our_logits(run, tokens)
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, adapter).eval()
    np.testing.assert_allclose(logits_of(with_adapter, tokens), logits, atol=2e-4, rtol=1e-4)


@pytest.mark.slow   # a transformers multimodal Gemma 3, one LoRA run and its adapter export: about a minute
def test_the_adapter_of_a_multimodal_gemma3_loads_in_peft_onto_its_text_layers(hf_base, tmp_path, capsys):
    """Gemma 3 4B-27B are Gemma3ForConditionalGeneration: their text layers are model.language_model.layers.N,
    and bare target names (q_proj) match the vision tower too. The adapter was named model.layers.N: PEFT
    loaded it with no effect, warning only of missing keys."""
    _, cache = hf_base
    hf_dir = tmp_path / "gemma3-mm"
    torch.manual_seed(0)
    text = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=8,
                query_pre_attn_scalar=8)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=511, boi_token_index=509, eoi_token_index=510)
    save_with_tokenizer(transformers.Gemma3ForConditionalGeneration(config), hf_dir, hf_base)
    run, adapter = tmp_path / "run", tmp_path / "adapter"
    sets = [f"checkpoint.init_from=hf:{hf_dir}", f"data.source={SOURCE}", f"data.cache_dir={cache}", "data.seq_len=32",
            "model.vocab_size=512", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
            "model.num_kv_heads=2", "model.head_dim=8", "model.mlp_hidden=64", "model.layer_pattern=L",
            "model.sliding_window=8", "model.rope_global_scale=1.0", "model.query_pre_attn_scalar=8.0",
            "model.max_seq_len=64", "execution.dtype=float32", "train.global_batch=8", "train.steps=2",
            "train.eval_every=0", "train.sample_tokens=0", "optimizer.learning_rate=3e-2", f"checkpoint.dir={run}",
            "lora.rank=4", "lora.targets=q_proj,v_proj,down_proj"]
    train_and_export_adapter("gemma3_tiny", sets, run, adapter, capsys)
    tokens = np.random.default_rng(1).integers(0, 500, (2, 24))
    logits, _ = our_logits(run, tokens)
    base = transformers.AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32)
    base_logits = logits_of(base, tokens)
    with_adapter = peft.PeftModel.from_pretrained(base, adapter).eval()
    peft_logits = logits_of(with_adapter, tokens)
    assert np.abs(peft_logits - base_logits).max() > 1e-3   # the adapter took effect
    np.testing.assert_allclose(peft_logits, logits, atol=2e-4, rtol=1e-4)
    vision_adapted = [n for n, _ in with_adapter.named_modules() if "vision" in n and "lora_A" in n]
    assert vision_adapted == []


@pytest.mark.slow   # a transformers GPT-2, one LoRA run, both exports: about a minute on 2 cores
def test_gpt2_lora_adapts_the_fused_c_attn_as_peft_does(hf_base, tmp_path, capsys):
    """GPT-2's projections are Conv1D, q | k | v fused in one c_attn: PEFT adapts c_attn as one matrix (one A
    shared by q, k and v). Our run with the default targets (PEFT's for gpt2: c_attn) and Conv1D c_proj/c_fc
    exports merged (transformers) and as an adapter (peft, fan_in_fan_out) with our logits."""
    _, cache = hf_base
    hf_dir = tmp_path / "gpt2"
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=512, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    save_with_tokenizer(transformers.GPT2LMHeadModel(config), hf_dir, hf_base)
    run = tmp_path / "run"
    sets = [f"checkpoint.init_from=hf:{hf_dir}", f"data.source={SOURCE}", f"data.cache_dir={cache}",
            "data.seq_len=32", "model.vocab_size=512", "model.d_model=32", "model.num_layers=2",
            "model.num_heads=4", "model.max_seq_len=64", "execution.dtype=float32", "train.global_batch=8",
            "train.steps=3", "train.eval_every=0", "train.sample_tokens=0", "optimizer.warmup_steps=1",
            "optimizer.learning_rate=3e-2", f"checkpoint.dir={run}", "lora.rank=4", "lora.alpha=16",
            "lora.dropout=0.1"]
    assert cli.main(["train", "gpt2_tiny", *[a for s in sets for a in ("--set", s)]]) == 0, capsys.readouterr().err
    assert "LoRA rank 4 on c_attn:" in capsys.readouterr().out   # the default targets resolved, and said
    more = tmp_path / "run-more"   # every Conv1D projection: c_attn, both c_proj (attention, MLP), c_fc
    sets = [s.replace(f"checkpoint.dir={run}", f"checkpoint.dir={more}") for s in sets] + ["lora.targets=c_attn,c_proj,c_fc"]
    assert cli.main(["train", "gpt2_tiny", *[a for s in sets for a in ("--set", s)]]) == 0, capsys.readouterr().err
    tokens = np.random.default_rng(2).integers(0, 512, (2, 24))
    for trained, modules in ((run, ["c_attn"]), (more, ["c_attn", "c_fc", "c_proj"])):
        logits, params = our_logits(trained, tokens)
        assert any(np.abs(v).max() > 0 for p, v in adapter_leaves(params).items() if p[-1] == "b")   # B trained
        merged, adapter = tmp_path / f"{trained.name}-merged", tmp_path / f"{trained.name}-adapter"
        assert cli.main(["export", str(trained), str(merged)]) == 0, capsys.readouterr().err
        assert cli.main(["export", str(trained), str(adapter), "--adapter"]) == 0, capsys.readouterr().err
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
        np.testing.assert_allclose(logits_of(hf_model, tokens), logits, atol=2e-4, rtol=1e-4)
        written = json.loads((adapter / "adapter_config.json").read_text())
        assert (sorted(written["target_modules"]), written["fan_in_fan_out"]) == (modules, True)
        base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        with_adapter = peft.PeftModel.from_pretrained(base, adapter).eval()
        np.testing.assert_allclose(logits_of(with_adapter, tokens), logits, atol=2e-4, rtol=1e-4)
