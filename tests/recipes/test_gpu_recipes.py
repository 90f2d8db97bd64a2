"""The GPU pretraining recipes: what they train on and with, what they say offline, and the GPUs they plan for.

* Each names a Hub corpus, the model's own tokenizer by path (and the Hub repository it copies), and the
  hyperparameters of its source, checked here against the publication's numbers (PUBLISHED), so a recipe
  edit that drifts from its source fails.
* Offline (HF_HUB_OFFLINE set, no tokenizer file), `spillway train NAME` is one line naming each missing
  input with the exact --set for a local copy, exit status 2, before any run directory, compile or model.
* `spillway plan NAME` and `spillway train NAME --plan auto` default to the recipe's own GPUs; the slow test
  compiles each recipe there and checks that its stored offload settings are the planner's pick.
"""

import pytest

from spillway.data import parse_hub_spec
from spillway.layers.errors import ConfigError
from spillway.recipes import cli
from spillway.recipes.plan import commands, mesh_rules, planner
from spillway.recipes.plan import render as plan_render
from spillway.recipes.plan import result as plan_result
from spillway.recipes.registry import get_recipe, recipe_names

GPU_RECIPES = sorted(name for name in recipe_names() if get_recipe(name).offload.target_gpu is not None)
# The fine-tuning ones (tests/recipes/test_sft_gpu_recipes.py) start from a checkpoint on instruction data.
PRETRAINING_RECIPES = [name for name in GPU_RECIPES if get_recipe(name).data.format == "text"]

# name: (tokens per step, token budget, peak lr, warmup steps, lr floor, eps, tokenizer repository)
LLAMA2 = dict(lr=3e-4, warmup=2000, floor=0.1, eps=1e-5)      # Llama 2 paper, section 2.2 / Table 1
PUBLISHED = {
    # build-nanogpt train_gpt2.py: GPT-2 (124M) on FineWeb-Edu sample-10BT: 2**19 tokens, 19,073 steps, 715 warmup.
    "gpt2_124m": dict(tokens=524_288, budget=19_073 * 524_288, lr=6e-4, warmup=715, floor=0.1, eps=1e-8,
                      tokenizer="openai-community/gpt2"),
    "llama3_1b": dict(tokens=4 * 2**20, budget=9e12, tokenizer="meta-llama/Llama-3.2-1B", **LLAMA2),
    "llama3_8b": dict(tokens=4 * 2**20, budget=15e12, tokenizer="meta-llama/Llama-3.1-8B", **LLAMA2),
    "llama3_8b_offload": dict(tokens=4 * 2**20, budget=15e12, tokenizer="meta-llama/Llama-3.1-8B", **LLAMA2),
    "mistral_7b": dict(tokens=4 * 2**20, budget=2e12, tokenizer="mistralai/Mistral-7B-v0.3", **LLAMA2),
    "mistral_7b_v0_1": dict(tokens=4 * 2**20, budget=2e12, tokenizer="mistralai/Mistral-7B-v0.1", **LLAMA2),
    "qwen2_5_1_5b": dict(tokens=4 * 2**20, budget=18e12, tokenizer="Qwen/Qwen2.5-1.5B", **LLAMA2),
    "qwen3_0_6b": dict(tokens=4 * 2**20, budget=36e12, tokenizer="Qwen/Qwen3-0.6B-Base", **LLAMA2),
    "qwen3_8b": dict(tokens=4 * 2**20, budget=36e12, tokenizer="Qwen/Qwen3-8B-Base", **LLAMA2),
    # Gemma 2 / Gemma 3 model cards: 2T tokens at 2B, 2T at 1B, 12T at 12B; the optimizer is Llama 2's.
    "gemma2_2b": dict(tokens=4 * 2**20, budget=2e12, tokenizer="google/gemma-2-2b", **LLAMA2),
    "gemma3_1b": dict(tokens=4 * 2**20, budget=2e12, tokenizer="google/gemma-3-1b-pt", **LLAMA2),
    "gemma3_12b": dict(tokens=4 * 2**20, budget=12e12, tokenizer="google/gemma-3-12b-pt", **LLAMA2),
    # Mixtral and Qwen3-MoE: no published pretraining settings; Llama 2's, Llama 2's 2T budget for Mixtral,
    # Qwen3's 36T budget for Qwen3-30B-A3B.
    "mixtral_8x7b": dict(tokens=4 * 2**20, budget=2e12, tokenizer="mistralai/Mixtral-8x7B-v0.1", **LLAMA2),
    "qwen3_30b_a3b": dict(tokens=4 * 2**20, budget=36e12, tokenizer="Qwen/Qwen3-30B-A3B-Base", **LLAMA2),
}


