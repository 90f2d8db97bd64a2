"""The prompt of one user message under a run's chat template, and the tokens that end the answer.

`spillway generate --chat` (recipes/generate.py) and a chat or instruct run's closing sample
(recipes/train/loop.py) render the message the same way: the template saved in the run directory (its
tokenizer_config.json or chat_template.jinja), else the recipe's data.chat_template.
"""

from __future__ import annotations

from pathlib import Path

from spillway.layers.errors import ConfigError
from spillway.recipes.config import Recipe


def chat_prompt(run_dir: Path, recipe: Recipe, tokenizer, message: str) -> tuple[list[int], list[int]]:
    """(prompt ids, end-of-turn ids) of one user message under the run's chat template (data/chat_template.py):
    the template saved in the run directory, else the recipe's data.chat_template; none is a DataError."""
    from spillway.data.chat_template import resolve_chat_template, tokenizer_template
    from spillway.data.sft_targets import (adds_bos, end_of_turn_ids, prompt_tokens, special_token_texts,
                                           template_special_tokens)

    named = None if tokenizer_template(Path(run_dir)) is not None else recipe.data.chat_template
    if named is None and tokenizer_template(Path(run_dir)) is None:
        # resolve_chat_template would advise data.chat_template, a training setting generate does not take
        raise ConfigError(f"--chat: the run at {run_dir} has no chat template (it trained on data.format="
                          f"{recipe.data.format} and its tokenizer_config.json holds none), so a message cannot be "
                          f"rendered as it learnt conversations; continue a text with --prompt, or fine-tune it on "
                          f"chat or instruct data first")
    template = resolve_chat_template(named, Path(run_dir), template_special_tokens(tokenizer),
                                     bos_first=adds_bos(tokenizer))
    specials = special_token_texts(tokenizer)
    messages = [{"role": "user", "content": message}]
    return prompt_tokens(template, tokenizer, messages, specials), end_of_turn_ids(template, tokenizer, specials)
