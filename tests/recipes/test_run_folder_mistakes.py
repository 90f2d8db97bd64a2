"""A run's folder met where something else was expected, or missing a part: what a new user is told.

* a step that is not there (removed by the run's retention, or a typo) lists the steps that are, for
  `generate`, `export` and a fine-tune's `checkpoint.init_from`; a run named as `hf:` names a folder
  (`generate hf:runs/tiny`, `export hf:runs/tiny`) is found, where "hf:runs/tiny does not exist" was said of it,
  and `checkpoint.init_from=hf:runs/tiny` says to drop the prefix, where it asked for the run's config.json;
* a run's folder (or a Hugging Face folder) given where a recipe goes (`spillway train runs/tiny`) was
  "unknown recipe 'runs/tiny'; did you mean 'tiny'?", which sent users to another run: it names the recipe file
  the run trained with;
* a run whose tokenizer copy was deleted was "not inside a spillway run directory", and its export wrote half a
  folder before failing: it says which tokenizer to put back, before anything is written;
* a run whose model no Hugging Face config holds (a Gemma 3 with an attention cap): its export wrote the record
  and the tokenizer, then refused, and the folder then refused every other run's export as "another run's".

The run folders here are laid out by hand as a run lays them out (recipes/train/checkpoint.py): no training.
"""

from __future__ import annotations

import json

import pytest

from spillway.recipes import cli
from spillway.recipes.export import export_run
from spillway.recipes.generate import generate_from_checkpoint
from spillway.recipes.registry import get_recipe
from spillway.recipes.train.errors import RunError


def fake_run(folder, steps=(2, 4), tokenizer: bool = True, named_tokenizer: str | None = "/data/tok.model",
             recipe: str = "tiny", overrides=(), init_from: str | None = None):
    """A run folder with the step folders `steps` (each with its recipe.json) and, if `tokenizer`, its copy."""
    recipe = get_recipe(recipe, list(overrides)).to_dict()
    recipe["data"]["tokenizer"] = named_tokenizer
    recipe["checkpoint"]["init_from"] = init_from
    for step in steps:
        (folder / "checkpoints" / str(step) / "params").mkdir(parents=True)
        (folder / "checkpoints" / str(step) / "recipe").mkdir()
        (folder / "checkpoints" / str(step) / "recipe" / "recipe.json").write_text(json.dumps(recipe))
    if tokenizer:
        (folder / "tokenizer.model").write_bytes(b"not read here")
    return folder


def error_of(argv, capsys) -> str:
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_step_that_is_not_there_lists_the_steps_that_are(tmp_path, capsys):
    run = fake_run(tmp_path / "run")
    listed = f"the steps in {run / 'checkpoints'}: 2, 4 (name one, or the run directory for the newest"
    for missing in (run / "checkpoints" / "6", run / "6"):   # the checkpoints/ left out too
        with pytest.raises(FileNotFoundError, match="does not exist; " + listed.replace("(", r"\(")):
            generate_from_checkpoint(str(missing), "x", max_new_tokens=1, temperature=0.0, top_p=1.0)
    assert listed in error_of(["export", str(run / "checkpoints" / "6"), str(tmp_path / "out")], capsys)
    assert not (tmp_path / "out").exists()
    line = error_of(["train", "tiny", "--set", f"checkpoint.init_from={run / 'checkpoints' / '1'}",
                     "--set", f"checkpoint.dir={tmp_path / 'fine'}"], capsys)
    assert "checkpoint.init_from" in line and listed in line
    with pytest.raises(FileNotFoundError) as nothing_beside:   # no run there: nothing to list
        generate_from_checkpoint(str(tmp_path / "nowhere" / "3"), "x", max_new_tokens=1, temperature=0.0, top_p=1.0)
    assert "steps in" not in str(nothing_beside.value)
    (run / "checkpoints" / "3.abandoned" / "params").mkdir(parents=True)   # set aside by a resume, not removed
    with pytest.raises(FileNotFoundError, match=r"steps in .*: 2, 4 \(.* 3.abandoned is that step, set aside"):
        generate_from_checkpoint(str(run / "checkpoints" / "3"), "x", max_new_tokens=1, temperature=0.0, top_p=1.0)


def test_a_quoted_home_path_is_read_as_the_shell_reads_it(tmp_path, monkeypatch):
    """`generate '~/run/checkpoints/6'` said step 6 did not exist, then listed it among the steps there."""
    monkeypatch.setenv("HOME", str(tmp_path))
    fake_run(tmp_path / "run", tokenizer=False)
    with pytest.raises(RunError, match="copy of its tokenizer is gone"):   # found: past the path checks
        generate_from_checkpoint("~/run/checkpoints/4", "x", max_new_tokens=1, temperature=0.0, top_p=1.0)


