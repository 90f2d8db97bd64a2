"""A LoRA run whose base is a step of another spillway run, while that run trains on.

The micro recipe (tests/micro_recipe.py) as the base run, saving every step and keeping one; a LoRA run on it;
then the base run trains on. Its retention keeps the step the LoRA run stands on (recipes/train/base_pins.py),
the LoRA run's own command resumes on that step (not the base run's newest), an adapter export needs no base
weights, a fine-tune from the LoRA run is one line saying how, and once the LoRA run's folder is gone the
pinned step is deleted at the base run's next save as any other.
"""

import json
import shutil

from spillway.recipes import cli
from tests.micro_recipe import micro_overrides


def _train(cache, run, *extra):
    sets = micro_overrides(cache, run, "checkpoint.every_steps=1", "checkpoint.keep=1", *extra)
    return cli.main(["train", "tiny", *[arg for item in sets for arg in ("--set", item)]])


def _steps(run):
    return sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())


def test_a_lora_run_keeps_its_base_step_and_resumes_by_the_same_command(micro_data_cache, tmp_path, capsys):
    base, lora = tmp_path / "base", tmp_path / "lora"
    assert _train(micro_data_cache, base, "train.steps=2") == 0
    lora_sets = (f"checkpoint.init_from={base}", "lora.rank=4", "lora.targets=q_proj,v_proj")
    assert _train(micro_data_cache, lora, *lora_sets, "train.steps=2") == 0
    pinned = json.loads((lora / "checkpoints" / "2" / "recipe" / "recipe.json").read_text())["checkpoint"]
    assert pinned["init_from"] == str(base / "checkpoints" / "2")

    assert _train(micro_data_cache, base, "train.steps=4") == 0   # the base run trains on, keeping one step
    assert _steps(base) == [2, 4]   # ... and the one the LoRA run stands on

    capsys.readouterr()
    assert _train(micro_data_cache, lora, *lora_sets, "train.steps=3") == 0   # the command that started it
    out = capsys.readouterr().out
    assert f"resumed from {lora / 'checkpoints' / '2'} at step 2" in out
    # the base is read again, but nothing starts afresh (it said "fresh optimizer state and schedule")
    assert f"LoRA base: {base / 'checkpoints' / '2'} (weights of step 2), read at every start" in out
    assert "fresh optimizer state" not in out
    resumed = json.loads((lora / "checkpoints" / "3" / "recipe" / "recipe.json").read_text())["checkpoint"]
    assert resumed["init_from"] == pinned["init_from"]   # still the step it started on, not the base's newest

    # a full fine-tune from the LoRA run: its steps hold the adapters alone; one line saying how
    assert _train(micro_data_cache, tmp_path / "full", f"checkpoint.init_from={lora}", "train.steps=1") == 2
    err = capsys.readouterr().err
    assert "that run trained LoRA adapters" in err and "spillway export" in err and "Traceback" not in err
    assert not (tmp_path / "full").exists()

    # the adapters come out without the base's weights: here the base step is gone
    shutil.move(base / "checkpoints" / "2", tmp_path / "away")
    assert cli.main(["export", str(lora), str(tmp_path / "adapter"), "--adapter"]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert "transformers does not load" in out and "no longer there" in out
    shutil.move(tmp_path / "away", base / "checkpoints" / "2")

    shutil.rmtree(lora)   # the LoRA run deleted: its pin holds nothing, the next save deletes the step
    assert _train(micro_data_cache, base, "train.steps=5") == 0
    assert _steps(base) == [5]


def test_a_lora_run_generates_and_exports_from_where_the_project_tree_moved(micro_data_cache, tmp_path, capsys):
    """The base run and the LoRA run moved together (a project folder on another disk): the LoRA run's pinned
    base path was gone, and generate and export said so. They find it where it was relative to the run."""
    base, lora = tmp_path / "project" / "base", tmp_path / "project" / "lora"
    assert _train(micro_data_cache, base, "train.steps=1") == 0
    assert _train(micro_data_cache, lora, f"checkpoint.init_from={base}", "lora.rank=4", "train.steps=1") == 0
    shutil.move(tmp_path / "project", tmp_path / "moved")
    capsys.readouterr()
    assert cli.main(["generate", str(tmp_path / "moved" / "lora"), "--prompt", "The", "--tokens", "3"]) == 0, \
        capsys.readouterr().err
    assert cli.main(["export", str(tmp_path / "moved" / "lora"), str(tmp_path / "hf")]) == 0, capsys.readouterr().err
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    # other weights at that place: named as such, not as a base that "does not exist any more"
    assert _train(micro_data_cache, tmp_path / "other", "train.steps=1", "train.seed=7") == 0
    shutil.rmtree(tmp_path / "moved" / "base")
    shutil.move(tmp_path / "other", tmp_path / "moved" / "base")
    capsys.readouterr()
    assert cli.main(["generate", str(tmp_path / "moved" / "lora"), "--prompt", "The", "--tokens", "3"]) == 2
    err = capsys.readouterr().err
    assert "is gone, and " in err and "holds other weights than those its adapters were trained on" in err, err


def test_a_base_folder_that_cannot_be_written_is_a_warning(tmp_path):
    from spillway.recipes.train.base_pins import pinned_steps, record_pin

    step = tmp_path / "base" / "checkpoints" / "7"
    step.mkdir(parents=True)
    (tmp_path / "base" / "pinned_by").write_text("a file where the records' folder goes")
    said = []
    record_pin(step, tmp_path / "lora", say=said.append)
    assert len(said) == 1 and said[0].startswith("warning: cannot record") and "checkpoint.keep" in said[0]
    assert pinned_steps(step.parent) == set()
    # an hf: folder or a loose step folder is no run that deletes steps: nothing recorded, nothing said
    record_pin(tmp_path / "loose" / "7", tmp_path / "lora", say=said.append)
    assert len(said) == 1 and not (tmp_path / "loose").exists()


def test_a_pin_survives_the_base_run_and_the_lora_run_moved_together(tmp_path):
    """The record named the LoRA run by its absolute path: with the project folder moved, the LoRA run was
    "gone" and the base run's next save deleted the step its adapters stand on."""
    from spillway.recipes.train.base_pins import pinned_steps, record_pin

    step = tmp_path / "project" / "base" / "checkpoints" / "7"
    step.mkdir(parents=True)
    (tmp_path / "project" / "lora").mkdir()
    record_pin(step, tmp_path / "project" / "lora")
    shutil.move(tmp_path / "project", tmp_path / "moved")
    assert pinned_steps(tmp_path / "moved" / "base" / "checkpoints") == {7}
    shutil.rmtree(tmp_path / "moved" / "lora")   # the LoRA run deleted: its pin holds nothing
    assert pinned_steps(tmp_path / "moved" / "base" / "checkpoints") == set()


def test_a_pin_made_through_a_symlinked_project_folder_names_the_lora_run_within_it(tmp_path):
    from spillway.recipes.train.base_pins import pinned_steps, record_pin

    step = tmp_path / "real" / "base" / "checkpoints" / "7"
    step.mkdir(parents=True)
    (tmp_path / "real" / "lora").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    record_pin(step, tmp_path / "link" / "lora")   # the LoRA run named by the link, its base resolved
    (tmp_path / "link").unlink()
    shutil.move(tmp_path / "real", tmp_path / "moved")
    assert pinned_steps(tmp_path / "moved" / "base" / "checkpoints") == {7}


def test_the_command_that_started_a_lora_run_resumes_it_in_the_moved_project(micro_data_cache, tmp_path, capsys,
                                                                             monkeypatch):
    """Named by the base run's folder (the run-folder form of init_from) after the base run trained on and the
    project moved: the saved step's absolute path was gone, so the base run's newest was taken and refused."""
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    lora_sets = ("checkpoint.init_from=runs/base", "lora.rank=4")
    assert _train(micro_data_cache, "runs/base", "train.steps=1") == 0
    assert _train(micro_data_cache, "runs/lora", *lora_sets, "train.steps=1") == 0
    assert _train(micro_data_cache, "runs/base", "train.steps=2") == 0   # the base's newest is now step 2
    monkeypatch.chdir(tmp_path)
    shutil.move(project, tmp_path / "moved")
    monkeypatch.chdir(tmp_path / "moved")
    capsys.readouterr()
    assert _train(micro_data_cache, "runs/lora", *lora_sets, "train.steps=2") == 0, capsys.readouterr().err
    resumed = json.loads((tmp_path / "moved" / "runs" / "lora" / "checkpoints" / "2" / "recipe" / "recipe.json")
                         .read_text())["checkpoint"]
    assert resumed["init_from"] == str(tmp_path / "moved" / "runs" / "base" / "checkpoints" / "1")


def test_a_pin_survives_the_lora_run_renamed(tmp_path):
    """`mv runs/lora runs/lora2`: the record's absolute and relative paths named nothing, and the base run's next
    save deleted the step the renamed run's adapters stand on. It is found by its id beside where it was."""
    from spillway.recipes.train.base_pins import pinned_steps, record_pin
    from spillway.recipes.train.run_identity import keep_run_identity

    step = tmp_path / "runs" / "base" / "checkpoints" / "7"
    step.mkdir(parents=True)
    (tmp_path / "runs" / "lora").mkdir()
    keep_run_identity(tmp_path / "runs" / "lora")   # as the LoRA run's start keeps it
    record_pin(step, tmp_path / "runs" / "lora")
    (tmp_path / "runs" / "lora").rename(tmp_path / "runs" / "lora2")
    (tmp_path / "runs" / "other").mkdir()   # another folder beside it: no id, not the run
    assert pinned_steps(tmp_path / "runs" / "base" / "checkpoints") == {7}
    shutil.rmtree(tmp_path / "runs" / "lora2")
    assert pinned_steps(tmp_path / "runs" / "base" / "checkpoints") == set()
