"""`spillway export` into a training run's own folders is refused in one line, and the run is left as it was.

`spillway export runs/sft runs/sft` wrote config.json and model.safetensors into
the run directory and then stopped on Python's "are the same file"; exporting into
another run's directory replaced that run's tokenizer_config.json (its chat
template and the BOS rule it resumes with). Each is now one line, before anything
is read or written; a new folder inside a run directory stays a fine target. The
step folder is a stub (a recipe and orbax's marker): the refusal comes before any
weight is read, so no model is built.
"""

import hashlib
import json
from pathlib import Path

import pytest

from spillway.recipes import cli
from spillway.recipes.export import _run_id
from spillway.recipes.registry import get_recipe


def stub_run(run: Path) -> Path:
    """A run directory as training leaves it, with one finalised step folder (no weights: never read here)."""
    step = run / "checkpoints" / "3"
    (step / "recipe").mkdir(parents=True)
    (step / "params").mkdir()   # what marks a step folder
    (step / "recipe" / "recipe.json").write_text(get_recipe("tiny").to_json())
    (step / "_CHECKPOINT_METADATA").write_text("{}")
    (run / "tokenizer_config.json").write_text('{"eos_token": "</s>", "add_bos_token": false}\n')
    (run / "metrics.jsonl").write_text('{"step": 3, "loss": 5.0}\n')
    return step


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("target", ["run", "other", "run/checkpoints", "run/checkpoints/3"])
def test_an_export_into_a_runs_own_folders_is_one_line_and_writes_nothing(tmp_path, capsys, target):
    stub_run(tmp_path / "run")
    stub_run(tmp_path / "other")
    before = digests(tmp_path)
    assert cli.main(["export", str(tmp_path / "run" / "checkpoints" / "3"), str(tmp_path / target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"spillway export: error: {tmp_path / target} is "), err
    assert ("a training run's directory" if target in ("run", "other") else "inside the checkpoints folder") in err[0]
    assert digests(tmp_path) == before


def test_a_new_folder_inside_a_run_directory_is_a_fine_target(tmp_path):
    from spillway.recipes.export import _check_not_a_run

    stub_run(tmp_path / "run")
    _check_not_a_run(tmp_path / "run" / "hf")
    _check_not_a_run(tmp_path / "elsewhere")


def test_the_filesystem_root_and_the_home_folder_are_no_export_targets(tmp_path, monkeypatch):
    """`spillway export runs/t /` wrote config.json, model.safetensors and the tokenizer files into `/`."""
    from spillway.models.hf import HFCheckpointError
    from spillway.recipes.export import _check_not_a_run

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    with pytest.raises(HFCheckpointError, match="^/ is the filesystem's root: export into a folder of its own"):
        _check_not_a_run(Path("/"))
    with pytest.raises(HFCheckpointError, match="is your home folder: export into a folder of its own, e.g. "):
        _check_not_a_run(tmp_path / "home")
    _check_not_a_run(tmp_path / "home" / "hf")


@pytest.mark.parametrize("left", ["tokenizer.json", "chat_template.jinja", "added_tokens.json"])
def test_another_checkpoints_files_that_transformers_would_read_beside_the_export_are_refused(tmp_path, capsys,
                                                                                              left):
    """A folder transformers saved (config.json, model.safetensors, its tokenizer.json, chat_template.jinja,
    added_tokens.json): the export replaces config and weights (and generation_config.json, which it writes),
    but a tokenizer.json left beside the run's tokenizer.model is what AutoTokenizer loads, chat_template.jinja
    overrides the run's template and added_tokens.json adds tokens the run never had."""
    step = stub_run(tmp_path / "run")
    (tmp_path / "run" / "tokenizer.model").write_bytes(b"the run's sentencepiece model")
    folder = tmp_path / "saved_by_transformers"
    folder.mkdir()
    for name in ("config.json", "model.safetensors", left):
        (folder / name).write_text("{}")
    before = digests(folder)
    assert cli.main(["export", str(step), str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"spillway export: error: {folder} already holds another checkpoint ({left}): export into an "
                   f"empty folder, or delete those files first"]
    assert digests(folder) == before


def test_weights_no_export_of_this_run_recorded_are_refused_and_kept(tmp_path, capsys):
    """`spillway export runs/a out` then `spillway export runs/b out` replaced a's export without a word; a
    downloaded checkpoint (config.json, model.safetensors) was overwritten the same way."""
    step = stub_run(tmp_path / "run")
    downloaded = tmp_path / "downloaded"
    downloaded.mkdir()
    for name in ("config.json", "model.safetensors"):
        (downloaded / name).write_text("{}")
    other_export = tmp_path / "other_export"
    other_export.mkdir()
    for name in ("config.json", "model.safetensors"):
        (other_export / name).write_text("{}")
    (other_export / "spillway_export.json").write_text(json.dumps({"run": "elsewhere", "run_id": _run_id(
        str(tmp_path / "elsewhere")), "step": "3", "adapter": False, "finished": True}))
    for folder, named in ((downloaded, "that no spillway export recorded"),
                          (other_export, f"holds an export of another run ('elsewhere', not {tmp_path / 'run'})")):
        before = digests(folder)
        assert cli.main(["export", str(step), str(folder)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and named in err[0], err
        assert digests(folder) == before


def test_a_folder_of_files_the_export_would_replace_is_refused_and_others_are_kept(tmp_path, capsys):
    """A tokenizer download (tokenizers/<repo>: tokenizer.model, tokenizer_config.json, generation_config.json)
    was overwritten by the run's files without a word; a README or a git clone's .git is no reason to refuse."""
    step = stub_run(tmp_path / "run")
    (tmp_path / "run" / "tokenizer.model").write_bytes(b"the run's sentencepiece model")
    download = tmp_path / "tokenizers" / "repo"
    download.mkdir(parents=True)
    (download / "tokenizer.model").write_bytes(b"the user's own")
    (download / "generation_config.json").write_text('{"mine": 1}')
    before = digests(download)
    assert cli.main(["export", str(step), str(download)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds tokenizer.model, generation_config.json that no spillway export " \
        "recorded" in err[0], err
    assert digests(download) == before
    from spillway.recipes.export import _check_earlier_export, _source_of
    clone = tmp_path / "clone"
    (clone / ".git").mkdir(parents=True)
    (clone / "README.md").write_text("# my model")
    assert _check_earlier_export(clone, "model.safetensors", _source_of(tmp_path / "run", step),
                                 ["tokenizer.model", "tokenizer_config.json"]) is None


def test_an_export_of_the_same_run_is_replaced_and_named(tmp_path):
    from spillway.recipes.export import _check_earlier_export, _source_of

    step = stub_run(tmp_path / "run")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_text("{}")
    source = _source_of(tmp_path / "run", step)
    record = {"run": "run", "run_id": _run_id(source), "step": "3", "adapter": False, "finished": True}
    (out / "spillway_export.json").write_text(json.dumps(record))
    assert _check_earlier_export(out, "model.safetensors", source, []) == "its export of step 3"
    (out / "spillway_export.json").write_text(json.dumps({**record, "finished": False}))
    assert _check_earlier_export(out, "model.safetensors", source, []) == "its unfinished export of step 3"
    assert _check_earlier_export(tmp_path / "run", "model.safetensors", source, []) is None   # nothing of that kind


def test_a_fine_tune_at_a_shorter_length_exports_the_bases_context(tmp_path):
    """A run fine-tuned from an hf: base at a shorter model.max_seq_len exported that length as
    max_position_embeddings: transformers then warned past it, although RoPE weights serve the base's."""
    from spillway.recipes.export import _keep_base_context

    base, out = tmp_path / "base", tmp_path / "out"
    base.mkdir()
    out.mkdir()
    (base / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    (out / "config.json").write_text(json.dumps({"max_position_embeddings": 128, "hidden_size": 64}))
    recipe = get_recipe("tiny", [f"checkpoint.init_from=hf:{base}", "model.max_seq_len=128"])
    _keep_base_context(recipe, out)
    assert json.loads((out / "config.json").read_text()) == {"max_position_embeddings": 256, "hidden_size": 64}
    longer = get_recipe("tiny", [f"checkpoint.init_from=hf:{base}", "model.max_seq_len=512"])
    (out / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    _keep_base_context(longer, out)   # a longer fine-tune keeps its own
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 512
    _keep_base_context(get_recipe("tiny", [f"checkpoint.init_from=hf:{tmp_path / 'gone'}"]), out)   # not found: kept
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 512


def test_the_adapters_base_is_named_by_its_hub_repository_or_an_absolute_path(tmp_path, monkeypatch):
    """adapter_config.json named the base folder as typed when training (`hf/llama`), relative to a directory
    the loading user may not be in."""
    from spillway.recipes.export import _base_name

    monkeypatch.chdir(tmp_path)
    assert _base_name(get_recipe("tiny", ["checkpoint.init_from=hf:hf/llama"])) == str(tmp_path / "hf" / "llama")
    assert _base_name(get_recipe("tiny", ["checkpoint.init_from=hf:hf/llama",
                                          "checkpoint.init_from_origin=meta-llama/Llama-3.2-1B"])) == \
        "meta-llama/Llama-3.2-1B"


def test_an_adapter_export_of_a_multimodal_gemma3_needs_no_base_folder(tmp_path):
    """`export --adapter` reads the adapters alone, and the merged export's error sends a run whose base has gone
    there; for a Gemma 3 it read the base's config.json (multimodal or not) and refused, sending the user back
    to the merged export: the config kept in the run folder when the run started answers instead."""
    from spillway.recipes.export import MULTIMODAL_TEXT_TOWER, _text_tower
    from spillway.recipes.train.base_generation import keep_base_config

    base, run = tmp_path / "gemma3", tmp_path / "run"
    base.mkdir(), run.mkdir()
    recipe = get_recipe("gemma3_tiny", [f"checkpoint.init_from=hf:{base}", "lora.rank=4"])
    (base / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": {}}))
    keep_base_config(recipe, run)
    (base / "config.json").unlink()
    assert _text_tower(recipe, run) == MULTIMODAL_TEXT_TOWER


def test_a_merged_export_of_a_multimodal_gemma3_run_says_it_holds_the_text_model_alone(tmp_path):
    """The base loaded as an image-text model; the export is its text tower, which the export line did not say."""
    from spillway.recipes.export import _text_only_note

    base = tmp_path / "gemma3"
    base.mkdir()
    recipe = get_recipe("gemma3_tiny", [f"checkpoint.init_from=hf:{base}"])
    (base / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": {}}))
    assert "vision tower is not in it" in _text_only_note(recipe, None)
    (base / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}))
    assert _text_only_note(recipe, None) == ""


def test_an_adapter_of_a_multimodal_gemma3_names_its_text_layers_and_a_dense_mlp_beside_experts_is_refused(tmp_path):
    """PEFT names a multimodal Gemma 3's text layers model.language_model.layers.N: an adapter named
    model.layers.N loaded there with no effect (PEFT only warned of missing keys). A Qwen3-MoE's dense MLP
    shares its projections' names with the routed experts, which PEFT on transformers 5 targets instead."""
    from spillway.layers.errors import ConfigError
    from spillway.recipes.export import MULTIMODAL_TEXT_TOWER, _refuse_names_peft_reads_as_experts, _text_tower

    base = tmp_path / "gemma3"
    base.mkdir()
    recipe = get_recipe("gemma3_tiny", [f"checkpoint.init_from=hf:{base}", "lora.rank=4"])
    (base / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": {}}))
    assert _text_tower(recipe, None) == MULTIMODAL_TEXT_TOWER
    (base / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}))
    assert _text_tower(recipe, None) == "model."
    (base / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"--adapter: the base's .*config.json cannot be read .* put the base back"):
        _text_tower(recipe, tmp_path / "run")
    assert _text_tower(get_recipe("tiny", [f"checkpoint.init_from=hf:{base}", "lora.rank=4"]), None) == "model."

    moe = get_recipe("qwen3_moe_tiny", [f"checkpoint.init_from=hf:{base}", "lora.rank=4"])
    with pytest.raises(ConfigError, match=r"adapts the dense MLP \(model.layers.N.mlp.gate_proj\) of a model with "
                                          r"routed experts"):
        _refuse_names_peft_reads_as_experts(moe, "model.layers.{i}.mlp.gate_proj")
    _refuse_names_peft_reads_as_experts(moe, "model.layers.{i}.self_attn.q_proj")
    _refuse_names_peft_reads_as_experts(recipe, "model.layers.{i}.mlp.gate_proj")   # no experts: fine


def test_a_moved_run_replaces_its_own_earlier_export_and_still_not_another_runs(tmp_path):
    """The record named the run by its path: a run moved elsewhere (the project tree relocated) was "another
    run" for its own export folder. The id kept in the run folder goes with it; an export recorded by the
    run's path before it kept an id is still its own."""
    from spillway.models.hf import HFCheckpointError
    from spillway.recipes.export import _check_earlier_export, _source_of, _write_record
    from spillway.recipes.train.run_identity import keep_run_identity, run_identity

    stub_run(tmp_path / "run")
    kept = keep_run_identity(tmp_path / "run")
    assert keep_run_identity(tmp_path / "run") == kept == run_identity(tmp_path / "run")   # written once
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model.safetensors").write_text("{}")
    _write_record(out, _source_of(tmp_path / "run", None), "3", adapter=False, finished=True)
    record = (out / "spillway_export.json").read_text()
    assert kept in record and str(tmp_path) not in record
    (tmp_path / "run").rename(tmp_path / "moved")
    assert _check_earlier_export(out, "model.safetensors", _source_of(tmp_path / "moved", None),
                                 []) == "its export of step 3"

    stub_run(tmp_path / "old")   # an export made before the run kept an id: recorded by its path
    _write_record(out, _source_of(tmp_path / "old", None), "3", adapter=False, finished=True)
    keep_run_identity(tmp_path / "old")
    assert _check_earlier_export(out, "model.safetensors", _source_of(tmp_path / "old", None), []) is not None

    stub_run(tmp_path / "another")
    keep_run_identity(tmp_path / "another")
    with pytest.raises(HFCheckpointError, match="holds an export of another run"):
        _check_earlier_export(out, "model.safetensors", _source_of(tmp_path / "another", None), [])


def test_a_copied_run_is_another_run_for_the_originals_export(tmp_path):
    """`cp -r runs/b runs/c` carried run b's id: run c, trained on, replaced b's export without a word."""
    import shutil

    from spillway.models.hf import HFCheckpointError
    from spillway.recipes.export import _check_earlier_export, _source_of, _write_record
    from spillway.recipes.train.run_identity import keep_run_identity, run_identity

    stub_run(tmp_path / "b")
    original = keep_run_identity(tmp_path / "b")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model.safetensors").write_text("{}")
    _write_record(out, _source_of(tmp_path / "b", None), "3", adapter=False, finished=True)
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    assert run_identity(tmp_path / "c") is None and run_identity(tmp_path / "b") == original
    with pytest.raises(HFCheckpointError, match="holds an export of another run"):
        _check_earlier_export(out, "model.safetensors", _source_of(tmp_path / "c", None), [])
    copied = keep_run_identity(tmp_path / "c")   # the copy trains: an id of its own
    assert copied != original and run_identity(tmp_path / "c") == copied
    assert keep_run_identity(tmp_path / "b") == original   # the original keeps its own
    with pytest.raises(HFCheckpointError, match="holds an export of another run"):
        _check_earlier_export(out, "model.safetensors", _source_of(tmp_path / "c", None), [])
    assert _check_earlier_export(out, "model.safetensors", _source_of(tmp_path / "b", None), []) is not None
