"""From a recipe's DataConfig to tokenizer + packed rows + loaders (the glue between recipes and data/).

A run reads one corpus (`data.source`) or a mixture of weighted sources
(`data.mixture`, data/mixture.py). Either way `prepare` gives a
`TrainingData`: every source packed on its own with one tokenizer, held out
by document, and

* `loader`: the batches the run trains on: `BatchLoader` over one corpus,
  `MixtureLoader` over a mixture (rows follow the weights deterministically;
  its state, saved with every checkpoint, resumes exactly);
* `validation_sets`: the held-out rows, by source name. The train loop
  reports a loss per source (`val_loss/<name>`) and, as `val_loss`, their
  average under the mixture's weights: the expected loss of a batch drawn as
  the run draws its training batches. One corpus has one set and `val_loss`
  is simply its loss.

Without `data.tokenizer` one is trained: on the corpus, or on the mixture's
sources taken in turn document by document (`interleave_documents`).

Process 0 trains the tokenizer and tokenizes first; the others wait at a
barrier and then load the cached results, so several processes never race on
the same cache files.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from spillway.data import (BatchLoader, MixtureLoader, PackedData, Tokenizer, check_no_tokens_added, check_vocab,
                           interleave_documents, load_tokenizer, parse_mixture, prepare_tokens, stream_documents,
                           train_tokenizer)
from spillway.data.mixture import shared_files_notes
from spillway.data.sources import parse_hub_spec, parse_local_spec
from spillway.data.spm_tokenizer import NoTextError
from spillway.layers.errors import DataError
from spillway.recipes.config import Recipe
from spillway.recipes.train import distributed

CORPUS = "corpus"   # the one source's name when the run reads data.source


@dataclasses.dataclass(frozen=True)
class TrainingData:
    """The packed rows of every source a run reads, and the mixture's weights (None: one corpus)."""

    sources: dict[str, PackedData]
    weights: dict[str, float] | None

    @property
    def is_mixture(self) -> bool:
        return self.weights is not None

    @property
    def seq_len(self) -> int:
        return next(iter(self.sources.values())).seq_len

    @property
    def from_cache(self) -> bool:
        return all(packed.from_cache for packed in self.sources.values())

    def describe(self) -> str:
        """One line: rows per split of each source (and its weight in a mixture)."""
        def rows(packed: PackedData) -> str:
            skipped = ", ".join(part for part in (
                f"{packed.records_without_text} records without a text field" if packed.records_without_text else "",
                f"{packed.records_empty} with an empty text" if packed.records_empty else "") if part)
            skipped = f" ({skipped} skipped)" if skipped else ""
            if packed.overlong_policy is not None:
                done = "truncated" if packed.overlong_policy == "truncate" else "dropped"
                if done == "truncated" and packed.cut_target_tokens:   # how much of the answers the cut took
                    share = packed.cut_target_tokens / (packed.cut_target_tokens + packed.target_tokens)
                    done += (f", cutting {packed.cut_target_tokens} answer tokens ({share:.0%} of them: raise "
                             f"data.seq_len to keep them)")
                unanswered = (f"; {packed.no_answer_examples} without an answer to train on, skipped"
                              if packed.no_answer_examples else "")
                if packed.answer_cut_examples:   # the cut took all of their answer
                    unanswered += (f"; {packed.answer_cut_examples} cut before their answer, skipped (raise "
                                   f"data.seq_len to keep them)")
                skipped += (f" ({packed.num_documents} examples, {packed.target_tokens} target tokens; "
                            f"{packed.overlong_examples} longer than a row {done}{unanswered})")
            if packed.val.shape[0] > packed.train.shape[0] and packed.overlong_policy is None:
                # documents are held out whole: a corpus of a few long ones can give validation most rows
                skipped += (" (more val rows than train rows: the corpus is a few long documents, each held out "
                            "whole; add documents, or set data.val_fraction=0)")
            return f"{packed.train.shape[0]} train rows, {packed.val.shape[0]} val rows{skipped}"

        if not self.is_mixture:
            return f"{rows(self.sources[CORPUS])} of {self.seq_len + 1} tokens"
        parts = "; ".join(f"{name} (weight {self.weights[name]:.3g}): {rows(packed)}"
                          for name, packed in self.sources.items())
        return f"mixture of {len(self.sources)} sources, rows of {self.seq_len + 1} tokens: {parts}"

    def loader(self, recipe: Recipe, process_index: int, process_count: int) -> BatchLoader | MixtureLoader:
        """The training batches, from the start (restore a checkpoint's loader state to continue)."""
        options = dict(global_batch_size=recipe.train.global_batch, seed=recipe.train.seed,
                       process_index=process_index, process_count=process_count)
        if not self.is_mixture:
            return BatchLoader(self.sources[CORPUS].train, **options)
        return MixtureLoader({name: packed.train for name, packed in self.sources.items()}, self.weights, **options)

    def check_token_ids(self, batch: np.ndarray, vocab_size: int) -> None:
        """DataError naming the packed caches when a batch holds an id the model has no embedding row for."""
        batch = batch[:, 0] if batch.ndim == 3 else batch   # fine-tuning rows: plane 0 holds the tokens
        largest = int(batch.max()) if batch.size else 0
        if largest >= vocab_size or (batch.size and int(batch.min()) < 0):
            folders = ", ".join(str(packed.path) for packed in self.sources.values())
            raise DataError(f"a batch holds token id {largest if largest >= vocab_size else int(batch.min())}, "
                            f"outside the model's vocabulary (0..{vocab_size - 1}): the packed data cache is "
                            f"damaged or was written with another tokenizer ({folders}); delete it and run again "
                            f"to rebuild it (the checkpoints are not affected)")

    def validation_sets(self) -> dict[str, np.ndarray]:
        """The held-out rows of each source, by name."""
        return {name: packed.val for name, packed in self.sources.items()}


