"""Tokenize a corpus and pack it into fixed-length rows, cached as `.npy` files.

Every document is tokenized (`datasets.map`, batched, across `num_proc`
processes) and followed by EOS; the documents are concatenated into one token
stream and cut into rows of `seq_len + 1` tokens, so that a row gives the
model's inputs (`row[:-1]`) and targets (`row[1:]`). Tokens past the last full
row are dropped. A seeded choice of whole rows is held out for validation.

The result is stored under `cache_dir/packed/<key>/` with `train.npy`,
`val.npy` and `meta.json`, where the key covers everything the rows depend on.
The folder is written under a temporary name and renamed when complete, so an
interrupted run leaves nothing that a later run could mistake for a result.
Arrays are opened memory-mapped: a loader reads only the rows it serves.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc

from .cache import atomic_directory, stable_key
from .sources import load_documents, select_text_column, source_fingerprint
from .tokenizer import Tokenizer

_PACKING_VERSION = 1
_STREAM_BATCH = 1000


@dataclass(frozen=True, eq=False)  # arrays make field-wise == meaningless
class PackedData:
    """Packed token rows: `train` and `val` are [rows, seq_len + 1] arrays of token ids."""

    train: np.ndarray
    val: np.ndarray
    seq_len: int
    vocab_size: int
    num_tokens: int  # tokens in the stream before cutting into rows (EOS included)
    num_documents: int
    path: Path
    from_cache: bool  # True when loaded from an earlier run's result, nothing tokenized

    @classmethod
    def load(cls, path: str | os.PathLike, *, from_cache: bool = True) -> PackedData:
        """Open a packed folder written by `prepare_tokens` (arrays memory-mapped)."""
        path = Path(path)
        meta = json.loads((path / "meta.json").read_text())
        return cls(
            train=np.load(path / "train.npy", mmap_mode="r"),
            val=np.load(path / "val.npy", mmap_mode="r"),
            seq_len=meta["seq_len"],
            vocab_size=meta["vocab_size"],
            num_tokens=meta["num_tokens"],
            num_documents=meta["num_documents"],
            path=path,
            from_cache=from_cache,
        )


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (halves disk and host memory), else int32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


class _EncodeWithEos:
    """`datasets.map` function: token ids of each document followed by EOS.

    A class rather than a closure so that it pickles into `num_proc` workers
    and hashes stably for `datasets`' own fingerprinting.
    """

    def __init__(self, tokenizer: Tokenizer, num_threads: int = 1):
        self.tokenizer = tokenizer
        self.num_threads = num_threads

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        eos = self.tokenizer.eos_id
        encoded = self.tokenizer.encode(batch["text"], num_threads=self.num_threads)
        return {"ids": [ids + [eos] for ids in encoded]}


_IDS_FEATURES = datasets.Features({"ids": datasets.Sequence(datasets.Value("int32"))})


def _tokenize_dataset(
    documents: datasets.Dataset, tokenizer: Tokenizer, num_proc: int | None
) -> tuple[np.ndarray, int]:
    # One process: let sentencepiece's C++ threads use every core (no process
    # start-up, no pickling). Several processes: one thread each.
    processes = num_proc if num_proc and num_proc > 1 else None
    threads = 1 if processes else (os.cpu_count() or 1)
    tokenized = documents.map(
        _EncodeWithEos(tokenizer, threads),
        batched=True,
        batch_size=256,
        num_proc=processes,
        remove_columns=documents.column_names,
        features=_IDS_FEATURES,
        desc="tokenizing",
    )
    ids = tokenized.with_format("arrow")[:]["ids"]
    flat = pc.list_flatten(ids)
    if not flat.num_chunks:
        return np.zeros(0, np.int32), len(tokenized)
    return np.concatenate([chunk.to_numpy() for chunk in flat.chunks]), len(tokenized)


def _tokenize_stream(
    documents: datasets.IterableDataset, tokenizer: Tokenizer, max_tokens: int
) -> tuple[np.ndarray, int]:
    # A stream has no length and `map(num_proc=...)` does not apply; encode
    # in batches in this process and stop once enough tokens are in hand.
    encode = _EncodeWithEos(tokenizer, os.cpu_count() or 1)
    pieces: list[np.ndarray] = []
    total = num_documents = 0
    for batch in documents.iter(batch_size=_STREAM_BATCH):
        for ids in encode(batch)["ids"]:
            pieces.append(np.asarray(ids, dtype=np.int32))
            total += len(ids)
            num_documents += 1
        if total >= max_tokens:
            break
    return (np.concatenate(pieces) if pieces else np.zeros(0, np.int32)), num_documents


def _cut_rows(stream: np.ndarray, seq_len: int, val_fraction: float, source: str) -> tuple[int, int]:
    """Number of (total, validation) rows; raises when the corpus is too short."""
    row_len = seq_len + 1
    num_rows = len(stream) // row_len
    num_val = max(1, round(num_rows * val_fraction)) if val_fraction > 0 else 0
    rows_needed = 1 + (1 if val_fraction > 0 else 0)
    if num_rows < rows_needed or num_rows - num_val < 1:
        purpose = "one training row and one validation row" if val_fraction > 0 else "one training row"
        raise ValueError(
            f"corpus {source!r} is too short: it has {len(stream)} tokens, and {purpose} of "
            f"seq_len={seq_len} need {rows_needed * row_len} tokens ({row_len} per row); "
            f"use a larger corpus or a shorter seq_len"
            + (" or val_fraction=0" if val_fraction > 0 else "")
        )
    return num_rows, num_val


def _write_array(path: Path, array: np.ndarray) -> None:
    np.save(path, array)


def _describe(source: str | datasets.Dataset | datasets.IterableDataset) -> str:
    if isinstance(source, str):
        return source
    return f"<{type(source).__name__} {getattr(source, '_fingerprint', '')}>"


def _fingerprint(source: str | datasets.Dataset | datasets.IterableDataset, text_field: str) -> str:
    if isinstance(source, str):
        return source_fingerprint(source, text_field=text_field)
    fingerprint = getattr(source, "_fingerprint", None)
    if not fingerprint:
        raise ValueError(
            "prepare_tokens needs a source spec string or a datasets.Dataset (which carries a "
            "fingerprint); for a stream, pass its spec string"
        )
    return stable_key("dataset", fingerprint, text_field)


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
) -> PackedData:
    """Tokenize, pack and cache a corpus; a second call with the same inputs only loads.

    `source` is a spec for `load_documents` or an already loaded dataset with
    a "text" column. Streamed sources (Hub datasets) need `max_tokens`, which
    otherwise caps the token stream of any source. `num_proc=None`
    tokenizes in this process with a sentencepiece thread per core (no process
    start-up, no pickling); `num_proc > 1` runs that many `datasets.map`
    workers with one thread each, for corpora large enough to repay start-up.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be at least 1, got {seq_len}")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    description = _describe(source)
    key = stable_key(
        "packed",
        _PACKING_VERSION,
        _fingerprint(source, text_field),
        tokenizer.fingerprint,
        seq_len,
        val_fraction,
        seed,
        max_tokens,
    )
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(description).name or "source")[:40]
    final = Path(cache_dir) / "packed" / f"{readable}-{seq_len}-{key[:16]}"
    if (final / "meta.json").is_file():
        return PackedData.load(final, from_cache=True)

    if isinstance(source, str):
        documents = load_documents(source, text_field=text_field, cache_dir=Path(cache_dir) / "datasets")
    else:
        documents = select_text_column(source, text_field, description)
    if isinstance(documents, datasets.IterableDataset):
        if max_tokens is None:
            raise ValueError(
                f"source {description!r} is streamed; pass max_tokens to bound how much of it is tokenized"
            )
        stream, num_documents = _tokenize_stream(documents, tokenizer, max_tokens)
    else:
        stream, num_documents = _tokenize_dataset(documents, tokenizer, num_proc)
    if max_tokens is not None:
        stream = stream[:max_tokens]

    num_rows, num_val = _cut_rows(stream, seq_len, val_fraction, description)
    rows = stream[: num_rows * (seq_len + 1)].reshape(num_rows, seq_len + 1)
    rows = rows.astype(token_dtype(tokenizer.vocab_size), copy=False)
    is_val = np.zeros(num_rows, dtype=bool)
    is_val[np.random.default_rng(seed).permutation(num_rows)[:num_val]] = True

    meta = {
        "seq_len": seq_len,
        "vocab_size": tokenizer.vocab_size,
        "num_tokens": int(len(stream)),
        "num_documents": int(num_documents),
        "train_rows": int(num_rows - num_val),
        "val_rows": int(num_val),
        "dtype": rows.dtype.name,
        "source": description,
        "tokenizer": tokenizer.fingerprint,
        "val_fraction": val_fraction,
        "seed": seed,
        "key": key,
    }
    with atomic_directory(final) as partial:
        _write_array(partial / "train.npy", rows[~is_val])
        _write_array(partial / "val.npy", rows[is_val])
        # meta.json last: its presence is what marks a folder complete.
        (partial / "meta.json").write_text(json.dumps(meta, indent=2))
    return PackedData.load(final, from_cache=False)
