"""Deterministic, resumable batches of packed rows for one or many processes.

The global batch sequence depends only on (rows, global_batch_size, seed,
shuffle): epoch `e` visits the rows in the permutation drawn from
`(seed, e)`, `global_batch_size` rows per step, and the last partial batch of
an epoch is dropped (the next epoch's permutation differs, so no row is
starved). Each process takes its contiguous slice of every global batch, so
the batches a run sees are the same whatever its process count, and a run can
resume on a different number of hosts from the same `state()`. With rows
memory-mapped (`PackedData`), a process reads only the rows it serves.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


CORPUS_CHANGED = ("; the corpus packs into another number of rows than when this state was saved: the corpus (or "
                  "its tokenization) changed since, so the saved data position means nothing now; restore the "
                  "corpus the run trained on, or train into another checkpoint.dir")


def rows_changed_hint(mismatched: dict) -> str:
    """What a changed row count means, for a loader-state mismatch message ("" if the rows agree)."""
    return CORPUS_CHANGED if "num_rows" in mismatched else ""


def local_batch_size(global_batch_size: int, process_index: int, process_count: int) -> int:
    """Rows of every global batch that one process serves; ValueError naming a split that cannot work.

    Process `i` serves rows [i * local, (i + 1) * local) of each global batch
    (BatchLoader, and data/mixture.py's MixtureLoader).
    """
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
    if global_batch_size % process_count:
        raise ValueError(
            f"global_batch_size {global_batch_size} is not divisible by process_count "
            f"{process_count}; every process must get the same number of rows"
        )
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is outside [0, {process_count})")
    return global_batch_size // process_count


class BatchLoader:
    """Iterator of int32 [global_batch_size // process_count, seq_len + 1] batches, forever."""

    def __init__(
        self,
        rows: np.ndarray,
        *,
        global_batch_size: int,
        seed: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        shuffle: bool = True,
    ):
        if rows.ndim not in (2, 3):   # 3: fine-tuning rows, [num_rows, planes, seq_len + 1] (data/sft_packing.py)
            raise ValueError(f"rows must be a [num_rows, seq_len + 1] array, got shape {rows.shape}")
        self.local_batch_size = local_batch_size(global_batch_size, process_index, process_count)
        if len(rows) < global_batch_size:
            raise ValueError(
                f"only {len(rows)} rows for a global batch of {global_batch_size}; "
                f"use a smaller batch or a larger corpus"
            )
        self.rows = rows
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.process_index = process_index
        self.process_count = process_count
        self.batches_per_epoch = len(rows) // global_batch_size
        self.epoch = 0
        self.position = 0  # index of the next batch within the epoch
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.rows))
            else:
                self._order = np.arange(len(self.rows))
            self._order_epoch = self.epoch
        return self._order

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> np.ndarray:
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
        start = self.position * self.global_batch_size + self.process_index * self.local_batch_size
        indices = self._epoch_order()[start : start + self.local_batch_size]
        self.position += 1
        return np.asarray(self.rows[indices], dtype=np.int32)

    def state(self) -> dict:
        """Where the loader stands, as plain JSON-able values (store it with the checkpoint)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_rows": len(self.rows),
            "global_batch_size": self.global_batch_size,
        }

    def restore(self, state: dict) -> None:
        """Continue exactly where `state()` was taken; refuses a state from other data or settings, and one
        whose position is no position of this loader (DamagedLoaderState)."""
        if not isinstance(state, dict):
            raise DamagedLoaderState(f"the loader state is a JSON {type(state).__name__}, not an object")
        expected = {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_rows": len(self.rows),
            "global_batch_size": self.global_batch_size,
        }
        mismatched = {k: (state.get(k), v) for k, v in expected.items() if k in state and state[k] != v}
        if mismatched:
            details = ", ".join(f"{k}: saved {saved}, now {now}" for k, (saved, now) in mismatched.items())
            raise ValueError(f"loader state does not match this loader ({details}){rows_changed_hint(mismatched)}")
        self.epoch = saved_count(state, "epoch")
        # batches_per_epoch itself: the epoch's last batch taken, the next call starts the next epoch
        self.position = saved_count(state, "position", most=self.batches_per_epoch)


class DamagedLoaderState(ValueError):
    """A saved loader state with a field missing, of another type, or out of range: a damaged record (a resume
    sets that step aside, as it does a step whose arrays are damaged), not a changed setting."""


def saved_count(state: dict, key: str, most: int | None = None) -> int:
    """`state[key]`, a whole number from 0 (to `most`); else DamagedLoaderState naming the field."""
    value = state.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (most is not None and value > most):
        allowed = f"0 to {most}" if most is not None else "0 or more"
        raise DamagedLoaderState(f"the loader state's {key!r} is {value!r}, not a whole number from {allowed}")
    return value


def eval_batches(
    rows: np.ndarray, *, global_batch_size: int, process_index: int = 0, process_count: int = 1
) -> Iterator[np.ndarray]:
    """One in-order pass over `rows` (e.g. the validation split), same slicing as `BatchLoader`."""
    loader = BatchLoader(
        rows,
        global_batch_size=global_batch_size,
        process_index=process_index,
        process_count=process_count,
        shuffle=False,
    )
    for _ in range(loader.batches_per_epoch):
        yield next(loader)
