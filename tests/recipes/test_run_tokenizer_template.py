"""The chat template a fine-tune trained with reaches RUN_DIR/tokenizer_config.json, wherever the tokenizer kept it.

A Hugging Face tokenizer folder holds its template in its tokenizer_config.json
or, as transformers 5 saves it, in chat_template.jinja beside it. The run copies
the tokenizer into RUN_DIR (writing a new tokenizer_config.json there) and then
records the template it rendered the data with: that must be the source folder's
template, not a lookup in RUN_DIR, which at that moment holds none. A fine-tune of
such a run copies its tokenizer with that template. No model runs.
"""

import json

import pytest

from spillway.data import load_tokenizer
from spillway.recipes.registry import get_recipe
from spillway.recipes.train.data_pipeline import run_chat_template, save_run_tokenizer
from user_files import write_hf_tokenizer

TEMPLATE = ("{% for m in messages %}{{ '<|begin|>' + m['role'] + '\n' + m['content'] + eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|begin|>assistant\n' }}{% endif %}")


@pytest.mark.parametrize("kept_in", ["tokenizer_config.json", "chat_template.jinja"])
def test_the_tokenizer_folders_own_template_is_recorded_in_the_run(tmp_path, kept_in):
    source = write_hf_tokenizer(tmp_path / "checkpoint")
    if kept_in == "chat_template.jinja":
        (source / kept_in).write_text(TEMPLATE)
    else:
        config = json.loads((source / kept_in).read_text())
        (source / kept_in).write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    recipe = get_recipe("tiny", [f"data.tokenizer={source}", "data.format=chat", "model.vocab_size=512"])
    tokenizer = load_tokenizer(source)
    assert run_chat_template(recipe, tokenizer).source == TEMPLATE   # what the rows were rendered with
    save_run_tokenizer(tokenizer, tmp_path / "run", recipe)
    saved = json.loads((tmp_path / "run" / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == TEMPLATE and saved["eos_token"] == "<|endoftext|>"


def test_a_fine_tune_of_a_fine_tune_keeps_the_source_runs_chat_template(tmp_path):
    """The source is a chat run: its RUN_DIR/tokenizer_config.json holds the template it trained with. The copy
    a fine-tune of it makes (the tokenizer file and a fresh tokenizer_config.json) must hold it too, or the
    second fine-tune stops after preparing nothing, saying the tokenizer has no chat template."""
    from spillway.recipes.train.finetune import with_source_tokenizer

    source = write_hf_tokenizer(tmp_path / "source")
    config = json.loads((source / "tokenizer_config.json").read_text())
    (source / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    step = source / "checkpoints" / "5"
    (step / "params").mkdir(parents=True)   # a step folder as the weights' reader finds it; never read here
    (step / "_CHECKPOINT_METADATA").write_text("{}")
    recipe = get_recipe("tiny", [f"checkpoint.init_from={source}", "data.format=chat", "model.vocab_size=512"])
    recipe = with_source_tokenizer(recipe, tmp_path / "run", resuming=False, say=lambda line: None)
    copied = json.loads((tmp_path / "run" / "tokenizer_config.json").read_text())
    assert copied["chat_template"] == TEMPLATE
    assert run_chat_template(recipe, load_tokenizer(recipe.data.tokenizer)).source == TEMPLATE
