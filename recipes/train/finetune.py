"""Fine-tuning from a spillway run: the weights `checkpoint.init_from` names, and the tokenizer they need.

Embeddings are rows indexed by token id: weights trained with one tokenizer
are meaningless under another, and a fine-tune on new data would otherwise
train a new tokenizer on that data. So a fine-tune reuses the source run's
tokenizer (`<source run>/tokenizer.json` or `tokenizer.model`), copied into
the new run under its own file name, with the `tokenizer_config.json` that
names its special tokens and whether the source run put a BOS before each
document (`Tokenizer.save_to_directory`, recipes/train/tokenization_record.py),
so that the new run tokenizes as the source did and stays usable (and
resumable) if the source is moved or deleted; a chat template the source's
tokenizer_config.json holds is kept there too. The recipe the
run trains (and saves) names that copy in `data.tokenizer`.

A tokenizer given on purpose (`data.tokenizer`) is used as given, but its
vocabulary size must equal the source tokenizer's; a different one with the
same size is reported, since that may be deliberate (a retrained tokenizer
with the same ids for the common pieces).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from spillway.data import load_tokenizer, tokenizer_file_in
from spillway.recipes.config import Recipe
from spillway.recipes.train import distributed
from spillway.recipes.train.checkpoint import resolve_step_dir, run_dir_of
from spillway.recipes.train.errors import RunError
from spillway.recipes.train.tokenization_record import recorded_bos


class FineTuneTokenizerError(RunError):
    """The tokenizer of a fine-tune cannot be the one its weights were trained with."""


def check_not_its_own_source(recipe: Recipe) -> None:
    """A fine-tune's init_from inside its own checkpoint.dir is no fine-tune: a ConfigError saying what to do."""
    from spillway.layers.errors import ConfigError

    init_from = recipe.checkpoint.init_from
    if not init_from or init_from.startswith("hf:"):
        return
    given, run_dir = Path(init_from).expanduser().resolve(), Path(recipe.run_dir).expanduser().resolve()
    if given == run_dir or run_dir in given.parents:
        raise ConfigError(f"checkpoint.init_from={init_from} is inside this run's own checkpoint.dir ({run_dir}): "
                          f"to continue this run, leave checkpoint.init_from unset (a rerun resumes); to "
                          f"fine-tune from it, set checkpoint.dir to a new folder")


def keep_started_source(recipe: Recipe, saved_recipe_json: str) -> Recipe:
    """A fine-tune resumed without naming checkpoint.init_from again (its steps hold the whole model, so the
    source may be gone) keeps the source and the tokenizer its saved recipe names: without them, data.tokenizer
    (its copy of the source's tokenizer) was unset and the resume refused as a change of tokenizer, advising to
    fine-tune with checkpoint.init_from. A recipe that names a source, or a run that started without one, is
    returned as it is."""
    import json

    if recipe.checkpoint.init_from:
        return recipe
    try:
        saved = json.loads(saved_recipe_json)
    except json.JSONDecodeError:
        return recipe   # the restore says the step is corrupt
    checkpoint = (saved.get("checkpoint") or {}) if isinstance(saved, dict) else {}
    source, tokenizer = checkpoint.get("init_from"), (saved.get("data") or {}).get("tokenizer")
    if not isinstance(source, str):
        return recipe
    data = recipe.data
    if data.tokenizer is None and isinstance(tokenizer, str):
        data = dataclasses.replace(data, tokenizer=tokenizer)
    return dataclasses.replace(recipe, data=data, checkpoint=dataclasses.replace(
        recipe.checkpoint, init_from=source, init_from_origin=checkpoint.get("init_from_origin")))


def source_tokenizer_path(init_from: str) -> Path | None:
    """The tokenizer file (tokenizer.json or tokenizer.model) of the spillway run a checkpoint is in, else None."""
    source_run = run_dir_of(resolve_step_dir(init_from))
    return None if source_run is None else tokenizer_file_in(Path(source_run))


def with_source_tokenizer(recipe: Recipe, run_dir: Path, *, resuming: bool, say=print) -> Recipe:
    """The fine-tune recipe with `data.tokenizer` set to the tokenizer its weights were trained with.

    Call only when `recipe.checkpoint.init_from` is set. A run that resumes
    keeps the copy it made when it started.
    """
    init_from = recipe.checkpoint.init_from
    if resuming and recipe.data.tokenizer is not None:
        return recipe  # checked when the fine-tune started; the source may be gone by now
    own_copy = tokenizer_file_in(run_dir) if resuming else None
    if own_copy is not None:
        return dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, tokenizer=str(own_copy.absolute())))
    source = source_tokenizer_path(init_from)
    if recipe.data.tokenizer is not None:
        if source is not None:
            _check_same_vocabulary(Path(recipe.data.tokenizer), source, init_from, say)
        return recipe
    if source is None:
        raise FineTuneTokenizerError(
            f"checkpoint.init_from={init_from}: no tokenizer.json or tokenizer.model in the run directory of that "
            f"checkpoint, so the tokenizer its embeddings were trained with is unknown; set data.tokenizer to "
            f"that tokenizer's file")
    source_tokenizer = load_tokenizer(source)   # with the special tokens named beside it
    kept_bos = recorded_bos(source.parent)      # and tokenizing as the source run did: with a BOS or without
    if kept_bos is not None:
        source_tokenizer = source_tokenizer.with_bos(kept_bos)
    own_copy = (Path(run_dir) / source_tokenizer.file_name).absolute()
    if distributed.is_main_process():
        # the tokenizer file under its own name (bytes unchanged) and a tokenizer_config.json naming EOS/BOS
        source_tokenizer.save_to_directory(own_copy.parent)
        _keep_chat_template(source.parent, own_copy.parent)
        if load_tokenizer(own_copy).fingerprint != source_tokenizer.fingerprint:
            raise FineTuneTokenizerError(f"{own_copy}: the copy of {source} does not read back as the same "
                                         f"tokenizer; set data.tokenizer to {source}")
    distributed.barrier("spillway-finetune-tokenizer")
    say(f"fine-tune: using the tokenizer of {init_from} ({source}), copied to {own_copy}")
    return dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, tokenizer=str(own_copy)))


def _keep_chat_template(source_dir: Path, run_dir: Path) -> None:
    """The source run's chat template (a chat/instruct run keeps it in its tokenizer_config.json) into the copy's
    tokenizer_config.json, which save_to_directory wrote without one: a fine-tune of a fine-tune renders its
    conversations as the source did unless data.chat_template says otherwise."""
    from spillway.data.chat_template_files import tokenizer_templates, write_templates

    found = tokenizer_templates(source_dir)
    if found is not None:
        write_templates(run_dir, found[0])


def _check_same_vocabulary(given_path: Path, source_path: Path, init_from: str, say) -> None:
    given, source = load_tokenizer(given_path), load_tokenizer(source_path)
    if given.vocab_size != source.vocab_size:
        raise FineTuneTokenizerError(
            f"data.tokenizer={given_path} has {given.vocab_size} tokens, but the weights of "
            f"checkpoint.init_from={init_from} were trained with {source_path} ({source.vocab_size} tokens): "
            f"their embedding rows would mean other tokens; leave data.tokenizer unset to reuse the source's")
    if given.fingerprint != source.fingerprint:
        say(f"fine-tune: data.tokenizer={given_path} differs from the tokenizer the weights were trained with "
            f"({source_path}), with the same vocabulary size; token ids keep their embedding rows only if the "
            f"two tokenizers agree on them")
