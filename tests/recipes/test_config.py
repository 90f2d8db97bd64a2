"""The Recipe as data: one field per setting, values that cannot work refused before anything runs,
JSON round-trips, and recipe.json files written by earlier versions still load."""

import dataclasses
import json

import pytest

from spillway.layers.errors import ConfigError, SpillwayError
from spillway.recipes.config import DERIVED_FIELDS, Recipe, apply_overrides
from spillway.recipes.registry import get_recipe, recipe_names


def tiny(*overrides):
    return get_recipe("tiny", list(overrides))


# --- one source of truth ------------------------------------------------------------------

@pytest.mark.parametrize("path,points_to", [("optimizer.total_steps", "train.steps"),
                                             ("optimizer.state_memory", "offload.optimizer_state"),
                                             ("model.remat", "offload.activations")])
def test_a_derived_setting_cannot_be_set(path, points_to):
    assert path in DERIVED_FIELDS
    with pytest.raises(ConfigError, match=rf"{path} cannot be set: .*{points_to}"):
        tiny(f"{path}=5")


def test_the_optimizer_section_holds_no_copy_of_train_or_offload_settings():
    fields = {f.name for f in dataclasses.fields(tiny().optimizer)}
    assert not fields & {"total_steps", "state_memory"}
    saved = tiny().to_dict()
    assert "total_steps" not in saved["optimizer"] and "state_memory" not in saved["optimizer"]


def test_the_optimizer_runs_on_train_steps_and_offload_placement():
    """The built optimizer reads its schedule length and state placement from the one field each."""
    from spillway.layers.mesh import MeshConfig
    from spillway.layers.sharding import make_mesh
    from spillway.recipes.train.step import abstract_setup
    import jax

    recipe = tiny("train.steps=321", "offload.optimizer_state=host")
    s = abstract_setup(recipe, make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1]), platform="cpu")
    assert s.optimizer.total_steps == 321
    assert {layout.state_memory for layout in s.optimizer._layouts} == {"host"}
    # Shorter than the warmup (30 steps in `tiny`): the schedule still ends one step past it.
    assert tiny("train.steps=5").schedule_steps == 31


# --- JSON round-trips and old files ------------------------------------------------------------

@pytest.mark.parametrize("name", recipe_names())
def test_every_recipe_round_trips_through_json(name):
    recipe = get_recipe(name)
    assert Recipe.from_dict(json.loads(recipe.to_json())) == recipe


def test_recipe_json_with_the_fields_that_used_to_be_overwritten_loads_unchanged():
    """recipe.json files written before this change carry optimizer.total_steps and state_memory,
    which the run overwrote with train.steps and offload.optimizer_state: dropping them changes nothing."""
    recipe = tiny("train.steps=77", "offload.optimizer_state=host")
    old = recipe.to_dict()
    old["optimizer"].update(total_steps=77, state_memory="host")
    assert Recipe.from_dict(json.loads(json.dumps(old))) == recipe


def test_recipe_json_from_before_families_loads():
    recipe = tiny()
    old = recipe.to_dict()
    del old["family"]
    old["model"].update(old.pop("execution"), remat="save_all")
    old["optimizer"].update(total_steps=500, state_memory="device")
    assert Recipe.from_dict(old) == recipe


def test_a_recipe_json_whose_family_was_deleted_is_refused_not_read_as_llama():
    """A qwen3 recipe file without "family" was read as Llama (the format before families) without its q/k
    norms; the old format is told by its model fields (dtypes, remat), which today's files never hold."""
    edited = Recipe.from_dict(tiny().to_dict()).to_dict()
    del edited["family"]
    with pytest.raises(ConfigError, match=r'the recipe has no "family" \(one of .*llama.*qwen3.*\): add the family'):
        Recipe.from_dict(edited)


def test_recipe_json_errors_name_the_field():
    broken = tiny().to_dict()
    broken["train"]["steps"] = 0
    with pytest.raises(ConfigError, match="train.steps must be positive, got 0"):
        Recipe.from_dict(broken)
    del broken["model"]["d_model"]
    with pytest.raises(ConfigError, match=r"missing field\(s\) \['d_model'\] in model"):
        Recipe.from_dict(broken)
    with pytest.raises(ConfigError, match="must be a JSON object"):
        Recipe.from_dict([1, 2])


# --- values that cannot work ----------------------------------------------------------------

