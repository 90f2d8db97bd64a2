"""Validation held out by document: a seeded hash of each document's index decides its split.

Holding out whole packed rows (what a row-level split does) lets one document
straddle the split: its first half trains the model and its second half then
"validates" it. Here every document is scored by a hash of (seed, its index
in the corpus), a number uniform in [0, 1); documents scoring below the
threshold (`val_fraction` by default) are validation, the rest training, and
each split is packed on its own. The score of a document depends only on its
index and the seed, so the split can be decided shard by shard, in any order,
without holding the corpus, and the same corpus and seed always give the same
split.

On a corpus of a handful of documents the expected fraction can select too
few tokens for a single validation row; `validation_threshold` then raises the
threshold to take documents in order of their score until one row is filled
(still whole documents, still deterministic).

A document holding more tokens than the validation set should have (a corpus
of small files and one large one) would make the validation set most of the
corpus when it scores low: `choose_holdout` then keeps documents longer than
that share in training (`Holdout.max_document_tokens`) and picks the
threshold among the others. On an ordinary corpus no document is that long,
and the split is the threshold's alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

_MASK64 = (1 << 64) - 1


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijective, well-mixed hash of uint64 values (Steele et al. 2014)."""
    with np.errstate(over="ignore"):  # the arithmetic is modulo 2^64 on purpose
        mixed = values + np.uint64(0x9E3779B97F4A7C15)
        mixed = (mixed ^ (mixed >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        mixed = (mixed ^ (mixed >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return mixed ^ (mixed >> np.uint64(31))


def document_scores(first_document: int, count: int, seed: int) -> np.ndarray:
    """Scores in [0, 1) of documents `first_document .. first_document + count - 1` under `seed`."""
    if first_document < 0 or count < 0:
        raise ValueError(f"document range must be non-negative, got first={first_document} count={count}")
    seed_key = _splitmix64(np.array([seed & _MASK64], dtype=np.uint64))
    indices = np.arange(first_document, first_document + count, dtype=np.uint64)
    hashed = _splitmix64(indices ^ seed_key)
    # The top 53 bits as a float64 in [0, 1): exact, and equal on every platform.
    return (hashed >> np.uint64(11)).astype(np.float64) * 2.0**-53


def validation_threshold(
    lengths_per_shard: Sequence[np.ndarray],
    first_documents: Sequence[int],
    *,
    val_fraction: float,
    seed: int,
    min_val_tokens: int,
) -> float:
    """The score below which a document is held out for validation.

    `val_fraction` itself, unless the documents below it hold fewer than
    `min_val_tokens` tokens (a tiny corpus); then the documents with the
    lowest scores are taken until they do. 0 when `val_fraction` is 0.
    """
    if val_fraction <= 0:
        return 0.0
    val_tokens = 0
    for lengths, first in zip(lengths_per_shard, first_documents):
        val_tokens += int(lengths[document_scores(first, len(lengths), seed) < val_fraction].sum())
    if val_tokens >= min_val_tokens:
        return val_fraction
    # Rare (a corpus of a few documents): rank every document by score.
    scores = np.concatenate(
        [document_scores(first, len(lengths), seed) for lengths, first in zip(lengths_per_shard, first_documents)]
    )
    lengths = np.concatenate(list(lengths_per_shard))
    order = np.argsort(scores, kind="stable")
    filled = np.searchsorted(np.cumsum(lengths[order]), min_val_tokens)  # first index reaching the target
    if filled + 1 >= len(order):
        return 1.0  # every document: the caller reports that nothing is left to train on
    return float(scores[order[filled + 1]])


@dataclasses.dataclass(frozen=True)
class Holdout:
    """Which documents are validation: those scoring below `threshold`, unless longer than
    `max_document_tokens` (None: of any length)."""

    threshold: float
    max_document_tokens: int | None = None

    def is_validation(self, first_document: int, lengths: np.ndarray, seed: int) -> np.ndarray:
        held = document_scores(first_document, len(lengths), seed) < self.threshold
        return held if self.max_document_tokens is None else held & (lengths <= self.max_document_tokens)


def choose_holdout(
    lengths_per_shard: Sequence[np.ndarray],
    first_documents: Sequence[int],
    *,
    val_fraction: float,
    seed: int,
    min_val_tokens: int,
) -> Holdout:
    """`validation_threshold`'s split, unless it holds more than twice `val_fraction` of the tokens (and more
    than `min_val_tokens`): then the documents longer than the validation share stay in training and the
    threshold is chosen among the rest, where they can fill `min_val_tokens`."""
    plain = Holdout(validation_threshold(lengths_per_shard, first_documents, val_fraction=val_fraction, seed=seed,
                                         min_val_tokens=min_val_tokens))
    total = sum(int(lengths.sum()) for lengths in lengths_per_shard)
    held = sum(int(lengths[plain.is_validation(first, lengths, seed)].sum())
               for lengths, first in zip(lengths_per_shard, first_documents))
    if held <= max(2 * val_fraction * total, min_val_tokens):
        return plain
    cap = max(min_val_tokens, int(val_fraction * total))
    # The long documents counted as empty: never enough alone, and never taken (is_validation drops them).
    short = [np.where(lengths <= cap, lengths, 0) for lengths in lengths_per_shard]
    threshold = validation_threshold(short, first_documents, val_fraction=val_fraction, seed=seed,
                                     min_val_tokens=min_val_tokens)
    return plain if threshold >= 1.0 else Holdout(threshold, cap)