def test_every_gpu_recipe_is_covered():
    assert PRETRAINING_RECIPES == sorted(PUBLISHED)


@pytest.mark.parametrize("name", PRETRAINING_RECIPES)
def test_a_gpu_recipe_names_its_corpus_tokenizer_and_published_hyperparameters(name):
    recipe, published = get_recipe(name), PUBLISHED[name]
    hub = parse_hub_spec(recipe.data.source)
    assert hub is not None and hub.repo_id == "HuggingFaceFW/fineweb-edu" and recipe.data.text_field == "text"
    assert recipe.data.tokenizer_origin == published["tokenizer"]
    assert recipe.data.tokenizer == f"tokenizers/{published['tokenizer']}"
    tokens_per_step = recipe.train.global_batch * recipe.data.seq_len
    assert tokens_per_step == published["tokens"]
    # The budget in whole steps: within one step of the published token count.
    assert 0 <= published["budget"] - recipe.train.steps * tokens_per_step < tokens_per_step
    opt = recipe.optimizer
    assert (opt.learning_rate, opt.warmup_steps, opt.min_lr_ratio, opt.eps) == \
        (published["lr"], published["warmup"], published["floor"], published["eps"])
    assert (opt.b1, opt.b2, opt.weight_decay, opt.clip_norm) == (0.9, 0.95, 0.1, 1.0)
    # Gradient accumulation reaches the batch with micro-batches that split evenly over the target GPUs.
    mesh_rules.resolve_mesh(recipe, recipe.offload.target_devices)
    assert recipe.train.grad_accum > 1
    # The recipe says where the numbers come from, and which are our choice; the numbers its fields make
    # of a step are the code's to print, not the prose's to restate.
    assert recipe.sources and "our choice" in recipe.sources and "micro-batches" not in recipe.description
    assert f"{recipe.data.seq_len:,}" in recipe.step_summary() and f"{recipe.train.steps:,} steps" in \
        recipe.step_summary()


def test_gpt2_124m_is_the_build_nanogpt_baseline():
    recipe = get_recipe("gpt2_124m")
    assert recipe.data.source == "hf:HuggingFaceFW/fineweb-edu:sample-10BT"
    assert (recipe.train.global_batch, recipe.data.seq_len, recipe.train.steps) == (512, 1024, 19_073)
    assert (recipe.train.eval_every, recipe.checkpoint.every_steps) == (250, 5000)


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No network for the Hub, and a working directory without the recipes' tokenizers/ folder."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("name", PRETRAINING_RECIPES)
def test_offline_a_gpu_recipe_stops_with_one_line_naming_what_is_missing(name, offline, monkeypatch, capsys):
    from spillway.recipes.train import data_pipeline, loop

    def must_not_run(*args, **kwargs):
        raise AssertionError("data or the model were prepared before the missing inputs were reported")
    monkeypatch.setattr(loop, "setup", must_not_run)
    monkeypatch.setattr(data_pipeline, "prepare", must_not_run)
    recipe = get_recipe(name)
    assert cli.main(["train", name]) == cli.EXIT_USER_ERROR
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    line = err[0]
    assert line.startswith(f"spillway train: error: recipe {name}: 2 inputs are missing: (1) data.tokenizer "
                           f"'{recipe.data.tokenizer}' does not exist")
    assert f"hf download {recipe.data.tokenizer_origin} " in line and "--set data.tokenizer=PATH" in line
    assert f"(2) data.source '{recipe.data.source}' is the Hugging Face Hub dataset HuggingFaceFW/fineweb-edu" in line
    assert "HF_HUB_OFFLINE is set" in line and "--set data.source=DIR" in line
    assert not (offline / "runs").exists(), "the run directory was taken before the inputs were checked"