@pytest.mark.parametrize("override,message", [
    ("train.steps=0", "train.steps must be positive, got 0"),
    ("train.steps=-3", "train.steps must be positive, got -3"),
    ("train.grad_accum=0", "train.grad_accum must be positive, got 0"),
    ("train.log_every=0", "train.log_every must be positive, got 0"),
    ("train.global_batch=0", "train.global_batch must be positive, got 0"),
    ("train.eval_batches=0", "train.eval_batches must be positive"),
    ("train.eval_every=-1", "train.eval_every must be zero or positive"),
    ("train.loss_chunk=-8", "train.loss_chunk must be zero or positive"),
    ("train.sample_tokens=-1", "train.sample_tokens must be zero or positive"),
    ("train.seed=-1", "train.seed must be zero or positive"),
    ("train.profile_steps=5:2", "train.profile_steps must be 'START:STOP' with STOP > START"),
    ("train.grad_accum=3", r"train.grad_accum \(3\) does not divide train.global_batch \(16\)"),
    ("train.loss_chunk=48", r"train.loss_chunk \(48\) must divide data.seq_len \(128\)"),
    ("data.seq_len=0", "data.seq_len must be positive"),
    ("data.seq_len=4096", r"data.seq_len \(4096\) exceeds model.max_seq_len \(128\)"),
    ("data.val_fraction=1.0", r"data.val_fraction must be in \[0, 1\)"),
    ("data.val_fraction=0", "there is no validation data, but train.eval_every is 100"),
    ("data.num_proc=0", "data.num_proc must be positive"),
    ("data.max_tokens=0", "data.max_tokens must be positive"),
    ("data.tokenizer_type=wordpiece", "data.tokenizer_type must be one of"),
    ("checkpoint.every_steps=0", "checkpoint.every_steps must be positive"),
    ("checkpoint.keep=0", "checkpoint.keep must be positive"),
    ("mesh.data=0", "mesh.data must be a positive number of devices or -1"),
    ("mesh.tensor=-2", "mesh.tensor must be a positive number of devices or -1"),
    ("mesh.data=-1", "at most one mesh axis may be -1"),
    ("offload.activations=nonsense", "offload.activations: unknown offload preset 'nonsense'"),
    ("offload.activations=offload_dots:9,recompute_all", "boundary 9 is beyond the stack's 4 layers"),
    ("offload.optimizer_state=hbm", "offload.optimizer_state must be one of"),
    ("optimizer.learning_rate=0", "optimizer.learning_rate must be a positive finite number"),
    ("optimizer.eps=0", "optimizer.eps must be a positive finite number"),
    ("optimizer.eps=inf", "optimizer.eps must be a positive finite number"),
    ("optimizer.learning_rate=inf", "optimizer.learning_rate must be a positive finite number"),
    ("optimizer.weight_decay=inf", "optimizer.weight_decay must be finite"),
    ("train.seed=99999999999999999999999", r"train.seed must be at most 4294967295"),
    ("train.seed=4294967296", r"train.seed must be at most 4294967295 \(2\*\*32 - 1: JAX keeps a seed's low 32"),
    ("execution.flash_block_size=0", "execution.flash_block_size must be positive"),
    ("execution.init_std=0", "execution.init_std must be positive"),
    ("execution.dtype=float33", "execution.dtype: 'float33' is not a dtype"),
    # float64 was accepted and trained as float32 (jax truncates without x64), the recipe saying float64
    ("execution.param_dtype=float64", "execution.param_dtype: 'float64' is not a dtype a model trains in"),
    ("execution.dtype=int32", "execution.dtype: 'int32' is not a dtype a model trains in"),
    ("name=", "name must be a folder name inside runs/"),
    ("name=../../etc", "name must be a folder name inside runs/"),
    ("name=/etc", "name must be a folder name inside runs/"),
    ("name=//etc", "name must be a folder name inside runs/"),
    ("model.d_model=0", "d_model must be positive"),
    ("model.vocab_size=-5", "vocab_size must be positive"),
    ("model.max_seq_len=0", "max_seq_len must be positive"),
    ("model.norm_eps=0", "norm_eps must be positive"),
    ("model.rope_theta=-1", "rope_theta must be positive"),
    ("model.head_dim=0", "head_dim must be positive"),
    ("model.rope_scaling.factor=0", "rope_scaling.factor must be positive"),
])
def test_values_that_cannot_work_are_one_config_error(override, message):
    with pytest.raises(ConfigError, match=message) as error:
        tiny(override)
    assert isinstance(error.value, SpillwayError) and isinstance(error.value, ValueError)
    assert "\n" not in str(error.value)


def test_a_model_value_error_names_only_its_own_setting():
    """A model config names the field as MistralConfig.sliding_window: the line repeated every --set given."""
    with pytest.raises(ConfigError, match=r"^--set model.d_model=0: .*d_model must be positive") as error:
        apply_overrides(tiny(), ["train.steps=3", "data.seq_len=64", "model.d_model=0"])
    assert "train.steps" not in str(error.value)


def test_zero_means_off_where_the_field_says_so():
    recipe = tiny("train.eval_every=0", "data.val_fraction=0", "train.loss_chunk=0", "train.sample_tokens=0")
    assert recipe.train.eval_every == 0 and recipe.train.loss_chunk == 0
    assert tiny("train.loss_chunk=32").train.loss_chunk == 32           # divides 128
    assert tiny("train.loss_chunk=4096").train.loss_chunk == 4096       # longer than the sequence: one chunk


