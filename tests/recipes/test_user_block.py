"""A recipe's own block class from the command line: `spillway train tiny --set block=module:Class`.

The block module is the README's subclassing example, taken from README.md
itself (so the README cannot drift), written to a folder that only this
process has on sys.path. It trains from the CLI, and the planner's compile
processes, which do not share this process's sys.path, import it too.
"""

import json
import re
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from micro_recipe import MICRO as MICRO_SETTINGS
from micro_recipe import SOURCE
from spillway.recipes import cli
from spillway.recipes.blocks import import_root, resolve_block_class
from spillway.recipes.registry import get_recipe

README = Path(__file__).resolve().parents[2] / "README.md"
MODULE = "readme_blocks"
MICRO = [f"data.source={SOURCE}", *MICRO_SETTINGS]


def readme_block_code() -> str:
    section = README.read_text().split("## Subclass a block", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)[0]


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """A folder holding readme_blocks.py; the module is forgotten afterwards so every test imports it afresh."""
    folder = tmp_path / "user_code"
    folder.mkdir()
    (folder / f"{MODULE}.py").write_text(readme_block_code())
    monkeypatch.setattr(sys, "path", list(sys.path))   # restored after the test, whatever it adds
    yield folder
    sys.modules.pop(MODULE, None)


@pytest.mark.slow   # a minute on 2 busy cores: builds the run and compiles its train step
def test_readme_block_trains_from_the_cli(user_folder, tmp_path, capsys):
    sys.path.insert(0, str(user_folder))
    run_dir = tmp_path / "run"
    sets = MICRO + [f"data.cache_dir={tmp_path / 'cache'}", "train.steps=4", f"checkpoint.dir={run_dir}",
                    f"block={MODULE}:ParallelBlock"]
    assert cli.main(["train", "tiny", *[arg for s in sets for arg in ("--set", s)]]) == 0, capsys.readouterr().err
    losses = [json.loads(line)["loss"] for line in open(run_dir / "metrics.jsonl")]
    assert len(losses) == 4 and np.isfinite(losses).all()
    saved = json.loads((run_dir / "checkpoints" / "4" / "recipe" / "recipe.json").read_text())
    assert saved["block"] == f"{MODULE}:ParallelBlock"


def test_recipe_builds_the_readme_blocks(user_folder):
    sys.path.insert(0, str(user_folder))
    for name in ("ParallelBlock", "PostNormBlock"):
        recipe = get_recipe("tiny", MICRO + [f"block={MODULE}:{name}"])
        model = nnx.eval_shape(lambda: recipe.build_model(nnx.Rngs(0)))
        assert type(model.layers.blocks).__name__ == name
        logits = nnx.eval_shape(lambda m: m(np.zeros((2, 16), np.int32)), model)
        assert logits.shape == (2, 16, 512)
    assert hasattr(model.layers.blocks, "post_attn_norm")


def test_the_current_directory_is_searched(user_folder, monkeypatch):
    # The `spillway` console script, unlike `python -m`, does not put the working directory on sys.path.
    monkeypatch.chdir(user_folder)
    for entry in ("", str(user_folder)):
        while entry in sys.path:
            sys.path.remove(entry)
    assert resolve_block_class(f"{MODULE}:ParallelBlock").__name__ == "ParallelBlock"
    assert import_root(f"{MODULE}:ParallelBlock") == str(user_folder)


