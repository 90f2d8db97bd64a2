"""The chat template a fine-tune trained with reaches RUN_DIR/tokenizer_config.json, wherever the tokenizer kept it.

A Hugging Face tokenizer folder holds its template in its tokenizer_config.json
or, as transformers 5 saves it, in chat_template.jinja beside it. The run copies
the tokenizer into RUN_DIR (writing a new tokenizer_config.json there) and then
records the template it rendered the data with: that must be the source folder's
template, not a lookup in RUN_DIR, which at that moment holds none. No model runs.
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