def test_sections_built_in_python_are_checked_too():
    from spillway.recipes.config import TrainConfig
    with pytest.raises(ConfigError, match="train.steps must be positive"):
        TrainConfig(steps=0)
    with pytest.raises(ConfigError, match="train must be a TrainConfig"):
        dataclasses.replace(tiny(), train={"steps": 3})


def test_unknown_and_malformed_overrides():
    with pytest.raises(ConfigError, match="unknown field 'train.stepz'"):
        tiny("train.stepz=3")
    with pytest.raises(ConfigError, match="--set expects key=value"):
        apply_overrides(tiny(), ["train.steps"])
    with pytest.raises(ConfigError, match="train.steps: expected an integer, got 'many'"):
        tiny("train.steps=many")
    with pytest.raises(ConfigError, match=r"'model.rope_scaling' is a group of fields; set one of them, e.g. "
                                          r"model.rope_scaling.factor=... \(its fields: factor, high_freq_factor"):
        tiny('model.rope_scaling={"factor": 2}')


def test_a_bare_field_name_suggests_the_section_holding_it():
    # the corpus-split error once said "set val_fraction=0", and `--set val_fraction=0` listed the sections alone
    with pytest.raises(ConfigError, match=r"unknown field 'val_fraction': .*did you mean 'data.val_fraction'\?"):
        tiny("val_fraction=0")
    with pytest.raises(ConfigError, match=r"did you mean 'train.steps'\?"):
        tiny("steps=3")


def test_block_class_is_resolved_when_the_recipe_is_built():
    assert tiny("block=spillway.layers.block:TransformerBlock").block_class().__name__ == "TransformerBlock"
    with pytest.raises(ConfigError, match="block: no module 'no_such_module'"):
        tiny("block=no_such_module:Block")
    with pytest.raises(ConfigError, match="not a subclass of spillway.layers.block.TransformerBlock"):
        tiny("block=spillway.layers.norm:RMSNorm")


def test_the_step_summary_is_worked_out_from_the_fields():
    """Numbers the fields decide are printed by the code (`spillway recipes NAME`), not restated in prose.
    By hand: tiny is 16 sequences of 128 tokens in one micro-batch, 500 steps; llama3_8b is 512 x 8192 in
    64 micro-batches of 8 sequences, one per GPU on its 8 H200s, and 15e12 // 4,194,304 = 3,576,278 steps."""
    assert tiny().step_summary() == "2,048 tokens/step (16 x 128, 1 micro-batch of 16); 500 steps, 1,024,000 tokens"
    assert get_recipe("llama3_8b").step_summary() == (
        "4,194,304 tokens/step (512 x 8,192, 64 micro-batches of 1 sequence per GPU); 3,576,278 steps, "
        "15.00T tokens; planned for 8 x H200 SXM 141GB")


def test_a_tilde_in_the_run_and_cache_folders_is_the_home_folder(tmp_path, monkeypatch):
    """`--set checkpoint.dir=~/ft` is not expanded by the shell (the word starts with "checkpoint"): the run
    made a folder named "~" in the working directory, and the resume preflight looked in the home folder."""
    from pathlib import Path

    from spillway.recipes.config import apply_overrides
    from spillway.recipes.registry import get_recipe
    from spillway.recipes.train.checkpoint_dirs import checkpoint_dir_of

    monkeypatch.setenv("HOME", str(tmp_path))
    recipe = apply_overrides(get_recipe("tiny"), ["checkpoint.dir=~/ft", "data.cache_dir=~/cache"])
    assert recipe.run_dir == str(tmp_path / "ft")
    assert recipe.data.cache_path == tmp_path / "cache"
    assert Path(str(checkpoint_dir_of("~/ft"))) == tmp_path / "ft"   # expanded, not <cwd>/~/ft


def test_a_model_section_written_for_another_family_is_refused():
    """A new user's finding: "family": "mixtral" (for "mistral") over a Llama model section built an 8-expert MoE
    model from the defaults, described as a 4-layer Llama; a section with none of the family's own fields is
    refused, naming them. A whole recipe of every family still reads back."""
    import json

    from spillway.recipes.registry import recipe_names

    tree = get_recipe("tiny").to_dict()
    with pytest.raises(ConfigError, match=r"the model section has none of the mixtral family's own fields \(.*"
                                          r"num_experts.*\): it is written for another family"):
        Recipe.from_dict({**tree, "family": "mixtral"})
    for name in recipe_names():
        assert Recipe.from_dict(json.loads(get_recipe(name).to_json())) == get_recipe(name)


def test_a_dtype_alias_is_recorded_by_its_name():
    """'f4' passed the dtype check and was priced at the bf16 peak, the planner reading 'float32' only."""
    assert tiny("execution.dtype=f4").execution.dtype == "float32"
    assert tiny("execution.param_dtype=half").execution.param_dtype == "float16"
