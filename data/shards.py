"""Token shards on disk: a corpus tokenized piece by piece, resumable, never whole in memory.

A shard set is a folder holding, for shard `k`:

- `shard-0000k.tokens.npy`: the token ids of consecutive documents, each
  followed by EOS (uint16 when the vocabulary fits, else uint32);
- `shard-0000k.lengths.npy`: the length of each of those documents, EOS
  included (int64), i.e. the document boundaries;

and `manifest.json`: the settings, and for every finished shard its first
document's index in the corpus, its document and token counts. A shard is
closed after the document at which it reaches `shard_tokens` tokens, so the
boundaries depend only on the corpus and the tokenizer: never on chunking,
on the number of processes, or on where an earlier run was stopped.

Each shard's files are written under temporary names and renamed, then the
manifest is rewritten (also by rename) to list it: a killed run leaves whole
shards listed in the manifest and, at worst, an unlisted shard that the next
run writes again. The next run skips the documents of the listed shards and
continues; `"complete": true` in the manifest marks the end of the corpus.
Peak memory is about one shard plus one chunk of text, whatever the corpus.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np

from .cache import atomic_write_array, atomic_write_bytes, exclusive_lock, load_cached_array
from .encoding import encode_chunks, text_chunks
from .tokenizer import Tokenizer

SHARD_FORMAT_VERSION = 1
# 4M tokens: 8 MB of uint16 per shard. The writer holds about three shards'
# worth at its peak (the buffer, its concatenation, the remainder), so this
# keeps that near 25 MB; a kill loses at most a few seconds of tokenizing; a
# 1B-token corpus is about 240 shards.
DEFAULT_SHARD_TOKENS = 1 << 22
MANIFEST = "manifest.json"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (half the disk and memory of uint32), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@dataclass(frozen=True)
class ShardInfo:
    """One finished shard: which documents of the corpus it holds and how many tokens."""

    index: int
    first_document: int
    num_documents: int
    num_tokens: int

    @property
    def tokens_name(self) -> str:
        return f"shard-{self.index:05d}.tokens.npy"

    @property
    def lengths_name(self) -> str:
        return f"shard-{self.index:05d}.lengths.npy"


@dataclass(frozen=True)
class TokenShards:
    """A complete shard set on disk (see the module docstring)."""

    path: Path
    shards: tuple[ShardInfo, ...]
    dtype: np.dtype
    vocab_size: int
    from_cache: bool  # True when an earlier run had finished it: nothing was tokenized
    records_without_text: int = 0   # records of the source skipped for having no text field (json, parquet)
    records_empty: int = 0   # records (or text files) skipped for an empty or blank text

    @property
    def num_documents(self) -> int:
        return sum(shard.num_documents for shard in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(shard.num_tokens for shard in self.shards)

    def lengths(self, shard: ShardInfo) -> np.ndarray:
        """Document lengths of `shard` (small: one int64 per document)."""
        return load_cached_array(self.path / shard.lengths_name, mmap=False, rebuild=self.path)

    def tokens(self, shard: ShardInfo) -> np.ndarray:
        """Tokens of `shard`, memory-mapped: only the pages read are loaded."""
        return load_cached_array(self.path / shard.tokens_name, mmap=True, rebuild=self.path)

    @classmethod
    def load(cls, path: str | os.PathLike, *, from_cache: bool = True) -> TokenShards:
        path = Path(path)
        manifest = json.loads((path / MANIFEST).read_text())
        if not manifest.get("complete"):
            raise ValueError(f"token shards at {path} are unfinished; run the preparation again to resume")
        return cls(
            path=path,
            shards=tuple(ShardInfo(**shard) for shard in manifest["shards"]),
            dtype=np.dtype(manifest["dtype"]),
            vocab_size=manifest["vocab_size"],
            from_cache=from_cache,
            records_without_text=int(manifest.get("records_without_text", 0)),
            records_empty=int(manifest.get("records_empty", 0)),
        )


class _ShardWriter:
    """Cuts a stream of encoded chunks into shards at document boundaries and writes them."""

    def __init__(self, folder: Path, manifest: dict):
        self.folder = folder
        self.manifest = manifest
        self.shard_tokens = manifest["shard_tokens"]
        self.shards = [ShardInfo(**shard) for shard in manifest["shards"]]
        self.next_document = sum(shard.num_documents for shard in self.shards)
        self.tokens_written = sum(shard.num_tokens for shard in self.shards)
        self._tokens: list[np.ndarray] = []
        self._lengths: list[np.ndarray] = []
        self._buffered = 0

    @property
    def empty(self) -> bool:
        """Nothing written and nothing buffered: the corpus had no documents."""
        return not self.shards and not self._buffered

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        self._tokens.append(tokens)
        self._lengths.append(lengths)
        self._buffered += len(tokens)
        while self._buffered >= self.shard_tokens:
            lengths = np.concatenate(self._lengths)
            # The shard closes after the first document that brings it to shard_tokens.
            last = int(np.searchsorted(np.cumsum(lengths), self.shard_tokens))
            self._flush(last + 1, lengths)

    def finish(self) -> None:
        if self._buffered:
            lengths = np.concatenate(self._lengths)
            self._flush(len(lengths), lengths)
        self.manifest["complete"] = True
        self._write_manifest()

    def _flush(self, num_documents: int, lengths: np.ndarray) -> None:
        tokens = np.concatenate(self._tokens)
        shard_lengths, rest_lengths = lengths[:num_documents], lengths[num_documents:]
        size = int(shard_lengths.sum())
        shard = ShardInfo(len(self.shards), self.next_document, num_documents, size)
        write_shard_file(self.folder / shard.tokens_name, tokens[:size])
        write_shard_file(self.folder / shard.lengths_name, shard_lengths)
        self.shards.append(shard)
        self.next_document += num_documents
        self.tokens_written += size
        # A copy: a view would keep the whole concatenated buffer alive until the next shard.
        self._tokens = [tokens[size:].copy()] if size < len(tokens) else []
        self._lengths = [rest_lengths] if len(rest_lengths) else []
        self._buffered = len(tokens) - size
        self._write_manifest()

    def _write_manifest(self) -> None:
        self.manifest["shards"] = [vars(shard) for shard in self.shards]
        atomic_write_bytes(self.folder / MANIFEST, json.dumps(self.manifest, indent=1).encode())


def write_shard_file(path: Path, array: np.ndarray) -> None:
    """One shard file, atomically (a seam for tests that stop a run between shards)."""
    atomic_write_array(path, array)


def _cap(chunks: Iterator[tuple[np.ndarray, np.ndarray]], remaining: int):
    """The chunks up to `remaining` tokens in all, the document reaching the cap cut short."""
    for tokens, lengths in chunks:
        if remaining <= 0:
            return
        if len(tokens) >= remaining:
            ends = np.cumsum(lengths)
            last = int(np.searchsorted(ends, remaining))  # the document holding the cap
            kept = lengths[: last + 1].copy()
            kept[-1] -= int(ends[last] - remaining)
            yield tokens[:remaining], kept
            return
        remaining -= len(tokens)
        yield tokens, lengths


def prepare_token_shards(
    open_documents: Callable[[int], datasets.Dataset | datasets.IterableDataset],
    tokenizer: Tokenizer,
    folder: str | os.PathLike,
    *,
    description: str,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    max_tokens: int | None = None,
    num_proc: int | None = None,
    settings: dict | None = None,
) -> TokenShards:
    """Tokenize the corpus into shards under `folder`, resuming an interrupted run there.

    `open_documents(start)` is called only when there is work left, and gives
    the corpus from its document `start` on, as documents with a "text"
    column (a stream is fine: it is read once, in order). `folder` must be named by a key of everything the
    shards depend on (source, tokenizer, shard_tokens, max_tokens):
    a manifest found there is trusted. `settings` go into the manifest for
    people reading it.
    """
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be positive or None, got {max_tokens}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(folder / ".lock"):
        # Temporaries of a killed writer (under the lock, no live writer has any).
        for stale in folder.glob(".*.tmp-*"):
            stale.unlink(missing_ok=True)
        manifest_path = folder / MANIFEST
        if manifest_path.is_file():
            manifest = json.loads(manifest_path.read_text())
            if manifest.get("complete"):
                return TokenShards.load(folder, from_cache=True)
        else:
            manifest = {
                "version": SHARD_FORMAT_VERSION,
                "source": description,
                "tokenizer": tokenizer.fingerprint,
                "vocab_size": tokenizer.vocab_size,
                "dtype": token_dtype(tokenizer.vocab_size).name,
                "shard_tokens": shard_tokens,
                "max_tokens": max_tokens,
                "settings": settings or {},
                "shards": [],
                "complete": False,
            }
        writer = _ShardWriter(folder, manifest)
        documents = open_documents(writer.next_document)
        encoded = encode_chunks(text_chunks(documents), tokenizer, np.dtype(manifest["dtype"]), num_proc=num_proc)
        chunks = encoded if max_tokens is None else _cap(encoded, max_tokens - writer.tokens_written)
        try:
            for tokens, lengths in chunks:
                writer.add(tokens, lengths)
        finally:
            encoded.close()  # a capped stream stops its worker processes here
        if writer.empty:
            raise ValueError(f"source {description!r} holds no non-empty documents")
        counter = getattr(documents, "records_without_text", None)
        if counter is not None and max_tokens is None:   # read to its end: the count is the source's
            manifest["records_without_text"] = counter.count
            manifest["records_empty"] = counter.empty
        writer.finish()
    return TokenShards.load(folder, from_cache=False)
