"""Tokenize a corpus into shards, then pack it into fixed-length rows, cached as `.npy` files.

Two cached stages, each named by a key of everything its output depends on:

1. `cache_dir/tokens/<name>-<key>/`: the corpus tokenized shard by shard
   (`shards.py`; every document followed by EOS, document lengths kept).
   Resumable, and reused by every packing of the same corpus and tokenizer.
2. `cache_dir/packed/<name>-<seq_len>-<key>/`: `train.npy`, `val.npy` and
   `meta.json`. Whole documents are held out for validation by a seeded hash
   of their index (`holdout.py`); the training documents, in corpus order,
   are concatenated and cut into rows of `seq_len + 1` tokens, so a row gives
   the model's inputs (`row[:-1]`) and targets (`row[1:]`); the validation
   documents likewise. Tokens past each split's last full row are dropped.

Packing reads the shards memory-mapped, one at a time, and writes rows with
plain file writes, so neither stage holds more than a shard in memory. The
packed folder is written under a temporary name and renamed when complete, by
one packer at a time (a lock beside it), which first removes the temporary
folders of a killed one; the arrays are opened memory-mapped, so a loader reads
only the rows it serves.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np

from .cache import atomic_directory, disk_full_named, exclusive_lock, load_cached_array, stable_key
from .holdout import Holdout, choose_holdout
from .npy_stream import NpyStreamWriter
from .shards import DEFAULT_SHARD_TOKENS, SHARD_FORMAT_VERSION, TokenShards, prepare_token_shards
from .sources import select_text_column, source_fingerprint, stream_documents
from .tokenizer import Tokenizer

_PACKING_VERSION = 2  # 2: validation held out by document, packed from token shards


@dataclass(frozen=True, eq=False)  # arrays make field-wise == meaningless
class PackedData:
    """Packed token rows: `train` and `val` are [rows, seq_len + 1] arrays of token ids (fine-tuning rows:
    [rows, 3, seq_len + 1], tokens, target flags and example ids, data/sft_packing.py)."""

    train: np.ndarray
    val: np.ndarray
    seq_len: int
    vocab_size: int
    num_tokens: int  # tokens of the corpus (EOS included), both splits, before cutting into rows
    num_documents: int
    path: Path
    from_cache: bool  # True when loaded from an earlier run's result, nothing tokenized or packed
    records_without_text: int = 0  # records of the source skipped for having no text field
    records_empty: int = 0  # records (or text files) of the source skipped for an empty or blank text
    # Fine-tuning rows (data/sft_packing.py: [rows, 3, seq_len + 1]): examples longer than a row, and what was
    # done with them ("truncate" | "drop"); the answer tokens the loss trains on.
    overlong_examples: int = 0
    overlong_policy: str | None = None
    target_tokens: int | None = None
    cut_target_tokens: int | None = None   # answer tokens truncation cut (None: rows prepared before it was counted)
    no_answer_examples: int = 0   # examples with no token to train on (no assistant message), skipped
    answer_cut_examples: int = 0  # examples whose every answer token lay past a row's end (truncated), skipped

    @classmethod
    def load(cls, path: str | os.PathLike, *, from_cache: bool = True) -> PackedData:
        """Open a packed folder written by `prepare_tokens` (arrays memory-mapped)."""
        path = Path(path)
        meta = json.loads((path / "meta.json").read_text())
        return cls(
            train=load_cached_array(path / "train.npy", mmap=True, rebuild=path),
            val=load_cached_array(path / "val.npy", mmap=True, rebuild=path),
            seq_len=meta["seq_len"],
            vocab_size=meta["vocab_size"],
            num_tokens=meta["num_tokens"],
            num_documents=meta["num_documents"],
            path=path,
            from_cache=from_cache,
            records_without_text=int(meta.get("records_without_text", 0)),
            records_empty=int(meta.get("records_empty", 0)),
            overlong_examples=int(meta.get("overlong_examples", 0)),
            overlong_policy=meta.get("overlong_policy"),
            target_tokens=meta.get("target_tokens"),
            cut_target_tokens=meta.get("cut_target_tokens"),
            no_answer_examples=int(meta.get("no_answer_examples", 0)),
            answer_cut_examples=int(meta.get("answer_cut_examples", 0)),
        )


def _describe(source: str | datasets.Dataset | datasets.IterableDataset) -> str:
    if isinstance(source, str):
        return source
    return f"<{type(source).__name__} {getattr(source, '_fingerprint', '')}>"


def _fingerprint(source: str | datasets.Dataset | datasets.IterableDataset, text_field: str, split: str) -> str:
    if isinstance(source, str):
        return source_fingerprint(source, text_field=text_field, split=split)
    fingerprint = getattr(source, "_fingerprint", None)
    if not fingerprint:
        raise ValueError(
            "prepare_tokens needs a source spec string or a datasets.Dataset (which carries a "
            "fingerprint); for a stream, pass its spec string"
        )
    return stable_key("dataset", fingerprint, text_field)


def _readable(description: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(description).name or "source")[:40]


def _split_sizes(
    shards: TokenShards, seq_len: int, val_fraction: float, seed: int, description: str
) -> tuple[Holdout, int, int, int, int]:
    """(holdout, train rows, val rows, train documents, val documents); raises when too short."""
    row_len = seq_len + 1
    all_lengths = [shards.lengths(shard) for shard in shards.shards]
    firsts = [shard.first_document for shard in shards.shards]
    holdout = choose_holdout(all_lengths, firsts, val_fraction=val_fraction, seed=seed, min_val_tokens=row_len)
    train_tokens = val_tokens = val_documents = 0
    for lengths, first in zip(all_lengths, firsts):
        is_val = holdout.is_validation(first, lengths, seed)
        val_tokens += int(lengths[is_val].sum())
        train_tokens += int(lengths[~is_val].sum())
        val_documents += int(is_val.sum())
    train_rows, val_rows = train_tokens // row_len, val_tokens // row_len
    if train_rows < 1 or (val_fraction > 0 and val_rows < 1):
        wanted = "one training row and one validation row" if val_fraction > 0 else "one training row"
        enough = shards.num_tokens >= 2 * row_len   # long enough, but in too few documents to split in two
        documents = f"{shards.num_documents} document{'' if shards.num_documents == 1 else 's'}"
        counted = f"({train_tokens} tokens train, {val_tokens} validation)"
        no_validation = " or set data.val_fraction=0 (no validation set; a run then needs train.eval_every=0)"
        if enough and val_fraction > 0:
            # not short at all: a single file of a million tokens met "too short" and deleted nothing to fix it
            raise ValueError(
                f"corpus {description!r} cannot be split into training and validation rows: its "
                f"{shards.num_tokens} tokens are in {documents} {counted}, and the validation set takes whole "
                f"documents (a .txt file is one document; a .jsonl or .parquet file one a record), so that "
                f"{wanted} of seq_len={seq_len} cannot both be filled; split it into several files,{no_validation}")
        raise ValueError(
            f"corpus {description!r} is too short: it has {shards.num_tokens} tokens in {documents}, and {wanted} "
            f"of seq_len={seq_len} need {row_len} tokens each, from whole documents {counted}; use a larger corpus "
            f"or a shorter seq_len" + (no_validation if val_fraction > 0 else ""))
    return holdout, train_rows, val_rows, shards.num_documents - val_documents, val_documents


def _runs(flags: np.ndarray) -> list[tuple[int, int, bool]]:
    """Maximal runs of equal values in a boolean array, as (start, stop, value)."""
    if not len(flags):
        return []
    changes = np.flatnonzero(flags[1:] != flags[:-1]) + 1
    starts = np.concatenate([[0], changes])
    stops = np.concatenate([changes, [len(flags)]])
    return [(int(a), int(b), bool(flags[a])) for a, b in zip(starts, stops)]


def _write_rows(shards: TokenShards, holdout: Holdout, seed: int, train: NpyStreamWriter, val: NpyStreamWriter):
    """Stream every shard's documents into the writer of their split, in corpus order."""
    for shard in shards.shards:
        lengths = shards.lengths(shard)
        is_val = holdout.is_validation(shard.first_document, lengths, seed)
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        tokens = shards.tokens(shard)
        # Consecutive documents of one split are one contiguous slice of the
        # memory-mapped shard, written without a copy.
        for first, stop, held_out in _runs(is_val):
            writer = val if held_out else train
            start, end = int(bounds[first]), int(bounds[stop])
            writer.append(tokens[start : start + min(end - start, writer.remaining())])
        del tokens  # unmap before the next shard: its pages leave this process's resident set