def test_offline_with_a_local_tokenizer_only_the_corpus_is_missing(offline, capsys):
    recipe = get_recipe("llama3_8b")
    folder = offline / recipe.data.tokenizer
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text("{}")   # the check looks for the file; loading it comes later
    assert cli.main(["train", "llama3_8b", "--plan", "auto"]) == cli.EXIT_USER_ERROR   # before any compile
    (line,) = capsys.readouterr().err.splitlines()
    assert "data.tokenizer" not in line and "data.source 'hf:HuggingFaceFW/fineweb-edu'" in line


def test_a_corpus_given_locally_is_checked_as_a_path(offline, capsys):
    assert cli.main(["train", "gpt2_124m", "--set", "data.source=fineweb/sample/10BT",
                     "--set", "data.tokenizer=None"]) == cli.EXIT_USER_ERROR
    (line,) = capsys.readouterr().err.splitlines()
    assert "data.source 'fineweb/sample/10BT': corpus path 'fineweb/sample/10BT' does not exist" in line


def test_a_hub_that_cannot_be_reached_is_named(monkeypatch):
    import huggingface_hub

    from spillway.data.hub_reach import hub_unreachable_reason
    from spillway.data.sources import HubSpec

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    asked = []

    def no_network(self, repo_id, **kwargs):
        asked.append((repo_id, kwargs.get("timeout")))
        raise ConnectionError("[Errno -2] Name or service not known")
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", no_network)
    reason = hub_unreachable_reason(HubSpec("HuggingFaceFW/fineweb-edu", "sample-10BT"))
    assert reason == "the Hub cannot be reached ([Errno -2] Name or service not known)"
    assert asked == [("HuggingFaceFW/fineweb-edu", 10.0)]
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", lambda self, repo_id, **kwargs: object())
    assert hub_unreachable_reason(HubSpec("HuggingFaceFW/fineweb-edu")) is None


def test_offline_through_the_command_is_exit_2_without_a_traceback(tmp_path):
    from test_cli import run_spillway

    code, _, err = run_spillway("train", "qwen3_0_6b", cwd=tmp_path, env={"HF_HUB_OFFLINE": "1"})
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0]
    assert "2 inputs are missing" in err[0]


@pytest.mark.parametrize("argv,gpu,devices", [
    (["plan", "llama3_8b"], "h200", 8),
    (["plan", "llama3_8b_offload"], "h100", 1),
    (["plan", "tiny"], "h200", 1),                          # a recipe for no GPU in particular: one H200
    (["plan", "llama3_8b", "--gpu", "b200", "--devices", "2"], "b200", 2),
    (["plan", "llama3_8b", "--gpu", "h100"], "h100", 8),
])
def test_plan_defaults_to_the_recipes_own_gpus(argv, gpu, devices, monkeypatch):
    seen = {}
    monkeypatch.setattr(commands, "plan_command", lambda args: seen.update(gpu=args.gpu, devices=args.devices) or 0)
    assert cli.main(argv) == 0
    assert seen == {"gpu": gpu, "devices": devices}


def test_train_plan_auto_plans_for_the_recipes_gpu(monkeypatch):
    from spillway.recipes.train import loop, preflight

    seen = {}

    def fake_apply_plan(recipe, how, *, gpu, devices, host_ram_gb=None):
        seen.update(gpu=gpu, devices=devices, host_ram_gb=host_ram_gb)
        return recipe
    monkeypatch.setattr(preflight, "check_run_inputs", lambda recipe: None)
    monkeypatch.setattr(commands, "apply_plan", fake_apply_plan)
    monkeypatch.setattr(loop, "train", lambda recipe, **kwargs: None)
    assert cli.main(["train", "llama3_8b_offload", "--plan", "auto"]) == 0
    assert seen == {"gpu": "h100", "devices": None, "host_ram_gb": None}   # devices: what the run sees
    assert cli.main(["train", "llama3_8b_offload", "--plan", "auto", "--host-ram-gb", "137"]) == 0
    assert seen["host_ram_gb"] == 137.0                # the plan and the run's host check use the same RAM
    assert cli.main(["train", "llama3_8b_offload", "--plan", "auto", "--gpu", "gh200"]) == 0
    assert seen["gpu"] == "gh200"


