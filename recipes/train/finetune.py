"""Fine-tuning from a spillway run: the weights `checkpoint.init_from` names, and the tokenizer they need.

Embeddings are rows indexed by token id: weights trained with one tokenizer
are meaningless under another, and a fine-tune on new data would otherwise
train a new tokenizer on that data. So a fine-tune reuses the source run's
tokenizer (`<source run>/tokenizer.model`), copied into the new run so that
the new run stays usable (and resumable) if the source is moved or deleted.
The recipe the run trains (and saves) names that copy in `data.tokenizer`.

A tokenizer given on purpose (`data.tokenizer`) is used as given, but its
vocabulary size must equal the source tokenizer's; a different one with the
same size is reported, since that may be deliberate (a retrained tokenizer
with the same ids for the common pieces).
"""

from __future__ import annotations

import dataclasses
import filecmp
import shutil
from pathlib import Path

from spillway.data import load_tokenizer, tokenizer_file_in
from spillway.recipes.config import Recipe
from spillway.recipes.train import distributed
from spillway.recipes.train.checkpoint import resolve_step_dir, run_dir_of
from spillway.recipes.train.errors import RunError

TOKENIZER_FILENAME = "tokenizer.model"  # every run keeps the tokenizer it trained with here


class FineTuneTokenizerError(RunError):
    """The tokenizer of a fine-tune cannot be the one its weights were trained with."""


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
    own_copy = (Path(run_dir) / TOKENIZER_FILENAME).absolute()
    if resuming and recipe.data.tokenizer is not None:
        return recipe  # checked when the fine-tune started; the source may be gone by now
    if resuming and own_copy.is_file():
        return dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, tokenizer=str(own_copy)))
    source = source_tokenizer_path(init_from)
    if recipe.data.tokenizer is not None:
        if source is not None:
            _check_same_vocabulary(Path(recipe.data.tokenizer), source, init_from, say)
        return recipe
    if source is None:
        raise FineTuneTokenizerError(
            f"checkpoint.init_from={init_from}: no {TOKENIZER_FILENAME} in the run directory of that checkpoint, "
            f"so the tokenizer its embeddings were trained with is unknown; set data.tokenizer to that "
            f"tokenizer's .model file")
    if distributed.is_main_process() and not (own_copy.is_file() and filecmp.cmp(source, own_copy, shallow=False)):
        own_copy.parent.mkdir(parents=True, exist_ok=True)
        tmp = own_copy.with_name(own_copy.name + ".tmp")
        shutil.copyfile(source, tmp)
        tmp.replace(own_copy)
    distributed.barrier("spillway-finetune-tokenizer")
    say(f"fine-tune: using the tokenizer of {init_from} ({source}), copied to {own_copy}")
    return dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, tokenizer=str(own_copy)))


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