def source_notes_of(recipe: Recipe) -> list[str]:
    """What reading each source leaves out (data/sources.py `LocalSpec.notes`: the other splits, skipped files),
    and a mixture's sources that read the same files."""
    components = parse_mixture(recipe.data.mixture) if recipe.data.mixture else ()
    sources = {c.name: c.source for c in components} or {CORPUS: recipe.data.source}
    notes, files = [], {}
    for name, source in sources.items():   # each local source's folder walked once, for both kinds of line
        if parse_hub_spec(source) is None:
            local = parse_local_spec(source, recipe.data.split)
            notes += local.notes(source)
            files[name] = local.files
    return notes + shared_files_notes(files)   # (one source shares with none)


def load_or_train_tokenizer(recipe: Recipe) -> Tokenizer:
    cfg = recipe.data
    if cfg.tokenizer:
        tokenizer = load_tokenizer(cfg.tokenizer)
        if tokenizer.path is None or not (tokenizer.path.parent / "checkpoints").is_dir():
            check_no_tokens_added(tokenizer)   # (a run's own copy, a fine-tune's source: read as it trained)
        return tokenizer
    if cfg.format != "text":
        raise DataError(f"data.format={cfg.format} needs a tokenizer (data.tokenizer, or the one of "
                        f"checkpoint.init_from): a tokenizer trained on chat records would not know the model's")
    # A stream: the tokenizer trains on the head of the corpus, which is never copied whole.
    sources = [c.source for c in parse_mixture(cfg.mixture)] if cfg.mixture else [cfg.source]
    streams = [stream_documents(source, text_field=cfg.text_field, cache_dir=cfg.cache_path / "datasets",
                                split=cfg.split) for source in sources]
    documents = streams[0] if len(streams) == 1 else interleave_documents(streams)
    try:
        return train_tokenizer(documents, vocab_size=recipe.model.vocab_size, model_type=cfg.tokenizer_type,
                               cache_dir=cfg.cache_path / "tokenizers")
    except NoTextError as error:   # the trainer knows its sentences, not where they came from: name the corpus
        corpus = f"data.mixture {cfg.mixture!r}" if cfg.mixture else f"data.source {cfg.source!r}"
        raise DataError(f"{corpus}: {error}") from None


def run_chat_template(recipe: Recipe, tokenizer: Tokenizer):
    """The chat template a chat/instruct run renders with (data/chat_template.py), its special tokens filled in
    from the tokenizer where its files name none."""
    from spillway.data.chat_template import resolve_chat_template
    from spillway.data.sft_targets import adds_bos, template_special_tokens

    directory = tokenizer.path.parent if tokenizer.path is not None else None
    return resolve_chat_template(recipe.data.chat_template, directory, template_special_tokens(tokenizer),
                                 bos_first=adds_bos(tokenizer))


def end_of_turn_warning(recipe: Recipe, tokenizer: Tokenizer) -> str | None:
    """The warning for a chat template that ends no answer with an end-of-turn token (data/sft_targets.py)."""
    from spillway.data.sft_targets import answer_end_warning, special_token_texts

    return answer_end_warning(run_chat_template(recipe, tokenizer), special_token_texts(tokenizer))


def prepare_fine_tuning_rows(recipe: Recipe, tokenizer: Tokenizer, source: str) -> PackedData:
    """A chat/instruct source tokenized and packed whole (data/sft_packing.py)."""
    from spillway.data.sft_packing import SftOptions, prepare_sft_rows

    cfg = recipe.data
    options = SftOptions(cfg.format, cfg.seq_len, packing=cfg.packing, overlong=cfg.overlong,
                         train_on_prompt=cfg.train_on_prompt, val_fraction=cfg.val_fraction, seed=recipe.train.seed,
                         split=cfg.split, max_tokens=cfg.max_tokens)
    return prepare_sft_rows(source, tokenizer, run_chat_template(recipe, tokenizer), options,
                            cache_dir=cfg.cache_path)


def save_run_tokenizer(tokenizer: Tokenizer, run_dir: Path, recipe: Recipe) -> None:
    """The tokenizer into RUN_DIR (`spillway generate` reads it); a chat/instruct run's tokenizer_config.json
    also holds the chat template it trained with, so `spillway generate --chat` renders the same turns."""
    # Resolved before the copy: saving points the tokenizer at RUN_DIR, whose fresh tokenizer_config.json holds
    # no template, while the one the rows were rendered with sits beside the source file (or is named).
    template = run_chat_template(recipe, tokenizer) if recipe.data.format != "text" else None
    tokenizer.save_to_directory(run_dir)
    if template is not None:
        from spillway.data.chat_template_files import write_templates

        write_templates(Path(run_dir), template.all_named, template.special_tokens)


