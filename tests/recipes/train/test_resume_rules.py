"""recipes/train/resume.py: which recipe fields a resumed run may change, on real recipe dicts."""

from __future__ import annotations

import json

import pytest

from spillway.recipes.config import Recipe
from spillway.recipes.registry import get_recipe
from spillway.recipes.train.resume import (MAY_CHANGE, MUST_MATCH, RecipeMismatchError, compare_recipes,
                                           learning_rate_change, read_history, record_history, resume_rule)


def tiny(*overrides) -> dict:
    return get_recipe("tiny", list(overrides)).to_dict()


@pytest.mark.parametrize("override,field,saved,new", [
    ("model.d_model=96", "model.d_model", "192", "96"),
    ("model.rope_theta=500000", "model.rope_theta", "10000.0", "500000.0"),
    ("execution.param_dtype=bfloat16", "execution.param_dtype", '"float32"', '"bfloat16"'),
    ("data.source=/data/other", "data.source", '"builtin:stdlib"', '"/data/other"'),
    ("data.tokenizer=/tmp/other.model", "data.tokenizer", "null", '"/tmp/other.model"'),
    ("data.seq_len=64", "data.seq_len", "128", "64"),
    ("train.seed=7", "train.seed", "0", "7"),
    ("train.global_batch=32", "train.global_batch", "16", "32"),
    ("optimizer.master_weights=false", "optimizer.master_weights", "true", "false"),
    ("block=spillway.layers.block:TransformerBlock", "block", "null", '"spillway.layers.block:TransformerBlock"'),
])
def test_a_field_that_defines_the_run_is_refused_naming_field_and_values(override, field, saved, new):
    with pytest.raises(RecipeMismatchError) as excinfo:
        compare_recipes(tiny(), tiny(override), where="/runs/x/checkpoints/100")
    message = str(excinfo.value)
    assert message.startswith(f"/runs/x/checkpoints/100: cannot resume: {field} was {saved} in the saved run "
                              f"and is {new} now.")
    assert "\n" not in message


def test_the_first_difference_is_named_and_the_others_counted():
    with pytest.raises(RecipeMismatchError, match=r"model.d_model was 192 .* \(and 1 more: data.seq_len\)"):
        compare_recipes(tiny(), tiny("model.d_model=96", "data.seq_len=64"), where="x")


def test_changes_made_on_purpose_are_returned():
    changed = compare_recipes(
        tiny(), tiny("train.steps=900", "optimizer.learning_rate=1e-3", "optimizer.warmup_steps=10",
                     "train.log_every=5", "checkpoint.every_steps=50", "mesh.fsdp=2",
                     "offload.optimizer_state=host", "execution.attention_impl=flash", "data.cache_dir=/c"),
        where="x")
    assert changed == {
        "train.steps": [500, 900], "optimizer.learning_rate": [0.003, 0.001], "optimizer.warmup_steps": [30, 10],
        "train.log_every": [10, 5], "checkpoint.every_steps": [100, 50], "mesh.fsdp": [-1, 2],
        "offload.optimizer_state": ["device", "host"], "execution.attention_impl": ["xla", "flash"],
        "data.cache_dir": [".cache/spillway", "/c"],
    }
    assert compare_recipes(tiny(), tiny(), where="x") == {}


def test_lora_targets_that_name_the_same_adapters_resume():
    """Another order of lora.targets, or GPT-2's c_attn for the default (q_proj, v_proj) that PEFT's rule turns
    into it (what the run trained, its header says), was refused as a change of targets."""
    lora = ["lora.rank=4", "checkpoint.init_from=/base"]
    saved = tiny(*lora, "lora.targets=q_proj,v_proj,down_proj")
    assert compare_recipes(saved, tiny(*lora, "lora.targets=down_proj,v_proj,q_proj"), where="x") == {
        "lora.targets": [["q_proj", "v_proj", "down_proj"], ["down_proj", "v_proj", "q_proj"]]}
    gpt2 = lambda *more: get_recipe("gpt2_tiny", [*lora, *more]).to_dict()  # noqa: E731
    assert compare_recipes(gpt2(), gpt2("lora.targets=c_attn"), where="x") == {
        "lora.targets": [["q_proj", "v_proj"], ["c_attn"]]}
    with pytest.raises(RecipeMismatchError, match=r'lora.targets was \["q_proj", "v_proj", "down_proj"\] .* '
                                                  r"export it merged, and fine-tune from the export"):
        compare_recipes(saved, tiny(*lora, "lora.targets=q_proj,v_proj"), where="x")
    with pytest.raises(RecipeMismatchError, match=r"model.num_layers .* \(fine-tune from this run with"):
        compare_recipes(tiny(), tiny("model.num_layers=3"), where="x")   # no LoRA
    with pytest.raises(RecipeMismatchError, match=r"lora.rank was 4 .* export it merged"):   # the saved run's
        compare_recipes(tiny(*lora), tiny(), where="x")


