"""The prompt of one user message under a run's chat template, and the tokens that end the answer; the prompt
of a text to continue.

`spillway generate --chat` (recipes/generate.py) and a chat or instruct run's closing sample
(recipes/train/loop.py) render the message the same way: the template saved in the run directory (its
tokenizer_config.json or chat_template.jinja), else the recipe's data.chat_template. `spillway generate
--prompt` and a text run's closing sample start a text as `text_prompt` says.
"""

from __future__ import annotations

from pathlib import Path

from spillway.layers.errors import ConfigError
from spillway.recipes.config import Recipe


def chat_prompt(run_dir: Path, recipe: Recipe, tokenizer, message: str) -> tuple[list[int], list[int]]:
    """(prompt ids, end-of-turn ids) of one user message under the run's chat template (data/chat_template.py):
    the template saved in the run directory, else the recipe's data.chat_template; none is a DataError."""
    from spillway.data.chat_template_files import tokenizer_template
    from spillway.data.sft_targets import prompt_tokens, special_token_texts

    kept = tokenizer_template(Path(run_dir)) is not None   # the template saved with the run comes first
    named = None if kept else recipe.data.chat_template
    if named is None and not kept:
        # resolve_chat_template would advise data.chat_template, a training setting generate does not take
        raise ConfigError(f"--chat: the run at {run_dir} has no chat template (it trained on data.format="
                          f"{recipe.data.format} and its tokenizer_config.json holds none), so a message cannot be "
                          f"rendered as it learnt conversations; continue a text with --prompt, or fine-tune it on "
                          f"chat or instruct data first")
    template = _template(named, run_dir, tokenizer)
    messages = [{"role": "user", "content": message}]
    return (prompt_tokens(template, tokenizer, messages, special_token_texts(tokenizer)),
            _end_of_turn(template, tokenizer))


def text_prompt(run_dir: Path, tokenizer, text: str) -> tuple[list[int], list[int], list[int]]:
    """(the ids put before the text, which the printed sample leaves out; the prompt ids; the ids it stops at) of
    a text to continue. It starts as the run's documents did, with the BOS if they had one. An empty text (or
    one of no tokens) without a BOS starts after an EOS, as every document after the first did; that EOS is put
    before the text too, so it is not printed as text (a tokenizer.json's, GPT-2's and Qwen's, printed
    '<|endoftext|>'). It stops where the run's export stops (its generation_config.json lists the end of turn
    of the chat template saved in the run): transformers' generate() on the export stopped at a chat run's
    <|im_end|> and this ran on past it."""
    prefix, text_ids = tokenizer.document_prefix(), tokenizer.encode([text])[0]
    if not prefix and not text_ids:
        prefix = [tokenizer.eos_id]
    try:
        stop_ids = end_of_turn_in_run(run_dir, tokenizer)
    except Exception:   # noqa: BLE001 - as the export leaves it out: a template kept from a base, never rendered
        stop_ids = [tokenizer.eos_id]
    return prefix, prefix + text_ids, stop_ids


def end_of_turn_in_run(run_dir: Path, tokenizer) -> list[int]:
    """The ids that end an answer under the chat template saved in the run directory: the tokenizer's EOS and
    the special tokens the template writes after an answer; the EOS alone where the run holds no template."""
    from spillway.data.chat_template_files import tokenizer_template

    if tokenizer_template(Path(run_dir)) is None:
        return [tokenizer.eos_id]
    return _end_of_turn(_template(None, run_dir, tokenizer), tokenizer)


def _template(named: str | None, run_dir: Path, tokenizer):
    from spillway.data.chat_template import resolve_chat_template
    from spillway.data.sft_targets import adds_bos, template_special_tokens

    return resolve_chat_template(named, Path(run_dir), template_special_tokens(tokenizer),
                                 bos_first=adds_bos(tokenizer))


def _end_of_turn(template, tokenizer) -> list[int]:
    from spillway.data.sft_targets import end_of_turn_ids, special_token_texts

    return end_of_turn_ids(template, tokenizer, special_token_texts(tokenizer))