def _check_validation_rows(recipe: Recipe, data: TrainingData, resuming: bool = False) -> None:
    """A validation set smaller than one global batch would give no evaluation at all: say so before training.
    A resume refuses another data.val_fraction or global batch, so there only train.eval_every=0 is advised."""
    if not recipe.train.eval_every:
        return
    for name, rows in data.validation_sets().items():
        if len(rows) < recipe.train.global_batch:
            where = f"data.mixture source {name!r}" if data.is_mixture else f"data.source {recipe.data.source!r}"
            fix = (f"a resume keeps data.val_fraction ({recipe.data.val_fraction}) and the global batch, so set "
                   f"train.eval_every=0 (or train into another checkpoint.dir with a larger data.val_fraction)"
                   if resuming else f"raise data.val_fraction (now {recipe.data.val_fraction}) or set "
                   f"train.eval_every=0")
            raise DataError(f"{where}: {len(rows)} validation rows, fewer than one global batch "
                            f"({recipe.train.global_batch} rows), so it cannot be evaluated: {fix}")


def prepare(recipe: Recipe, tokenizer: Tokenizer | None = None,
            bos: bool | None = None, resuming: bool = False) -> tuple[Tokenizer, TrainingData]:
    """Tokenizer and packed rows for the recipe, computed once per cache key.

    `tokenizer`: the one a resumed run trained with (its RUN_DIR copy), used instead of `data.tokenizer` or
    training one. `bos`: whether a BOS starts each document, as a resumed run started (else `data.add_bos`,
    else as the tokenizer's family does: data/tokenizer.py). `resuming`: the run resumes a step of its own, which
    keeps its data settings."""
    given = tokenizer
    cfg = recipe.data
    components = parse_mixture(cfg.mixture) if cfg.mixture else None
    bos = cfg.add_bos if bos is None else bos

    def build():
        tokenizer = given if given is not None else load_or_train_tokenizer(recipe)
        try:
            if bos is not None:
                tokenizer = tokenizer.with_bos(bos)
            tokenizer.document_prefix()   # a BOS asked of a tokenizer without one: one line, before tokenizing
        except ValueError as error:
            raise DataError(str(error)) from None
        check_vocab(tokenizer, recipe.model.vocab_size, weights_from=recipe.checkpoint.init_from)
        # Packing ends every document with the EOS: a tokenizer without one fails here, saying where it looked.
        _ = tokenizer.eos_id
        options = dict(seq_len=cfg.seq_len, cache_dir=cfg.cache_path, val_fraction=cfg.val_fraction,
                       num_proc=cfg.num_proc, seed=recipe.train.seed, text_field=cfg.text_field,
                       max_tokens=cfg.max_tokens, shard_tokens=cfg.shard_tokens, split=cfg.split)
        if cfg.format != "text" and components is None:
            data = TrainingData({CORPUS: prepare_fine_tuning_rows(recipe, tokenizer, cfg.source)}, None)
        elif cfg.format != "text":   # a mixture of chat/instruct sources, each packed whole on its own
            total = sum(c.weight for c in components)
            data = TrainingData(_each_source(components, cfg.format,
                                             lambda source: prepare_fine_tuning_rows(recipe, tokenizer, source)),
                                {c.name: c.weight / total for c in components})
        elif components is None:
            data = TrainingData({CORPUS: prepare_tokens(cfg.source, tokenizer, **options)}, None)
        else:
            total = sum(c.weight for c in components)
            data = TrainingData(_each_source(components, cfg.format,
                                             lambda source: prepare_tokens(source, tokenizer, **options)),
                                {c.name: c.weight / total for c in components})
        _check_validation_rows(recipe, data, resuming)
        return tokenizer, data

    if distributed.is_main_process():
        result = build()
        distributed.barrier("spillway-data-ready")
        return result
    distributed.barrier("spillway-data-ready")
    return build()


def _each_source(components, data_format: str, prepare_one) -> dict[str, PackedData]:
    """Each mixture source prepared; a source that cannot be is named by its mixture name, with the format every
    source of the mixture is read in (a chat source beside text ones was told to set data.format=text, which
    the chat source then failed: advice in a circle)."""
    prepared = {}
    for component in components:
        try:
            prepared[component.name] = prepare_one(component.source)
        except (DataError, ValueError) as error:
            said = " ".join(str(error).split())
            shared = (f" (every source of a mixture is read as data.format={data_format}: mix sources of one "
                      f"format)" if "data.format" in said else "")
            raise DataError(f"data.mixture source {component.name!r}: {said}{shared}") from None
    return prepared


def train_loader(data: TrainingData, recipe: Recipe, process_index: int,
                 process_count: int) -> BatchLoader | MixtureLoader:
    return data.loader(recipe, process_index, process_count)