def test_lora_settings_of_a_run_without_lora_change_nothing_at_resume():
    """A run with lora.rank 0 (every weight trained) whose recipe file names other lora.targets, alpha or dropout
    was refused as a change of the adapters it does not have."""
    saved, new = tiny(), tiny()
    new["lora"].update(targets=["k_proj"], alpha=16.0, dropout=0.1)
    assert set(compare_recipes(saved, new, where="x")) == {"lora.targets", "lora.alpha", "lora.dropout"}
    lora = ["lora.rank=4", "checkpoint.init_from=/base"]
    with pytest.raises(RecipeMismatchError, match="lora.alpha was 8.0"):   # with adapters, they are the model
        compare_recipes(tiny(*lora), tiny(*lora, "lora.alpha=16"), where="x")


def test_a_tokenizer_moved_with_its_base_is_the_runs_own_copy(tmp_path):
    """A fine-tune whose hf: base moved, resumed naming its new place, was refused: data.tokenizer (set from the
    base) named a folder that is gone. The run's own copy of the tokenizer, which a resume reads, stands in."""
    run, moved = tmp_path / "run", tmp_path / "moved"
    for folder, text in ((run, "spm"), (moved, "spm"), (tmp_path / "other", "other")):
        folder.mkdir()
        (folder / "tokenizer.model").write_text(text)
    at = lambda folder: tiny(f"checkpoint.dir={run}", f"data.tokenizer={folder}")  # noqa: E731
    assert compare_recipes(at(tmp_path / "gone"), at(moved), where="x") == {   # recorded in history.jsonl
        "data.tokenizer": [str(tmp_path / "gone"), str(moved)]}
    with pytest.raises(RecipeMismatchError, match="data.tokenizer was"):
        compare_recipes(at(tmp_path / "gone"), at(tmp_path / "other"), where="x")


def test_a_field_no_rule_names_must_match():
    assert resume_rule("train.some_field_added_later") == MAY_CHANGE  # inside a group that may change
    assert resume_rule("data.some_field_added_later") == MUST_MATCH
    assert resume_rule("a_new_top_level_group.x") == MUST_MATCH
    saved = tiny()
    new = dict(saved, a_new_top_level_group={"x": 1})
    with pytest.raises(RecipeMismatchError, match=r"a_new_top_level_group.x was \(absent\) .* is 1 now"):
        compare_recipes(saved, new, where="x")


def test_a_legacy_saved_recipe_compares_after_upgrade():
    # recipe.json written before families existed: dtypes inside the model config (config.py upgrades it)
    legacy = tiny()
    legacy.pop("family")
    legacy.pop("execution")
    legacy["model"] = {**legacy["model"], "dtype": "float32", "param_dtype": "float32", "remat": None}
    upgraded = Recipe.from_dict(json.loads(json.dumps(legacy))).to_dict()
    assert compare_recipes(upgraded, tiny("train.steps=600"), where="x") == {"train.steps": [500, 600]}


def test_history_rows_append(tmp_path):
    record_history(tmp_path, "start", step=0)
    record_history(tmp_path, "resume", step=100, changed={"train.steps": [500, 900]}, set_aside=["200.corrupt"])
    rows = read_history(tmp_path)
    assert [(r["event"], r["step"]) for r in rows] == [("start", 0), ("resume", 100)]
    assert rows[1]["changed"] == {"train.steps": [500, 900]} and rows[1]["set_aside"] == ["200.corrupt"]
    assert "changed" not in rows[0]


