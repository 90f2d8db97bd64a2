"""Fine-tuning from a Hugging Face checkpoint directory: `spillway train tiny --set checkpoint.init_from=hf:DIR`.

The checkpoint is written here by transformers: a random tiny LlamaForCausalLM
(weights rescaled so its logits are far from a fresh spillway init's) saved
with `save_pretrained`, beside a byte-level BPE tokenizer.json trained with
the `tokenizers` library on the run's own corpus and saved the way
transformers saves tokenizers. transformers is the reference: the loss of the
first training step (computed before any update) and the step-0 logits must be
its own on the same tokens.
"""

import dataclasses
import json
import math

import numpy as np
import pytest

pytestmark = pytest.mark.needs_torch
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from spillway.data import load_documents  # noqa: E402
from spillway.models import registry  # noqa: E402
from spillway.models.hf import HFTable  # noqa: E402
from spillway.recipes import cli  # noqa: E402
from spillway.recipes.registry import get_recipe  # noqa: E402
from spillway.recipes.train.checkpoint import read_recipe_json  # noqa: E402
from spillway.recipes.train.init_weights import resolve_init_from  # noqa: E402

EOS = "<|endoftext|>"
SOURCE = "builtin:stdlib:400000"
# The checkpoint's architecture, as `tiny` overrides (max_seq_len may differ from the checkpoint's 256).
MODEL = ["model.vocab_size=512", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=2", "model.mlp_hidden=64", "model.max_seq_len=64"]


def hf_llama_config():
    return transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                                    max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("spillway-cache")


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory, data_cache):
    """A save_pretrained directory: config.json, model.safetensors, tokenizer.json, tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory = tmp_path_factory.mktemp("hf-llama")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_llama_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # transformers initialises norms to one and matrices at std 0.02: logits that say little.
            # Unit-scale activations, and a head whose logits are confidently wrong: a loss far above
            # log(vocab) that a few steps of fine-tuning bring down.
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                scale = 1.0 if "embed_tokens" in name else (4.0 if "lm_head" in name else 1.0) / math.sqrt(p.shape[1])
                p.copy_(scale * torch.randn_like(p))
    model.save_pretrained(directory)

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    documents = load_documents(SOURCE, cache_dir=data_cache / "datasets")
    tokenizer.train_from_iterator((row["text"] for row in documents), trainer)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS).save_pretrained(directory)
    return directory


def overrides(hf_dir, data_cache, run_dir, *extra):
    return [f"checkpoint.init_from=hf:{hf_dir}", f"data.source={SOURCE}", f"data.cache_dir={data_cache}",
            "data.seq_len=32", "data.num_proc=1", *MODEL, "execution.dtype=float32",
            "train.global_batch=8", "train.steps=8", "train.log_every=1", "train.eval_every=0",
            "train.sample_tokens=0", "optimizer.warmup_steps=1", "optimizer.learning_rate=1e-2",
            f"checkpoint.dir={run_dir}", "checkpoint.every_steps=100", *extra]


def cli_args(sets):
    return ["train", "tiny", *[arg for item in sets for arg in ("--set", item)]]


def reference_loss(hf_dir, tokens_bt: np.ndarray) -> float:
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokens = torch.as_tensor(tokens_bt.astype(np.int64))
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1]).logits
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)))


@pytest.mark.slow   # a minute on 2 busy cores: compiles and runs the train step
def test_finetune_from_hf_directory_through_the_cli(hf_checkpoint, data_cache, tmp_path, capsys):
    from spillway.recipes.train.data_pipeline import prepare, train_loader

    run_dir = tmp_path / "run"
    sets = overrides(hf_checkpoint, data_cache, run_dir)
    assert cli.main(cli_args(sets)) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "tokenizer: " in out and "fine-tuning from the Hugging Face checkpoint" in out

    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(losses) == list(range(1, 9)) and all(math.isfinite(x) for x in losses.values())
    assert losses[8] < losses[1] - 1.0, losses

    # Step 1's loss is the loaded model's (no update yet) on the first batch: transformers' own loss there.
    recipe = resolve_init_from(get_recipe("tiny", sets), say=lambda *a: None)
    _, packed = prepare(recipe)
    first_batch = next(train_loader(packed, recipe, 0, 1))
    expected = reference_loss(hf_checkpoint, first_batch)
    assert expected > math.log(512) + 2, "the reference should be far from a fresh init's loss"
    assert losses[1] == pytest.approx(expected, rel=1e-5)

    # The run used and kept the checkpoint's tokenizer, and says so in its recipe.
    saved = json.loads(read_recipe_json(run_dir / "checkpoints"))
    assert saved["data"]["tokenizer"] == str(hf_checkpoint)
    assert (run_dir / "tokenizer.json").read_text() == (hf_checkpoint / "tokenizer.json").read_text()
    assert json.loads((run_dir / "tokenizer_config.json").read_text())["eos_token"] == EOS


def reference_logits(hf_dir, tokens_bt: np.ndarray, round_to_bfloat16: bool = False) -> np.ndarray:
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    if round_to_bfloat16:   # the weights a bfloat16 run holds, computed in float32 as the run does
        with torch.no_grad():
            # Matrices and tables only: spillway keeps norm scales in float32, and model.to() would
            # round RoPE's inv_freq buffer too.
            for p in model.parameters():
                if p.ndim >= 2:
                    p.copy_(p.to(torch.bfloat16).to(torch.float32))
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens_bt.astype(np.int64))).logits.numpy()


def test_loaded_weights_sit_in_their_shards_and_give_transformers_logits(hf_checkpoint, data_cache, tmp_path):
    """What the loop does at step 0 (load_init_weights into the run's abstract, sharded parameters)."""
    from flax import nnx

    from spillway.layers.sharding import make_mesh, state_shardings
    from spillway.recipes.train.init_weights import load_init_weights
    from spillway.recipes.train.step import abstract_model, abstract_with_shardings

    recipe = resolve_init_from(get_recipe("tiny", overrides(hf_checkpoint, data_cache, tmp_path)), lambda *a: None)
    mesh = make_mesh(recipe.mesh)
    graphdef, abstract = abstract_model(recipe)
    shardings = state_shardings(abstract, mesh)
    params = load_init_weights(recipe, abstract_with_shardings(abstract, shardings), lambda *a: None)
    for (path, loaded), (_, wanted) in zip(nnx.to_flat_state(params), nnx.to_flat_state(shardings)):
        assert loaded.get_value().sharding == wanted.get_value(), path
    model = nnx.merge(graphdef, params)
    tokens_bt = np.array([[5, 300, 17, 399, 0, 42, 42, 7, 250, 3, 1, 128]], np.int32)
    expected = reference_logits(hf_checkpoint, tokens_bt)
    assert np.abs(expected).max() > 1.0
    np.testing.assert_allclose(np.asarray(jax_forward(model, tokens_bt)), expected, rtol=1e-4, atol=1e-4)


def jax_forward(model, tokens_bt):
    import jax
    return jax.jit(lambda m, t: m(t))(model, tokens_bt)


@pytest.mark.slow   # a minute on 2 busy cores: builds the run and compiles its train step
def test_bfloat16_run_updates_from_the_loaded_weights_not_from_its_random_init(hf_checkpoint, data_cache, tmp_path):
    """bfloat16 parameters keep fp32 master copies in the optimizer state, and the update starts from those:
    they must be made from the loaded weights. With a zero learning rate (the warmup's first step) one
    step leaves the weights exactly as loaded."""
    from spillway.recipes.train.loop import train

    result = train(get_recipe("tiny", overrides(hf_checkpoint, data_cache, tmp_path / "bf16", "train.steps=1",
                                                "execution.param_dtype=bfloat16")),
                   progress=False, echo=lambda *a: None)
    assert result.history[0]["learning_rate"] == 0.0
    tokens_bt = np.asarray(result.tokenizer.encode(["def load(path):\n    return open(path).read()\n"]))
    np.testing.assert_allclose(np.asarray(jax_forward(result.model, tokens_bt)),
                               reference_logits(hf_checkpoint, tokens_bt, round_to_bfloat16=True),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lora", [[], ["lora.rank=4"]], ids=["full", "lora"])
def test_a_recipe_whose_model_differs_fails_naming_the_field(hf_checkpoint, data_cache, tmp_path, capsys, lora):
    """With LoRA on, the adapters' own weights were read as the checkpoint's: "its config.json does not describe
    its own weights (... lora_wq/a ...)" instead of the field that differs."""
    sets = overrides(hf_checkpoint, data_cache, tmp_path / "bad", "model.num_layers=3", *lora)
    assert cli.main(cli_args(sets)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "recipe 'tiny' differs from the checkpoint's config.json in model.num_layers (recipe 3, checkpoint 2); " \
           "match it with --set model.num_layers=2, or pick" in err
    assert not (tmp_path / "bad").exists()   # refused before anything was built or written


def test_a_head_said_tied_that_the_file_holds_apart_is_one_line_naming_the_checkpoint(hf_checkpoint, data_cache,
                                                                                        tmp_path, capsys):
    """config.json says tie_word_embeddings=true, model.safetensors holds its own lm_head.weight: the refusal
    (read from the values, once the run loads them) lacked the checkpoint.init_from= its other errors carry."""
    import shutil

    tied = tmp_path / "tied"
    shutil.copytree(hf_checkpoint, tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    sets = overrides(tied, data_cache, tmp_path / "run", "model.tie_embeddings=true")
    assert cli.main(cli_args(sets)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"spillway train: error: checkpoint.init_from=hf:{tied}: tie_word_embeddings is True but "
                          f"lm_head.weight differs from"), err


def test_max_seq_len_may_differ_and_a_longer_one_is_announced(hf_checkpoint, data_cache, tmp_path):
    said = []
    shorter = resolve_init_from(get_recipe("tiny", overrides(hf_checkpoint, data_cache, tmp_path)), said.append)
    assert shorter.data.tokenizer == str(hf_checkpoint) and not any("longer" in s for s in said)
    resolve_init_from(get_recipe("tiny", overrides(hf_checkpoint, data_cache, tmp_path, "model.max_seq_len=512")),
                      said.append)
    assert any("512 is longer than the checkpoint's 256" in s for s in said)
    named = resolve_init_from(get_recipe("tiny", overrides(hf_checkpoint, data_cache, tmp_path,
                                                           "data.tokenizer=/my/tok.model")), said.append)
    assert named.data.tokenizer == "/my/tok.model"   # a tokenizer the recipe names is kept


def test_another_family_is_named(hf_checkpoint, data_cache, tmp_path, monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class OtherConfig:
        max_seq_len: int = 64

    table = HFTable(model_types=("other_lm",), architecture="OtherForCausalLM", config_from_hf=lambda c: OtherConfig(),
                    fields_to_hf=dict,
                    weights=lambda c: [])
    monkeypatch.setitem(registry.FAMILIES, "other", registry.Family(
        name="other", config_cls=OtherConfig, presets={}, description="a test family", hf=table))
    directory = tmp_path / "other"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "other_lm"}))
    with pytest.raises(ValueError, match="the checkpoint is a other model, but recipe 'tiny' builds a llama model"):
        resolve_init_from(get_recipe("tiny", overrides(directory, data_cache, tmp_path)))


def test_bad_init_from_paths_are_explained(hf_checkpoint, data_cache, tmp_path):
    with pytest.raises(ValueError, match="is a Hugging Face checkpoint.*write checkpoint.init_from=hf:"):
        recipe = get_recipe("tiny", overrides(hf_checkpoint, data_cache, tmp_path))
        resolve_init_from(dataclasses.replace(recipe, checkpoint=dataclasses.replace(
            recipe.checkpoint, init_from=str(hf_checkpoint))))
    with pytest.raises(FileNotFoundError, match="init_from=hf:.*absent.*does not exist"):
        resolve_init_from(get_recipe("tiny", overrides(tmp_path / "absent", data_cache, tmp_path)))
    config_only = tmp_path / "no-tokenizer"
    config_only.mkdir()
    (config_only / "config.json").write_text((hf_checkpoint / "config.json").read_text())
    # config (and tokenizer) without weights: said with the setting, as every other init_from problem
    with pytest.raises(FileNotFoundError, match=rf"^checkpoint.init_from=hf:{config_only}: no \*.safetensors"):
        resolve_init_from(get_recipe("tiny", overrides(config_only, data_cache, tmp_path)))
    (config_only / "model.safetensors").symlink_to(hf_checkpoint / "model.safetensors")
    with pytest.raises(ValueError, match="holds no tokenizer.json or tokenizer.model.*set data.tokenizer"):
        resolve_init_from(get_recipe("tiny", overrides(config_only, data_cache, tmp_path)))
    # a config.json that contradicts its own weights (vocab_size 600, an embedding of 512 rows) is named as
    # such, not answered with --set model.vocab_size=600, which only led to the shape mismatch
    config = json.loads((hf_checkpoint / "config.json").read_text())
    (config_only / "config.json").write_text(json.dumps({**config, "vocab_size": 600}))
    with pytest.raises(ValueError, match=r"its config.json does not describe its own weights \(.*embed_tokens.*"
                                         r"\(512, 32\).*\(600, 32\).*\); the checkpoint is inconsistent"):
        resolve_init_from(get_recipe("tiny", overrides(config_only, data_cache, tmp_path)))


def test_the_readme_example_recipe_matches_the_published_llama_3_2_1b_config(tmp_path, monkeypatch):
    """`spillway train llama3_1b --set checkpoint.init_from=hf:.../Llama-3.2-1B` (README): the check passes, and
    the checkpoint's tokenizer replaces the recipe's default copy (tokenizers/..., not fetched here)."""
    monkeypatch.chdir(tmp_path)
    published = {  # meta-llama/Llama-3.2-1B config.json, the fields spillway reads
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
        "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                                 "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "max_position_embeddings": 131072, "tie_word_embeddings": True, "vocab_size": 128256,
        "bos_token_id": 128000, "eos_token_id": 128001}
    (tmp_path / "config.json").write_text(json.dumps(published))
    (tmp_path / "tokenizer.json").write_text("{}")   # only its presence matters here
    (tmp_path / "model.safetensors").write_bytes(b"")   # nor do the weights' (not read before the data is)
    said = []
    recipe = resolve_init_from(get_recipe("llama3_1b", [f"checkpoint.init_from=hf:{tmp_path}"]), said.append)
    assert recipe.data.tokenizer == str(tmp_path)
    assert said == [f"tokenizer: {tmp_path / 'tokenizer.json'} (the checkpoint's, instead of data.tokenizer "
                    f"'tokenizers/meta-llama/Llama-3.2-1B', which does not exist)"]
    # A tokenizer the recipe names that is there is kept.
    (tmp_path / "tokenizers" / "meta-llama" / "Llama-3.2-1B").mkdir(parents=True)
    kept = resolve_init_from(get_recipe("llama3_1b", [f"checkpoint.init_from=hf:{tmp_path}"]), lambda *a: None)
    assert kept.data.tokenizer == "tokenizers/meta-llama/Llama-3.2-1B"
