"""The batch a train step reads: one object, from the loader's rows to the loss.

A `Batch` holds the arrays of one global batch, every field's first dimension
the batch:

    tokens       int32 [b, t + 1]   inputs are tokens[:, :-1], targets tokens[:, 1:]
    loss_mask    float32 [b, t]     fine-tuning, data.document_mask: 1 where target t counts; None: all
    segment_ids  int32 [b, t]       the input's example (0: padding); None: one sequence a row
    positions    int32 [b, t]       RoPE positions, restarting at 0 with each example; None: arange
    loss_denominator  float32 [b]   the step's target count / micro-batches, set by the step when it
                                    accumulates (the loss is then a mean over the whole step's targets)

It is made in one place from what the loader draws (`from_rows` for text;
recipes/train/sft_batch.batch_from_rows for fine-tuning rows and document
masks), placed on the mesh in one place (`to_global`), split into
micro-batches in one place (`micro_batches`), and read by the loss in one
place (recipes/train/step.make_loss_fn). A field left None is no input of the
compiled program: a text run's step is the program it always was. A new field
travels through the loop, the step, gradient accumulation and the divergence
check without touching them: they map over the fields.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding


class Batch(NamedTuple):
    """See the module docstring; a pytree (a NamedTuple), so jit, sharding and micro-batch splitting map
    over its fields."""

    tokens: jax.Array
    loss_mask: jax.Array | None = None
    segment_ids: jax.Array | None = None
    positions: jax.Array | None = None
    loss_denominator: jax.Array | None = None


def from_rows(rows: np.ndarray) -> Batch:
    """The batch of the rows a loader draws (data.BatchLoader, data.MixtureLoader), on the host."""
    return Batch(tokens=np.asarray(rows, np.int32))


def to_global(local: Batch, sharding: NamedSharding) -> Batch:
    """This process's part of a batch as the global arrays the step reads, split over the batch axes."""
    return jax.tree.map(lambda rows: jax.make_array_from_process_local_data(sharding, np.asarray(rows)), local)


def micro_batches(batch: Batch, grad_accum: int) -> Batch:
    """Each field as [grad_accum, batch // grad_accum, ...]: micro-batch m holds rows m, m + grad_accum, ...,
    so that every device's shard of the batch holds rows of every micro-batch (no reshuffle)."""
    return jax.tree.map(lambda a: a.reshape(-1, grad_accum, *a.shape[1:]).swapaxes(0, 1), batch)


def abstract(rows: int, seq_len: int, sharding: NamedSharding | None = None) -> Batch:
    """A batch of `rows` rows of `seq_len` + 1 tokens as ShapeDtypeStructs (with `sharding`): what the loader
    delivers, for lowering and tracing."""
    return Batch(tokens=jax.ShapeDtypeStruct((rows, seq_len + 1), jnp.int32, sharding=sharding))


class BatchFeed:
    """The batches a run trains on, in order: drawn from the loader, checked, placed on the mesh.

    `peek` draws the next batch early (the divergence check of a save reads it) and `next` then returns
    it; `state` is the loader's position before any batch peeked, so a run resumed from a checkpoint
    draws that batch again. Every batch's token ids are checked against the vocabulary: an id past the
    embedding is a damaged cache, not diverged weights (which is what it would look like)."""

    def __init__(self, data, loader, vocab_size: int, sharding: NamedSharding, as_batch=from_rows):
        self.data = data
        self.loader = loader
        self._vocab_size = vocab_size
        self._sharding = sharding
        self._as_batch = as_batch   # rows -> Batch on the host (sft_batch.batch_from_rows for fine-tuning)
        self._peeked: Batch | None = None

    def placed(self, rows: np.ndarray) -> Batch:
        """Rows of this process (the loader's, or validation rows) as a checked global batch."""
        self.data.check_token_ids(rows, self._vocab_size)
        return to_global(self._as_batch(rows), self._sharding)

    def next(self) -> Batch:
        batch = self._peeked if self._peeked is not None else self.placed(next(self.loader))
        self._peeked = None
        return batch

    def peek(self) -> Batch:
        if self._peeked is None:
            self._peeked = self.placed(next(self.loader))
        return self._peeked

    def state(self) -> dict:
        """The loader's state to save with a checkpoint: from before a batch peeked."""
        if self._peeked is not None:
            raise RuntimeError("BatchFeed.state after peek: take the state first (a resume would skip a batch)")
        return self.loader.state()

    def restore(self, state: dict) -> None:
        self._peeked = None
        self.loader.restore(state)