def test_a_tokenizer_reached_by_another_path_is_the_same_tokenizer(tmp_path):
    # a fine-tune's recipe names the copy of its tokenizer inside the run; a moved run names another path
    (tmp_path / "a.model").write_bytes(b"sentencepiece bytes")
    (tmp_path / "b.model").write_bytes(b"sentencepiece bytes")
    (tmp_path / "c.model").write_bytes(b"other bytes")
    saved = tiny(f"data.tokenizer={tmp_path / 'a.model'}")
    assert compare_recipes(saved, tiny(f"data.tokenizer={tmp_path / 'b.model'}"), where="x") == {
        "data.tokenizer": [str(tmp_path / "a.model"), str(tmp_path / "b.model")]}
    with pytest.raises(RecipeMismatchError, match="data.tokenizer was"):
        compare_recipes(saved, tiny(f"data.tokenizer={tmp_path / 'c.model'}"), where="x")
    # a folder names the tokenizer file it holds (a run started on a folder, resumed on the file, or back)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "tokenizer.model").write_bytes(b"sentencepiece bytes")
    assert "data.tokenizer" in compare_recipes(saved, tiny(f"data.tokenizer={tmp_path / 'folder'}"), where="x")


def test_a_mixture_written_another_way_resumes_a_reordered_or_reweighted_one_does_not():
    """A space added, or weights 7:3 for 0.7:0.3, was refused as a changed mixture."""
    from spillway.recipes.train.resume import RecipeMismatchError, compare_recipes

    def recipe(mixture):
        return get_recipe("tiny", [f"data.mixture={mixture}"]).to_dict()

    saved = recipe("web=0.7:/data/web,code=0.3:/data/code")
    assert compare_recipes(saved, recipe("web=7:/data/web, code=3:/data/code"), where="s") == {
        "data.mixture": ["web=0.7:/data/web,code=0.3:/data/code", "web=7:/data/web, code=3:/data/code"]}
    for other in ("code=0.3:/data/code,web=0.7:/data/web", "web=0.6:/data/web,code=0.4:/data/code"):
        with pytest.raises(RecipeMismatchError, match="data.mixture"):
            compare_recipes(saved, recipe(other), where="s")


def test_init_from_named_on_a_run_that_started_without_it_is_refused_naming_it():
    """A run trained from scratch, rerun with checkpoint.init_from: it resumes its own steps and never reads
    init_from, and it was refused naming data.tokenizer (the fine-tune's tokenizer copy), which the user never set."""
    with pytest.raises(RecipeMismatchError) as excinfo:
        compare_recipes(tiny(), tiny("checkpoint.init_from=/runs/other"), where="x")
    message = str(excinfo.value)
    assert message.startswith("x: cannot resume: checkpoint.init_from is '/runs/other', but this run started "
                              "without it")
    assert "another checkpoint.dir to fine-tune from /runs/other" in message and "\n" not in message
    # a fine-tune's source named at another place is a change, as before
    assert compare_recipes(tiny("checkpoint.init_from=/a"), tiny("checkpoint.init_from=/b"), where="x") == {
        "checkpoint.init_from": ["/a", "/b"]}


def test_a_resume_that_moves_the_learning_rate_says_from_what_to_what():
    """20 -> 40 steps on a finished run stretches the cosine decay: its learning rate jumps from the end value
    (10% of the peak) back up, where the resume line said only "train.steps: 20 -> 40"."""
    recipe = get_recipe("tiny", ["optimizer.warmup_steps=5", "train.steps=40"])
    line = learning_rate_change(recipe, {"train.steps": [20, 40]}, step=20)
    assert line.startswith("; learning rate at step 20: 0.0003 -> 0.00195 (")
    longer_peak = get_recipe("tiny", ["optimizer.warmup_steps=5", "optimizer.learning_rate=6e-3"])
    assert "0.0003 -> 0.0006" in learning_rate_change(longer_peak, {"optimizer.learning_rate": [3e-3, 6e-3]}, 500)


def test_a_resume_that_leaves_the_learning_rate_where_it_was_says_nothing_of_it():
    assert learning_rate_change(get_recipe("tiny"), {"train.log_every": [10, 1]}, step=20) == ""
    within_warmup = get_recipe("tiny", ["optimizer.warmup_steps=5", "train.steps=400"])   # the same ramp
    assert learning_rate_change(within_warmup, {"train.steps": [200, 400]}, step=3) == ""
