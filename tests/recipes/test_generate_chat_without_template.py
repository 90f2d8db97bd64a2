"""`spillway generate --chat` on a run that has no chat template: one line a generate user can act on.

The template lookup's own error advises `data.chat_template`, a training setting
`spillway generate` has no option for; the line names the run, says it trained
without a template, and offers --prompt. No model is built: the template is
resolved before the weights are read.
"""

import pytest

from spillway.data import load_tokenizer
from spillway.layers.errors import ConfigError
from spillway.recipes.train.chat_prompt import chat_prompt
from spillway.recipes.registry import get_recipe
from user_files import write_hf_tokenizer


def test_a_text_run_asked_to_chat_says_to_use_prompt(tmp_path):
    tokenizer = load_tokenizer(write_hf_tokenizer(tmp_path / "run"))   # a text run's: no chat template
    with pytest.raises(ConfigError, match=r"^--chat: the run at .*run has no chat template \(it trained on "
                                          r"data.format=text .*continue a text with --prompt") as error:
        chat_prompt(tmp_path / "run", get_recipe("tiny"), tokenizer, "hello")
    assert "data.chat_template" not in str(error.value)