@pytest.mark.parametrize("block,message", [
    ("no_such_module_xyz:Block", "block: no module 'no_such_module_xyz' on PYTHONPATH or in the current directory"),
    ("spillway.layers.norm:RMSNorm", "'spillway.layers.norm:RMSNorm' is a class RMSNorm based on \\['Module', "
                                     ".*not a subclass of spillway.layers.block.TransformerBlock"),
    ("spillway.layers.names:BLOCK_INPUT",
     "'spillway.layers.names:BLOCK_INPUT' is an object of type str, not a subclass"),
    (f"{MODULE}:Nope", f"block: module '{MODULE}' \\(.*{MODULE}.py\\) has no 'Nope'"),
    ("not a path", "block: 'not a path' is not a class path like 'package.module:Class'"),
])
@pytest.mark.parametrize("command", ["train", "plan"])
def test_a_bad_block_is_a_one_line_error(command, block, message, user_folder, capsys):
    sys.path.insert(0, str(user_folder))
    assert cli.main([command, "tiny", "--set", f"block={block}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err


def test_an_import_error_inside_the_module_is_reported_as_such(user_folder):
    (user_folder / "broken_blocks.py").write_text("import a_dependency_that_is_missing\n")
    sys.path.insert(0, str(user_folder))
    with pytest.raises(ValueError, match="importing 'broken_blocks' failed: No module named "
                                         "'a_dependency_that_is_missing'"):
        resolve_block_class("broken_blocks:Block")
    sys.modules.pop("broken_blocks", None)


def test_the_compile_process_reports_a_block_it_cannot_import(tmp_path):
    from spillway.recipes.plan import child

    recipe = get_recipe("tiny").to_dict()
    recipe["block"] = "module_only_the_parent_had:Block"
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"recipe": recipe, "import_paths": [], "target": "h200", "devices": 1,
                                   "candidates": []}))
    answer = child.main([str(request)])
    assert answer == {"error": "compile process: block: no module 'module_only_the_parent_had' on PYTHONPATH or "
                               f"in the current directory ({Path.cwd()})"}


def test_plan_compiles_a_block_found_only_on_this_process_path(user_folder, tmp_path, monkeypatch):
    from spillway.recipes.plan import plugin
    from spillway.recipes.plan.candidates import Candidate
    from spillway.recipes.plan.planner import plan

    if plugin.missing_reason() is not None:
        pytest.skip(f"deviceless GPU compiles need: {plugin.missing_reason()}")
    sys.path.insert(0, str(user_folder))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.chdir(tmp_path)   # not the module's folder: only the planner's request can tell the child
    recipe = get_recipe("tiny", MICRO + [f"block={MODULE}:ParallelBlock", "execution.attention_impl=flash"])
    result = plan(recipe, "h200", 1, plans=[Candidate.of("save_all", "device")])
    row = result.rows[0]
    assert row.error is None and row.report["hbm_bytes"] > 0, row.error


