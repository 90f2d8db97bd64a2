"""The Llama 3.1 8B fine-tuning recipes: torchtune's single-device settings, instruction data answers-only,
the Instruct checkpoint and tokenizer by path, and what they say offline.

* `llama3_8b_sft_l4`: every weight trained, float32 AdamW state in host memory, one 24 GB L4.
* `llama3_8b_lora_16gb`: rank-16 adapters on a frozen base streamed from host memory, one 16 GB RTX 4080.

Their stored offload settings are the planner's picks: tests/recipes/test_gpu_recipes.py's slow test compiles
them with the other GPU recipes (the L4 one with --host-ram-gb 256).
"""

import pytest

from spillway.recipes import cli
from spillway.recipes.registry import get_recipe
from spillway.recipes.targets import get_target, target_for_device_kind

TOKENIZER = "meta-llama/Llama-3.1-8B-Instruct"
# torchtune recipes/configs/llama3_1/8B_{full,lora}_single_device.yaml (PagedAdamW8bit's and torch AdamW's
# defaults for what the configs leave out); rank 16 and alpha 32 for LoRA are the and "alpha = 2 x rank".
PUBLISHED = {
    "llama3_8b_sft_l4": dict(corpus="hf:tatsu-lab/alpaca", batch=2, accum=1, lr=2e-5, warmup=0, floor=1.0,
                             weight_decay=0.01, gpu="l4"),
    "llama3_8b_lora_16gb": dict(corpus="hf:yahma/alpaca-cleaned", batch=16, accum=8, lr=3e-4, warmup=100,
                                floor=0.0, weight_decay=0.01, gpu="rtx4080"),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_an_sft_recipe_keeps_torchtunes_settings_and_answers_only_instruction_data(name):
    recipe, published = get_recipe(name), PUBLISHED[name]
    data = recipe.data
    assert (data.source, data.format, data.seq_len, data.train_on_prompt) == (published["corpus"], "instruct",
                                                                                2048, False)
    assert data.uses_document_mask and recipe.execution.attention_impl == "flash"   # cuDNN cannot mask examples
    assert (data.tokenizer, data.tokenizer_origin) == (f"tokenizers/{TOKENIZER}", TOKENIZER)
    assert recipe.checkpoint.init_from == f"hf:models/{TOKENIZER}" and recipe.checkpoint.init_from_origin == TOKENIZER
    assert recipe.train.global_batch // recipe.train.grad_accum == 2                 # 2 x 2048 a micro-batch
    assert (recipe.train.global_batch, recipe.train.grad_accum) == (published["batch"], published["accum"])
    opt = recipe.optimizer
    assert (opt.learning_rate, opt.warmup_steps, opt.min_lr_ratio, opt.weight_decay) == \
        (published["lr"], published["warmup"], published["floor"], published["weight_decay"])
    assert (opt.b1, opt.b2, opt.eps, opt.clip_norm, opt.moment_dtype) == (0.9, 0.999, 1e-8, None, "float32")
    assert recipe.offload.target_gpu == published["gpu"] and recipe.offload.target_devices == 1
    assert "torchtune" in recipe.sources and "our choice" in recipe.sources


def test_the_lora_recipe_adapts_attention_and_mlp_at_rank_16():
    lora = get_recipe("llama3_8b_lora_16gb").lora
    assert (lora.rank, lora.alpha, lora.dropout) == (16, 32.0, 0.0)
    assert set(lora.targets) == {"q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert not get_recipe("llama3_8b_sft_l4").lora.enabled


def test_the_16gb_target_is_an_rtx_4080_and_is_told_from_other_rtx_cards():
    target = get_target("rtx4080")
    assert target.compute_capability == (8, 9) and target.facts.core_count == 76
    assert 15 * 2**30 < target.hbm_bytes < 16 * 2**30 and target.peak_bf16_flops == 97.5e12
    assert target_for_device_kind("NVIDIA GeForce RTX 4080").name == "rtx4080"
    assert target_for_device_kind("NVIDIA GeForce RTX 4090") is None
    assert target_for_device_kind("NVIDIA L4").name == "l4"


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_offline_an_sft_recipe_names_its_corpus_and_base_model_in_one_line(name, monkeypatch, tmp_path, capsys):
    from spillway.recipes.train import data_pipeline, loop

    def must_not_run(*args, **kwargs):
        raise AssertionError("data or the model were prepared before the missing inputs were reported")
    monkeypatch.setattr(loop, "setup", must_not_run)
    monkeypatch.setattr(data_pipeline, "prepare", must_not_run)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", name]) == cli.EXIT_USER_ERROR
    (line,) = capsys.readouterr().err.splitlines()
    # The tokenizer's local copy is not named: the checkpoint, once fetched, brings that tokenizer.
    assert f"recipe {name}: 2 inputs are missing: (1) data.source '{PUBLISHED[name]['corpus']}' is the Hugging " \
        f"Face Hub dataset" in line
    assert "data.tokenizer" not in line
    assert (f"(2) checkpoint.init_from 'hf:models/{TOKENIZER}' does not exist (it is {TOKENIZER}: fetch "
            f"it with `hf download {TOKENIZER} --exclude 'original/*' --local-dir models/{TOKENIZER}`)") in line
    assert "--set checkpoint.init_from=hf:DIR" in line
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_plan_check_takes_the_tokenizer_from_a_fetched_base_as_the_run_does(name, tmp_path, monkeypatch):
    """`spillway train NAME --plan` checks the inputs before the base is read: with the base fetched (as the
    missing-input line says) and tokenizers/<repo> not, it refused on the tokenizer that plain `train` takes
    from the checkpoint. A fetched base without a tokenizer still leaves the local copy missing."""
    from spillway.recipes.train.preflight import MissingInputError, check_run_inputs

    monkeypatch.chdir(tmp_path)
    base = tmp_path / "models" / TOKENIZER
    base.mkdir(parents=True)
    (tmp_path / "corpus.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    recipe = get_recipe(name, ["data.source=corpus.jsonl"])
    with pytest.raises(MissingInputError, match=r"data.tokenizer .* does not exist"):
        check_run_inputs(recipe)
    (base / "tokenizer.json").write_text("{}")
    check_run_inputs(recipe)


def test_a_missing_base_without_a_hub_repository_is_told_where_to_point(tmp_path, monkeypatch):
    """README's `--set checkpoint.init_from=hf:/models/Llama-3.2-1B` offline said "does not exist; or point at
    ...": an alternative to a fetch command it never gave."""
    from spillway.recipes.train.preflight import MissingInputError, check_run_inputs

    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text("a few words")
    recipe = get_recipe("llama3_1b", [f"checkpoint.init_from=hf:{tmp_path / 'gone'}", "data.source=corpus.txt"])
    with pytest.raises(MissingInputError, match=r"gone' does not exist: point at a local copy with --set "
                                                r"checkpoint.init_from=hf:DIR") as refused:
        check_run_inputs(recipe)
    assert "; or" not in str(refused.value)