def test_an_unknown_target_gpu_is_a_config_error_naming_the_field():
    with pytest.raises(ConfigError, match="offload.target_gpu: unknown GPU target 'h300'"):
        get_recipe("llama3_8b", ["offload.target_gpu=h300"])
    with pytest.raises(ConfigError, match="offload.target_devices must be positive"):
        get_recipe("llama3_8b", ["offload.target_devices=0"])


# Qwen3-30B-A3B's full AdamW state fits one H200 only with its experts in host memory too, whose checkpoint save
# peaks at 1136.5 GiB of host RAM: most of a 2 TB node's for the one GPU, not the per-GPU share the planner
# assumes (BENCHMARKS.md). The 8B's full fine-tune on one L4 keeps 89.7 GiB of float32 state in host memory:
# a one-L4 machine with 256 GiB (AWS g6.16xlarge), not the L4 target's per-GPU share of an 8-L4 node.
HOST_RAM_GB = {"qwen3_30b_a3b": 1300, "llama3_8b_sft_l4": 256}


@pytest.mark.slow            # 16 deviceless compiles per recipe: minutes for the 8B ones on a busy machine
@pytest.mark.recipe_picks    # half of the slow tests' time: CI runs them last, after every correctness test
@pytest.mark.needs_toolchain
@pytest.mark.parametrize("name", GPU_RECIPES)
def test_the_stored_offload_settings_are_the_planners_pick_on_the_named_gpus(name):
    recipe = get_recipe(name)
    result = planner.plan(recipe, recipe.offload.target_gpu, recipe.offload.target_devices,
                          host_ram_gb=HOST_RAM_GB.get(name))
    picked = plan_result.choose(result).candidate
    assert (picked.activations, picked.optimizer_state, picked.offload.params) == \
        (recipe.offload.activations, recipe.offload.optimizer_state, recipe.offload.params), plan_render.render(result)


def test_the_gpu_check_of_the_picks_runs_each_one_h200_recipes_own_micro_batch():
    """benchmarks/recipe_picks.py (run on the GPU machine) must not fail there for the first time."""
    from benchmarks import recipe_picks

    picked = recipe_picks.cases()
    assert sorted(picked) == sorted(name for name in GPU_RECIPES
                                    if (get_recipe(name).offload.target_gpu, get_recipe(name).offload.target_devices)
                                    == ("h200", 1))
    for name, (recipe_name, overrides) in picked.items():
        recipe, step = get_recipe(name), get_recipe(recipe_name, overrides)
        assert step.train.global_batch // step.train.grad_accum == recipe.train.global_batch // recipe.train.grad_accum
        assert step.train.grad_accum == recipe_picks.MICRO_BATCHES and step.offload == recipe.offload
    # Judged before any process takes the GPU: only the MoE recipe's state outgrows the GPU machine's RAM.
    too_big = {name: recipe_picks.does_not_fit_the_gpu_machine(name) for name in picked}
    assert {name for name, why in too_big.items() if why} == {"qwen3_30b_a3b"}
    assert "at state creation > 128.0 GiB" in too_big["qwen3_30b_a3b"]
    row = {"case": "gpt2_124m", "plan": "save_dots / opt state device", "micro_batch": 64,
           "peak_bytes_in_use": 30 * 2**30, "step_s": 0.1, "mfu": 0.4}
    table = recipe_picks.render([row, {"case": "qwen3_0_6b", "error": "OOM"}], {"gpt2_124m": {"hbm_bytes": 32 * 2**30}})
    assert "0.938" in table and "qwen3_0_6b     OOM" in table
