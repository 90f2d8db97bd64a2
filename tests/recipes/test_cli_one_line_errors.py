"""`spillway train` (and `export`, `generate`) inputs a new user gets wrong, each ending in one line and exit status 2, before data is prepared.

* a .jsonl corpus with a line `datasets` cannot read: the file and its
  1-based line (pyarrow says "row 300" of a block, and logs it twice); an
  empty one by its name (the builder says only StopIteration);
* fine-tuning from a spillway run of another family: the two families, not a
  shape difference per weight;
* a Hugging Face folder without config.json: what to put there (no Python
  `config=` advice on the command line);
* a Hugging Face checkpoint with a missing or misshapen tensor: found from the
  safetensors headers before the data is prepared.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from micro_recipe import MICRO
from user_files import write_hf_tokenizer
from spillway.recipes import cli
from spillway.recipes.registry import get_recipe


def run_cli(*argv: str, capsys) -> tuple[int, list[str], str]:
    """(exit status, stderr lines, stdout) of `spillway train ...`."""
    status = cli.main(["train", *argv])
    captured = capsys.readouterr()
    return status, captured.err.strip().splitlines(), captured.out


def micro_set(*extra: str) -> list[str]:
    return [arg for item in [*MICRO, *extra] for arg in ("--set", item)]


def test_a_bad_jsonl_line_is_named_with_its_file_and_1_based_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    lines = [json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) for i in range(300)]
    (tmp_path / "badline.jsonl").write_bytes("\n".join(lines).encode() + b'\n{"text": "caf\xe9"}\n')
    status, err, _ = run_cli("tiny", *micro_set("data.source=badline.jsonl", "train.steps=1"), capsys=capsys)
    assert status == 2
    assert err == ["spillway train: error: corpus file 'badline.jsonl', line 301: not UTF-8 (byte 0xe9 at column 14); "
                   "re-encode the file to UTF-8 (for cp1252/Latin-1: iconv -f cp1252 -t utf-8)"]


@pytest.mark.parametrize("content, message", [
    (b"", "corpus file 'empty.jsonl' is empty: no record to read; remove it from the corpus or fill it"),
    (b"\n\n", "corpus file 'empty.jsonl' is empty: no record to read; remove it from the corpus or fill it"),
], ids=["empty", "blank_lines"])
def test_an_empty_jsonl_corpus_is_named_not_a_stopiteration(tmp_path, monkeypatch, capsys, content, message):
    """The json builder stops on an empty file with a bare StopIteration, and reads a file of blank lines as a
    table without columns ("has no text field 'text'; its columns are []"): neither said the file is empty."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.jsonl").write_bytes(content)
    status, err, _ = run_cli("tiny", *micro_set("data.source=empty.jsonl", "train.steps=1"), capsys=capsys)
    assert status == 2
    assert err == [f"spillway train: error: {message}"]


def saved_source_run(source, recipe_json: str):
    """A run folder whose one step holds `recipe_json` (its weights a stand-in): what a fine-tune's checks read."""
    import jax.numpy as jnp

    from spillway.recipes.train.checkpoint import RunCheckpointer

    with RunCheckpointer(source / "checkpoints", keep=1, every_steps=1, async_save=False) as checkpointer:
        checkpointer.save(1, params={"w": jnp.zeros(2)}, opt_state={"m": jnp.zeros(2)}, loader_state={},
                          meta={"step": 1}, recipe_json=recipe_json, force=True)


def refused_fine_tune(recipe: str, source, out_dir, capsys, *sets: str) -> list[str]:
    """The error lines of `spillway train RECIPE` fine-tuning from `source` into `out_dir`, refused before any
    data is prepared."""
    status, err, out = run_cli(recipe, "--set", f"checkpoint.init_from={source}", *sets,
                               "--set", f"checkpoint.dir={out_dir}", capsys=capsys)
    assert status == 2
    assert "data:" not in out
    return err


def test_finetuning_from_a_run_of_another_family_names_both_families(tmp_path, capsys):
    source = tmp_path / "runs" / "tiny"   # a llama run's checkpoint: its saved recipe says the family
    saved_source_run(source, get_recipe("tiny").to_json())
    err = refused_fine_tune("gemma2_tiny", source, tmp_path / "runs" / "gemma", capsys)
    assert err == [f"spillway train: error: checkpoint.init_from={source}: that run trained a llama model (recipe "
                   f"'tiny'), but recipe 'gemma2_tiny' builds a gemma2 model; fine-tune it with a llama recipe, or "
                   f"start from a gemma2 run"]


