"""A checkpoint's layout on disk is what the code before the restructure of issue 18 wrote.

earlier_checkpoint_layout.json holds, for a micro recipe trained three steps with the optimizer
state on device, in host memory, and updated in the next forward pass, what orbax recorded in the step
folder written by the code before the restructure (commit 2ba1bb8): its items, every params and
opt_state array's tree path, shape and dtype, the meta keys and the recipe.json fields. The same runs
with today's code must write the same, so a checkpoint of an earlier run restores (recipe.json gained
one field, `sources`, which a resume may see change, recipes/train/resume.py).
"""

import json
from pathlib import Path

import jax
import orbax.checkpoint as ocp
import pytest

from micro_recipe import micro
from spillway.recipes.train.loop import train

BEFORE = json.loads((Path(__file__).parent / "earlier_checkpoint_layout.json").read_text())
# The layout does not depend on the learning-rate schedule (recorded with warmup 1 and the default rate).
THREE_STEPS = ["train.steps=3", "checkpoint.every_steps=3"]
CASES = {"state_on_device": [], "state_on_host": ["offload.optimizer_state=host"],
         "update_in_next_forward": ["offload.optimizer_state=host", "offload.update=next_forward"]}


def _fields(tree, prefix=""):
    if isinstance(tree, dict):
        return [field for key, value in tree.items() for field in _fields(value, f"{prefix}{key}.")]
    return [prefix[:-1]]


def checkpoint_layout(step_dir: Path) -> dict:
    """What a step folder holds, as orbax recorded it (no array is read)."""
    arrays = {}
    for item in ("params", "opt_state"):
        tree = ocp.StandardCheckpointer().metadata(step_dir / item).item_metadata
        arrays[item] = {jax.tree_util.keystr(path): [list(leaf.shape), str(leaf.dtype)]
                        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
    return {"items": sorted(p.name for p in step_dir.iterdir() if p.is_dir()), "arrays": arrays,
            "meta": sorted(json.loads((step_dir / "meta" / "metadata").read_text())),
            "recipe_fields": sorted(_fields(json.loads((step_dir / "recipe" / "recipe.json").read_text())))}


@pytest.fixture(scope="module")
def layout_of(tmp_path_factory, micro_data_cache):
    """case -> the layout today's code writes for it (each micro run trained once, when first asked for)."""
    found = {}

    def layout(case):
        if case not in found:
            run = tmp_path_factory.mktemp(case) / "run"
            train(micro(micro_data_cache, run, *THREE_STEPS, *CASES[case]), progress=False)
            found[case] = checkpoint_layout(run / "checkpoints" / "3")
        return found[case]
    return layout


# The update in the next forward pass in the default suite (the state's most involved path, about 20 s);
# the two others in the slow one.
@pytest.mark.parametrize("case", ["update_in_next_forward", pytest.param("state_on_device", marks=pytest.mark.slow),
                                  pytest.param("state_on_host", marks=pytest.mark.slow)])
def test_the_step_folder_holds_what_the_code_before_wrote(layout_of, case):
    after, before = layout_of(case), BEFORE[case]
    assert after["items"] == before["items"]
    assert after["arrays"] == before["arrays"]
    assert after["meta"] == before["meta"]
    # The fields added since, each with a default that an older recipe.json loads with: `sources` (issue 18)
    # and the MoE auxiliary-loss coefficients (issue 21, 0 = off); the fine-tuning data fields (issue 28:
    # format text, no chat template, packing, no document mask, every token a target), LoRA (rank 0 = off),
    # the BOS (None: as the tokenizer does) and the moments' dtype (float32), issues 28-30; where a base model
    # comes from, for the offline message (checkpoint.init_from_origin, None), issue 28; the weights kept
    # across the turn (offload.params_keep, 0 = none), issue 29; where the deferred update's pending gradients
    # wait (offload.pending_gradients, "host" = as before), issue 27; the split a run reads (data.split,
    # "train" = as before); a LoRA run's base digest (checkpoint.init_from_digest, None = not checked) and
    # where its base was from its run folder (checkpoint.init_from_relative, None = not looked for).
    assert set(after["recipe_fields"]) - set(before["recipe_fields"]) == {
        "sources", "aux_loss.load_balancing", "aux_loss.router_z",
        "data.format", "data.chat_template", "data.train_on_prompt", "data.document_mask", "data.packing",
        "data.overlong", "data.split", "data.add_bos", "lora.rank", "lora.alpha", "lora.dropout", "lora.targets",
        "optimizer.moment_dtype", "checkpoint.init_from_origin", "checkpoint.init_from_digest", "offload.params_keep",
        "offload.pending_gradients", "checkpoint.init_from_relative"}
    assert set(before["recipe_fields"]) <= set(after["recipe_fields"])


def test_the_optimizer_state_is_saved_alike_whatever_its_placement():
    """One whole array per state leaf (LayerHalves joined) in every case the old code wrote."""
    assert BEFORE["state_on_device"]["arrays"] == BEFORE["state_on_host"]["arrays"] == \
        BEFORE["update_in_next_forward"]["arrays"]