def test_a_run_named_as_hf_names_a_folder_is_found(tmp_path, monkeypatch):
    fake_run(tmp_path / "run", tokenizer=False)
    monkeypatch.chdir(tmp_path)
    for named in (f"hf:{tmp_path / 'run'}", "hf:run", "hf:run/checkpoints/4"):
        with pytest.raises(RunError, match="copy of its tokenizer is gone"):   # found: past the path checks
            generate_from_checkpoint(named, "x", max_new_tokens=1, temperature=0.0, top_p=1.0)
        with pytest.raises(RunError, match="copy of its tokenizer is gone"):   # export: "hf:run: no such directory"
            export_run(named, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_fine_tune_from_a_run_named_as_hf_says_to_drop_the_prefix(tmp_path, capsys, monkeypatch):
    """init_from=hf:RUN was "no config.json in RUN ... copy it there (from the checkpoint's Hub repository)"."""
    fake_run(tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    for named, meant in (("hf:run", "run"), ("hf:run/checkpoints/4", "run/checkpoints/4")):
        line = error_of(["train", "tiny", "--set", f"checkpoint.init_from={named}", "--set", "checkpoint.dir=fine"],
                        capsys)
        assert f"checkpoint.init_from='{named}' names a spillway run, not a Hugging Face checkpoint" in line
        assert line.endswith(f"write checkpoint.init_from={meant}") and "config.json in" not in line
    assert not (tmp_path / "fine").exists()


@pytest.mark.parametrize("command", ["recipes", "train", "plan", "prepare"])
def test_a_runs_folder_given_as_a_recipe_names_the_recipe_it_trained_with(tmp_path, capsys, command):
    run = fake_run(tmp_path / "run")
    line = error_of([command, str(run)], capsys)
    assert f"{run} is a spillway run's folder, not a recipe: the recipe it trained with is " \
           f"{run / 'checkpoints' / '4' / 'recipe' / 'recipe.json'}" in line and "did you mean" not in line
    step = run / "checkpoints" / "2"
    assert f"{step} is a step folder of a spillway run, not a recipe: the recipe it trained with is " \
           f"{step / 'recipe' / 'recipe.json'}" in error_of([command, str(step)], capsys)


def test_a_steps_recipe_file_gone_with_its_step_lists_the_steps_there(tmp_path, capsys):
    """The step folder whose recipe.json a user trained from is removed by the run's retention."""
    run = fake_run(tmp_path / "run")
    line = error_of(["train", str(run / "checkpoints" / "1" / "recipe" / "recipe.json")], capsys)
    assert "recipe.json does not exist; the steps in" in line and ": 2, 4 (" in line


def test_other_folders_given_as_a_recipe_say_what_they_are(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    assert f"checkpoint.init_from=hf:{hf}" in error_of(["recipes", str(hf)], capsys)
    assert "is a folder, not a recipe: give a registered name" in error_of(["recipes", str(tmp_path)], capsys)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/base", "r": 4}))
    assert "is a PEFT adapter (adapter_config.json) of org/base, not a recipe" in \
        error_of(["train", str(adapter)], capsys)


def test_a_run_whose_tokenizer_copy_is_gone_says_which_to_put_back_and_exports_nothing(tmp_path, capsys):
    run = fake_run(tmp_path / "run", tokenizer=False)
    with pytest.raises(RunError, match=r"is a spillway run whose copy of its tokenizer is gone .* copy the tokenizer "
                                       r"it trained with back into it"):   # /data/tok.model is not there either
        generate_from_checkpoint(str(run), "x", max_new_tokens=1, temperature=0.0, top_p=1.0)
    with pytest.raises(RunError, match="copy of its tokenizer is gone"):
        export_run(str(run), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()   # it wrote the weights, then failed at the generation ids
    (tmp_path / "tok.model").write_bytes(b"the tokenizer the recipe names")
    named = fake_run(tmp_path / "named", tokenizer=False, named_tokenizer=str(tmp_path / "tok.model"))
    with pytest.raises(RunError, match=rf"copy {tmp_path / 'tok.model'} back into it"):
        generate_from_checkpoint(str(named), "x", max_new_tokens=1, temperature=0.0, top_p=1.0)
    own = fake_run(tmp_path / "own", tokenizer=False, named_tokenizer=None)   # trained its own: trained again
    with pytest.raises(RunError, match=r"it trained its tokenizer on its corpus, and trains it again, the same, "
                                       rf"when it resumes .*checkpoint.dir={own}"):
        generate_from_checkpoint(str(own), "x", max_new_tokens=1, temperature=0.0, top_p=1.0)


def test_a_fine_tunes_lost_tokenizer_is_the_one_of_the_run_it_started_from(tmp_path):
    """A fine-tune's data.tokenizer is its own copy: the advice named the very file that was gone."""
    base = fake_run(tmp_path / "base")
    tuned = tmp_path / "tuned"
    fake_run(tuned, tokenizer=False, named_tokenizer=str(tuned / "tokenizer.model"), init_from=str(base))
    with pytest.raises(RunError, match=rf"copy {base / 'tokenizer.model'} back into it \(the tokenizer it started "
                                       rf"with\)"):
        generate_from_checkpoint(str(tuned), "x", max_new_tokens=1, temperature=0.0, top_p=1.0)


def test_a_model_no_config_json_holds_is_refused_before_the_export_writes_anything(tmp_path):
    run = fake_run(tmp_path / "run", recipe="gemma3_tiny", overrides=["model.attn_softcap=50"])
    with pytest.raises(ValueError, match="transformers' Gemma 3 does not apply attn_logit_softcapping"):
        export_run(str(run), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