def test_finetuning_a_run_of_a_users_block_with_the_block_unset_is_refused(tmp_path, capsys):
    """A new user's finding: the weights of a run of `ParallelBlock` went into Llama's own block without a word,
    and the export of that fine-tune shipped them as a Llama computing another network."""
    import json

    saved = get_recipe("tiny").to_dict()
    saved["block"] = "my_blocks:ParallelBlock"
    source = tmp_path / "runs" / "par"
    saved_source_run(source, json.dumps(saved))
    err = refused_fine_tune("tiny", source, tmp_path / "runs" / "ft", capsys)
    assert err == [f"spillway train: error: checkpoint.init_from={source}: that run trained the block "
                   f"my_blocks:ParallelBlock, and this recipe builds llama's own: set block=my_blocks:ParallelBlock "
                   f"to fine-tune it (or a block of your choice, set on purpose)"]


def test_finetuning_a_run_of_another_shape_names_the_model_fields_before_the_data(tmp_path, capsys):
    """A fine-tune of a tiny run with model.num_layers=2 prepared the data, then failed restoring, naming each of
    nine misshapen arrays and no setting to change."""
    source = tmp_path / "runs" / "tiny"
    saved_source_run(source, get_recipe("tiny").to_json())
    err = refused_fine_tune("tiny", source, tmp_path / "runs" / "ft", capsys, "--set", "model.num_layers=2",
                            "--set", "model.max_seq_len=256")   # max_seq_len bounds the positions alone: may differ
    assert err == [f"spillway train: error: checkpoint.init_from={source}: recipe 'tiny' differs from the model that "
                   f"run trained in model.num_layers (recipe 2, that run 4); a fine-tune starts from its weights as "
                   f"they are: match it with --set model.num_layers=4, or train without checkpoint.init_from"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The micro recipe's model exported as a Hugging Face folder, with a tokenizer.json."""
    import jax
    import jax.numpy as jnp

    from spillway.models.hf import to_hf
    from spillway.recipes.train.step import abstract_model

    # zero weights from the abstract model: the shapes are what matters here (an eager init takes 20 s)
    graphdef, abstract_state = abstract_model(get_recipe("tiny", MICRO))
    model = nnx.merge(graphdef, jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), abstract_state))
    folder = tmp_path_factory.mktemp("exported") / "hf"
    to_hf(model, folder)
    write_hf_tokenizer(folder)
    return folder


@pytest.fixture
def hf_folder(exported, tmp_path):
    return Path(shutil.copytree(exported, tmp_path / "hf"))


def test_a_hugging_face_folder_without_config_json_says_what_to_put_there(hf_folder, tmp_path, capsys):
    (hf_folder / "config.json").unlink()
    status, err, _ = run_cli("tiny", *micro_set(f"checkpoint.init_from=hf:{hf_folder}",
                                                f"checkpoint.dir={tmp_path / 'run'}"), capsys=capsys)
    assert status == 2 and len(err) == 1
    assert err[0].startswith(f"spillway train: error: checkpoint.init_from=hf:{hf_folder}: no config.json in "
                             f"{hf_folder}: a Hugging Face checkpoint folder holds the config.json")
    assert "config=" not in err[0]


def test_a_missing_or_misshapen_hugging_face_tensor_is_found_before_the_data_is_prepared(hf_folder, tmp_path,
                                                                                         capsys):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(hf_folder / "model.safetensors"))
    del tensors["model.layers.0.self_attn.q_proj.weight"]
    tensors["model.layers.1.mlp.down_proj.weight"] = np.ascontiguousarray(
        tensors["model.layers.1.mlp.down_proj.weight"][:, :32])
    save_file(tensors, str(hf_folder / "model.safetensors"), metadata={"format": "pt"})
    status, err, out = run_cli("tiny", *micro_set(f"checkpoint.init_from=hf:{hf_folder}",
                                                  f"data.cache_dir={tmp_path / 'cache'}",
                                                  f"checkpoint.dir={tmp_path / 'run'}"), capsys=capsys)
    assert status == 2
    assert err == [f"spillway train: error: checkpoint.init_from=hf:{hf_folder}: the Hugging Face checkpoint does "
                   f"not match the llama config (2 layers, vocab 512): missing tensors (1): "
                   f"['model.layers.0.self_attn.q_proj.weight'] shape mismatches (1): "
                   f"model.layers.1.mlp.down_proj.weight: checkpoint (32, 32), config expects (32, 64)"]
    assert "data:" not in out and not (tmp_path / "cache").exists()   # nothing was tokenized