def prepare_tokens(
    source: str | datasets.Dataset | datasets.IterableDataset,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    cache_dir: str | os.PathLike,
    val_fraction: float = 0.01,
    num_proc: int | None = None,
    seed: int = 0,
    text_field: str = "text",
    max_tokens: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    split: str = "train",
) -> PackedData:
    """Tokenize, pack and cache a corpus; a second call with the same inputs only loads.

    `source` is a spec for `load_documents` (read as a stream: local files are
    read in order, never copied into an Arrow cache) or an already loaded
    dataset with a `text_field` column. `max_tokens` optionally caps the
    tokens taken from the source (the head of it), streamed or not. `split`
    chooses a source spec's split (data/local_files.py).
    `val_fraction` is the expected fraction of documents held out for
    validation, chosen by `seed`. `num_proc=None` tokenizes in this process
    with a sentencepiece thread per core; `num_proc > 1` runs that many worker
    processes. A run that was killed resumes from its finished shards.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be at least 1, got {seq_len}")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    description = _describe(source)
    shards_key = stable_key(
        "tokens", SHARD_FORMAT_VERSION, _fingerprint(source, text_field, split), tokenizer.fingerprint, max_tokens,
        shard_tokens,
    )
    key = stable_key("packed", _PACKING_VERSION, shards_key, seq_len, val_fraction, seed)
    final = Path(cache_dir) / "packed" / f"{_readable(description)}-{seq_len}-{key[:16]}"
    if (final / "meta.json").is_file():
        return PackedData.load(final, from_cache=True)

    def open_documents(start: int):
        if isinstance(source, str):
            return stream_documents(source, text_field=text_field, start=start, cache_dir=Path(cache_dir) / "datasets",
                                    split=split)
        documents = select_text_column(source, text_field, description)
        if not start:
            return documents
        if isinstance(documents, datasets.Dataset):
            return documents.select(range(start, len(documents)))
        return documents.skip(start)

    shards = prepare_token_shards(
        open_documents,
        tokenizer,
        Path(cache_dir) / "tokens" / f"{_readable(description)}-{shards_key[:16]}",
        description=description,
        shard_tokens=shard_tokens,
        max_tokens=max_tokens,
        num_proc=num_proc,
        settings={"text_field": text_field},
    )
    holdout, train_rows, val_rows, train_documents, val_documents = _split_sizes(
        shards, seq_len, val_fraction, seed, description
    )
    meta = {
        "seq_len": seq_len,
        "vocab_size": tokenizer.vocab_size,
        "num_tokens": shards.num_tokens,
        "num_documents": shards.num_documents,
        "train_rows": train_rows,
        "val_rows": val_rows,
        "train_documents": train_documents,
        "val_documents": val_documents,
        "val_threshold": holdout.threshold,
        "val_max_document_tokens": holdout.max_document_tokens,   # None: any length (data/holdout.py)
        "dtype": shards.dtype.name,
        "source": description,
        "tokenizer": tokenizer.fingerprint,
        "val_fraction": val_fraction,
        "seed": seed,
        "shards": str(shards.path),
        "records_without_text": shards.records_without_text,
        "records_empty": shards.records_empty,
        "key": key,
    }
    return _write_packed(final, shards, holdout, seed, meta)


def _write_packed(final: Path, shards: TokenShards, holdout: Holdout, seed: int, meta: dict) -> PackedData:
    """The rows written into `final` under a temporary name, renamed when complete, and opened."""
    row_len = meta["seq_len"] + 1
    # One packer at a time: under the lock no live writer has a temporary folder, so those a killed packer left
    # (the whole rows, as large as the corpus's tokens, under a hidden name) are removed, not kept for good.
    with exclusive_lock(final.with_name(f".{final.name}.lock")):
        if (final / "meta.json").is_file():   # another job packed it while this one waited
            return PackedData.load(final, from_cache=True)
        for stale in final.parent.glob(f".{final.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        train_rows, val_rows = meta["train_rows"], meta["val_rows"]
        # a full disk names the rows' folder and what it needs (the OS's error from a buffered write names no file)
        with disk_full_named(final, (train_rows + val_rows) * row_len * shards.dtype.itemsize), \
                atomic_directory(final) as partial:
            with (
                NpyStreamWriter(partial / "train.npy", (train_rows, row_len), shards.dtype) as train,
                NpyStreamWriter(partial / "val.npy", (val_rows, row_len), shards.dtype) as val,
            ):
                _write_rows(shards, holdout, seed, train, val)
            # meta.json last: its presence is what marks a folder complete.
            (partial / "meta.json").write_text(json.dumps(meta, indent=2))
    return PackedData.load(final, from_cache=False)