def test_a_run_of_a_users_block_is_not_exported_as_the_familys_model(user_folder, tmp_path, capsys):
    """Its weights would load into the family's own layers in transformers: another model, exported without a
    word (a new user's finding). One line, nothing written; from Python, to_hf names the parameters it cannot."""
    sys.path.insert(0, str(user_folder))
    step = tmp_path / "run" / "checkpoints" / "3"
    (step / "recipe").mkdir(parents=True)
    (step / "params").mkdir()
    (step / "_CHECKPOINT_METADATA").write_text("{}")
    (step / "recipe" / "recipe.json").write_text(get_recipe("tiny", MICRO + [f"block={MODULE}:ParallelBlock"]).to_json())
    assert cli.main(["export", str(step), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"trains the block {MODULE}:ParallelBlock" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()

    # from Python too: ParallelBlock has no parameter of its own, and to_hf wrote a plain Llama checkpoint that
    # transformers loaded as another network (a new user's finding)
    from spillway.models.hf import HFCheckpointError, to_hf
    for name in ("ParallelBlock", "PostNormBlock"):
        model = get_recipe("tiny", MICRO + [f"block={MODULE}:{name}"]).build_model(nnx.Rngs(0))
        with pytest.raises(HFCheckpointError, match=rf"the model's blocks are {MODULE}:{name}, not llama's own"):
            to_hf(model, tmp_path / "python_out")
        assert not (tmp_path / "python_out").exists()


def test_the_planner_offers_a_users_block_the_plans_it_tags(user_folder):
    """A new user's finding: `spillway plan tiny --set block=my_blocks:MoEBlock` offered the dense presets,
    every one a failed compile, and never the moe_* ones: the candidates came from the recipe's model."""
    from spillway.layers.offload import MOE_PRESETS, RematPlan
    from spillway.recipes.plan import candidates as plan_candidates

    section = README.read_text().split("## Subclass a block", 1)[1].split("\n## ", 1)[0]
    moe_code = next(code for code in re.findall(r"```python\n(.*?)```", section, re.S) if "moe_block(" in code)
    (user_folder / f"{MODULE}.py").write_text(readme_block_code() + "\n" + moe_code)
    sys.path.insert(0, str(user_folder))
    moe = get_recipe("tiny", [f"block={MODULE}:MoEBlock"])
    tags = plan_candidates.tagged_names(moe)
    plans = {c.activations for c in plan_candidates.candidates(moe)}
    assert set(MOE_PRESETS) <= plans and "save_dots" not in plans
    assert all(RematPlan.parse(plan).names() <= tags for plan in plans)
    # a dense block of the user's that tags what the zoo's do keeps every dense plan
    parallel = get_recipe("tiny", [f"block={MODULE}:ParallelBlock"])
    assert plan_candidates.preset_plans(parallel) == (plan_candidates.PRESET_PLANS, plan_candidates.HOST_COMPUTE_PLANS)


def test_a_saved_recipe_whose_block_module_is_elsewhere_says_where_to_run_from(user_folder, tmp_path, monkeypatch,
                                                                                capsys):
    """A new user's finding: a run trained with its own block, used from another folder, was "cannot be read by
    this version of spillway ... read it with the version that wrote it" (generate) and "not a spillway recipe"
    (a recipe.json): the module is what is missing, not a version."""
    from spillway.recipes.readable_step import saved_recipe
    from spillway.recipes.train import checkpoint

    sys.path.insert(0, str(user_folder))
    recipe = get_recipe("tiny", MICRO + [f"block={MODULE}:ParallelBlock"])
    step = tmp_path / "run" / "checkpoints" / "4"
    (step / "recipe").mkdir(parents=True)
    (step / "recipe" / "recipe.json").write_text(recipe.to_json())
    # the step's recipe as a step folder holds it (its arrays are never read for this)
    monkeypatch.setattr(checkpoint, "read_recipe_json", lambda step_dir: (step / "recipe" / "recipe.json").read_text())
    sys.path.remove(str(user_folder))
    sys.modules.pop(MODULE, None)
    monkeypatch.chdir(tmp_path)   # not the module's folder
    with pytest.raises(ValueError, match=rf"recipe.json: the run was trained with its own block, and block: no "
                                         rf"module '{MODULE}' .*: run this from the folder that holds that module, or "
                                         rf"put that folder on PYTHONPATH$"):
        saved_recipe(step)
    assert cli.main(["train", str(step / "recipe" / "recipe.json")]) == 2
    err = capsys.readouterr().err
    assert "the run was trained with its own block" in err and "not a spillway recipe" not in err


def test_a_users_block_is_counted_as_the_model_it_builds(tmp_path, monkeypatch):
    """A new user's finding: a recipe with the README's MoE block said "2.36M parameters" (the family's dense
    count) for a model of 5.9M, in the run's first line, the plan, and the update-on-host plans' pricing."""
    (tmp_path / "moe_blocks.py").write_text(
        "from spillway.layers.moe import MoEConfig\nfrom spillway.layers.moe_block import moe_block\n"
        "MoEBlock = moe_block(MoEConfig(d_model=192, num_experts=8, top_k=2, expert_hidden=256))\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    recipe = get_recipe("tiny", ["block=moe_blocks:MoEBlock"])
    model = nnx.eval_shape(lambda: recipe.build_model(nnx.Rngs(0)))
    built = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert recipe.num_params() == built != get_recipe("tiny").num_params()
    sys.modules.pop("moe_blocks", None)