@pytest.mark.parametrize("recipe_differs", [False, True], ids=["same-config", "recipe-differs"])
def test_a_base_models_save_without_its_head_is_named_as_such_not_as_a_config_to_fix(hf_folder, tmp_path, capsys,
                                                                                    recipe_differs):
    """LlamaModel.save_pretrained of an untied model: no "model." on its names and no lm_head. Where the recipe
    differs, the check of the checkpoint against its own config.json said to fix that config."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(hf_folder / "model.safetensors"))
    save_file({n.removeprefix("model."): t for n, t in tensors.items() if n != "lm_head.weight"},
              str(hf_folder / "model.safetensors"), metadata={"format": "pt"})
    other = ["model.mlp_hidden=96"] if recipe_differs else []
    status, err, _ = run_cli("tiny", *micro_set(f"checkpoint.init_from=hf:{hf_folder}",
                                                f"checkpoint.dir={tmp_path / 'run'}", *other), capsys=capsys)
    assert status == 2
    assert err == [f"spillway train: error: checkpoint.init_from=hf:{hf_folder}: the Hugging Face checkpoint has no "
                   f"output head (lm_head.weight) and its config.json says tie_word_embeddings=false: it was saved "
                   f"from a model without one (a base model, or a classifier); spillway reads a causal LM's "
                   f"checkpoint (LlamaForCausalLM), or a base model's whose head is its tied embedding"]


@pytest.mark.parametrize("argv, named", [(["export", "runs/tiny", ""], "OUT_DIR"),
                                         (["export", "", "out/tiny"], "CHECKPOINT"),
                                         (["generate", "", "--prompt", "x"], "CHECKPOINT")])
def test_an_empty_path_argument_is_refused_naming_it_not_read_as_the_working_directory(
        argv, named, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)   # an export into '' used to write config.json and model.safetensors here
    status = cli.main(argv)
    assert status == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"spillway {argv[0]}: error: {named} is empty: give a path"]
    assert list(tmp_path.iterdir()) == []


def test_a_data_cache_that_cannot_be_made_is_named_with_its_setting(tmp_path, monkeypatch, capsys):
    """A run started in a read-only folder said only ".cache: Permission denied"; here the cache's parent is a
    file, which fails the same way for any user (root passes permission checks)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("not a folder")
    status, err, _ = run_cli("tiny", *micro_set("data.cache_dir=a-file/cache", "train.steps=1",
                                                f"checkpoint.dir={tmp_path / 'run'}"), capsys=capsys)
    assert status == 2 and len(err) == 1
    assert err[0].startswith("spillway train: error: data.cache_dir 'a-file/cache' (") and \
        "cannot be made (Not a directory): point it at a folder you can write with --set data.cache_dir=DIR" in err[0]
    assert not (tmp_path / "run").exists()


def test_a_corpus_with_no_text_names_the_source(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("")
    status, err, _ = run_cli("tiny", "--set", "data.source=corpus", "--set", "train.steps=1",
                             "--set", f"data.cache_dir={tmp_path / 'cache'}", capsys=capsys)
    assert status == 2
    assert err == ["spillway train: error: data.source 'corpus': no non-empty text to train the tokenizer on"]


def test_a_peft_adapter_folder_is_named_as_one_wherever_a_model_or_run_is_expected(tmp_path, capsys):
    """`spillway export --adapter`'s folder (or any PEFT adapter) given where a model or a run goes: it said
    "no config.json: copy it there", and "no checkpoint found"; it adapts a base, which it names."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "gpt2"}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    run = tmp_path / "run"
    for init_from in (f"hf:{adapter}", str(adapter)):
        status, err, _ = run_cli("tiny", *micro_set(f"checkpoint.init_from={init_from}", f"checkpoint.dir={run}"),
                                 capsys=capsys)
        assert status == 2 and len(err) == 1, err
        assert "is a PEFT adapter (adapter_config.json)" in err[0] or "holds a PEFT adapter" in err[0], err
        assert "of gpt2" in err[0] or "adapts gpt2" in err[0], err
        assert not run.exists()
    for argv in (["generate", str(adapter), "--prompt", "x"], ["export", str(adapter), str(tmp_path / "out")]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "PEFT adapter (adapter_config.json)" in err[0] and "gpt2" in err[0], err
    assert not (tmp_path / "out").exists()


def test_generate_refuses_an_unusable_temperature_and_a_prompt_that_is_not_utf8(tmp_path, capsys):
    from spillway.recipes.cli import main

    for temperature, said in (("inf", "--temperature must be finite"), ("1e300", "--temperature must be finite")):
        assert main(["generate", str(tmp_path), "--prompt", "x", "--temperature", temperature]) == 2
        assert said in capsys.readouterr().err
    latin1 = b"caf\xe9".decode("utf-8", errors="surrogateescape")   # how Python hands such a shell argument over
    assert main(["generate", str(tmp_path), "--prompt", latin1]) == 2
    assert "--prompt holds bytes that are not UTF-8 (at character 4)" in capsys.readouterr().err


def test_plan_refuses_experts_on_a_dense_model_as_train_does(capsys):
    """A new user's finding: `spillway plan` accepted offload.params=experts on a dense model (and planned for
    minutes) where `spillway train` refused it in one line."""
    for command in ("plan", "train"):
        code = cli.main([command, "tiny", "--set", "offload.params=experts", "--set", "offload.optimizer_state=host"])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "offload.params=experts, but the model has no MoE block" in lines[0]
