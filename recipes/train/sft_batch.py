"""The train step's batch when it is more than token rows: targets masked, examples that do not see each other.

A text run's batch holds only its tokens (recipes/train/batch.py: the
program it always was). A fine-tuning run (data/sft_packing.py: rows of
tokens, target flags and example ids) and a text run with
`data.document_mask` also fill the Batch's loss_mask (1 where target t
counts: a target flag, inside the example it continues), segment_ids and
positions, and the step sets loss_denominator when it accumulates.

Built on the host from the loader's rows (`batch_from_rows`), so the device
program only reads them. `TrainBatch` is batch.Batch, by its older name.
"""

from __future__ import annotations

import numpy as np

from spillway.recipes.train.batch import Batch

TrainBatch = Batch


def positions_in_segments(segment_ids: np.ndarray) -> np.ndarray:
    """Each token's offset from the start of its run of equal segment ids, per row."""
    b, t = segment_ids.shape
    index = np.broadcast_to(np.arange(t), (b, t))
    starts = np.zeros((b, t), bool)
    starts[:, 0] = True
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return (index - first).astype(np.int32)


def text_segments(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """Example ids of packed text rows: a document runs through its EOS; the next starts after it."""
    ends = tokens == eos_id
    return (1 + np.cumsum(ends, axis=1) - ends).astype(np.int32)


def batch_from_rows(rows: np.ndarray, *, document_mask: bool, eos_id: int | None = None):
    """The step's Batch from the loader's local rows (module docstring): only the tokens for plain text."""
    rows = np.asarray(rows, np.int32)
    if rows.ndim == 2 and not document_mask:
        return Batch(rows)
    if rows.ndim == 2:
        tokens, segments = rows, text_segments(rows, eos_id)
        targets = np.ones_like(rows[:, 1:], bool)
    else:
        tokens, targets, segments = rows[:, 0], rows[:, 1, 1:].astype(bool), rows[:, 2]
        targets &= segments[:, 1:] > 0
    # A target counts inside the example its input belongs to, never across into the next one.
    loss_mask = (targets & (segments[:, 1:] == segments[:, :-1])).astype(np.float32)
    if not document_mask:
        return TrainBatch(tokens, loss_mask)
    inputs_segments = segments[:, :-1]
    return TrainBatch(tokens, loss_mask, inputs_segments, positions_in_segments(inputs_segments))


def with_step_denominator(batch, grad_accum: int):
    """`batch` with `loss_denominator` set to its target count / `grad_accum` (traced, inside the step):
    the mean of the micro-batches' losses is then the mean over all of the step's targets."""
    if batch.loss_mask is None:
        return batch
    import jax.numpy as jnp

    per_micro = jnp.sum(batch.loss_mask) / grad_accum
    return batch._replace(loss_denominator=jnp.full((batch.tokens.shape[0],), per_micro, jnp.float32))
