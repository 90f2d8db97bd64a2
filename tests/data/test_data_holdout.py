"""Validation by document: the seeded document score and the threshold that guarantees a validation row."""

import numpy as np
import pytest

from spillway.data import document_scores
from spillway.data.holdout import validation_threshold


def test_scores_depend_on_index_and_seed_only():
    whole = document_scores(0, 1000, seed=7)
    # Any range of documents scores as it does inside the whole corpus: shards can be split independently.
    np.testing.assert_array_equal(document_scores(300, 200, seed=7), whole[300:500])
    np.testing.assert_array_equal(document_scores(0, 1000, seed=7), whole)
    assert not np.array_equal(document_scores(0, 1000, seed=8), whole)
    assert whole.dtype == np.float64 and whole.min() >= 0 and whole.max() < 1


def test_scores_are_uniform_and_decorrelated_from_the_index():
    scores = document_scores(0, 200_000, seed=0)
    counts, _ = np.histogram(scores, bins=10, range=(0, 1))
    assert np.all(np.abs(counts - 20_000) < 600)  # binomial sd ~134
    # Neighbouring documents are not held out together more often than chance.
    held_out = scores < 0.1
    assert abs(np.mean(held_out[1:] & held_out[:-1]) - 0.01) < 0.002


def test_threshold_is_val_fraction_when_it_fills_a_row():
    lengths = [np.full(500, 100, dtype=np.int64), np.full(500, 100, dtype=np.int64)]
    assert validation_threshold(lengths, [0, 500], val_fraction=0.05, seed=0, min_val_tokens=1000) == 0.05
    assert validation_threshold(lengths, [0, 500], val_fraction=0, seed=0, min_val_tokens=1000) == 0.0


def test_threshold_rises_to_take_the_lowest_scoring_documents_until_a_row_is_full():
    lengths = [np.array([40, 40, 40]), np.array([40, 40])]
    scores = document_scores(0, 5, seed=3)
    threshold = validation_threshold(lengths, [0, 3], val_fraction=1e-9, seed=3, min_val_tokens=100)
    held_out = np.flatnonzero(scores < threshold)
    np.testing.assert_array_equal(np.sort(held_out), np.sort(np.argsort(scores)[:3]))  # 3 x 40 >= 100 > 2 x 40


@pytest.mark.parametrize("min_val_tokens", [200, 10_000])
def test_threshold_is_one_when_every_document_is_needed(min_val_tokens):
    lengths = [np.array([40, 40, 40, 40, 40])]
    assert validation_threshold(lengths, [0], val_fraction=0.01, seed=0, min_val_tokens=min_val_tokens) == 1.0
