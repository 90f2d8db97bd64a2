"""Mixtures of corpora: a spec with weights, each corpus packed on its own, batches that follow the weights.

A mixture spec names each source and its weight:

    web=0.7:/data/web,code=0.3:builtin:stdlib

(`name=weight:source`, comma-separated; a source may contain ":" but not
","). Weights need not sum to 1: they are normalised.

`MixtureLoader` draws every global batch row by row: row `n` of the run
(counting across steps) comes from the source furthest behind its share,
i.e. the one maximising `weight * (n + 1) - rows taken so far` (ties to the
first listed). So after any number of rows each source's count is within one
row or so of its exact share, and every batch follows the weights closely,
with no randomness in the proportions to average out. Each source serves its
own rows in a seeded permutation per pass over it (an epoch per source: a
small source is simply repeated more often). The whole state is a handful of
integers (`state()`), and every process computes the same global assignment
and reads only its own slice of the batch, as `BatchLoader` does.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .cache import stable_key
from .loader import DamagedLoaderState, local_batch_size, rows_changed_hint, saved_count
from .packing import PackedData, prepare_tokens
from .tokenizer import Tokenizer

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class MixtureComponent:
    """One source of a mixture: its name (for logs and state), weight and source spec."""

    name: str
    weight: float
    source: str


def parse_mixture(spec: str) -> tuple[MixtureComponent, ...]:
    """Parse `name=weight:source,...` (see the module docstring); each mistake is named."""
    components = []
    for item in (part.strip() for part in spec.split(",")):
        name, equals, rest = item.partition("=")
        weight_text, colon, source = rest.partition(":")
        if not (equals and colon and source):
            raise ValueError(f"mixture item {item!r}: expected name=weight:source, e.g. web=0.7:/data/web")
        if not _NAME.match(name):
            raise ValueError(f"mixture item {item!r}: name {name!r} must be letters, digits, '_', '.' or '-'")
        try:
            weight = float(weight_text)
        except ValueError:
            raise ValueError(f"mixture item {item!r}: weight {weight_text!r} is not a number") from None
        if not (weight > 0 and np.isfinite(weight)):
            raise ValueError(f"mixture item {item!r}: weight must be a positive number, got {weight_text}")
        components.append(MixtureComponent(name, weight, source))
    names = [component.name for component in components]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"mixture {spec!r} names {', '.join(duplicates)} more than once")
    return tuple(components)


def shared_files_notes(files_by_source: Mapping[str, Iterable[Path]]) -> list[str]:
    """A warning for each pair of a mixture's local sources (by name, the files each reads) that read the same
    files (a folder and its subfolder, one folder twice): those documents are drawn under both weights, so the
    mixture is not the one its weights say."""
    files = {name: {Path(path).resolve() for path in paths} for name, paths in files_by_source.items()}
    notes = []
    names = list(files)
    for k, first in enumerate(names):
        for second in names[k + 1:]:
            shared = files[first] & files[second]
            if shared:
                example = min(shared)
                notes.append(f"warning: data.mixture sources {first!r} and {second!r} read {len(shared)} of the same "
                             f"files (e.g. {example}): their documents are drawn under both weights, more often "
                             f"than either weight says; give sources that do not overlap")
    return notes


def prepare_mixture(
    components: tuple[MixtureComponent, ...],
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    cache_dir: str | os.PathLike,
    **options,
) -> dict[str, PackedData]:
    """`prepare_tokens` of every component's source (same tokenizer and settings), by name."""
    return {
        component.name: prepare_tokens(component.source, tokenizer, seq_len=seq_len, cache_dir=cache_dir, **options)
        for component in components
    }


def interleave_documents(streams: Iterable) -> Iterator[str]:
    """The texts of several document streams taken in turn, one document from each, until all run out.

    For training one tokenizer on a mixture: the head of the result (what the
    tokenizer trainer reads) holds every source, not only the first. A stream
    is an iterable of strings or anything with `iter(batch_size)` yielding
    {"text": [...]} batches (a `datasets` stream, data/sources.py's text files).
    """
    def texts(stream) -> Iterator[str]:
        if hasattr(stream, "iter"):
            for batch in stream.iter(batch_size=64):
                yield from batch["text"]
        else:
            yield from stream

    active = [texts(stream) for stream in streams]
    while active:
        for iterator in list(active):
            text = next(iterator, None)
            if text is None:
                active.remove(iterator)
            else:
                yield text


class MixtureLoader:
    """Iterator of int32 [global_batch_size // process_count, seq_len + 1] batches drawn from weighted sources."""

    def __init__(
        self,
        rows_by_name: Mapping[str, np.ndarray],
        weights: Mapping[str, float],
        *,
        global_batch_size: int,
        seed: int = 0,
        process_index: int = 0,
        process_count: int = 1,
    ):
        self.names = tuple(rows_by_name)
        if not self.names:
            raise ValueError("a mixture needs at least one source")
        if set(weights) != set(self.names):
            raise ValueError(f"weights are given for {sorted(weights)} but the sources are {sorted(self.names)}")
        widths = {name: rows.shape[1:] for name, rows in rows_by_name.items()}
        for name, rows in rows_by_name.items():
            if rows.ndim not in (2, 3) or len(rows) == 0:
                raise ValueError(f"mixture source {name!r}: rows must be a non-empty [num_rows, seq_len + 1] array, "
                                 f"got shape {rows.shape}")
        if len(set(widths.values())) > 1:
            raise ValueError(f"mixture sources have different row lengths: {widths}; pack them with one seq_len")
        if any(not (weights[name] > 0) for name in self.names):
            raise ValueError(f"mixture weights must be positive, got {dict(weights)}")
        self.local_batch_size = local_batch_size(global_batch_size, process_index, process_count)
        self.rows = [rows_by_name[name] for name in self.names]
        total = sum(weights[name] for name in self.names)
        self.weights = np.array([weights[name] / total for name in self.names], dtype=np.float64)
        for name, share, rows in zip(self.names, self.weights, self.rows):
            # a source with fewer rows than its share of one batch repeats rows within every batch (a single
            # corpus smaller than a batch is refused alike: loader.py)
            per_batch = math.ceil(share * global_batch_size - 1e-9)
            if len(rows) < per_batch:
                raise ValueError(f"mixture source {name!r}: only {len(rows)} rows for its share of a global batch "
                                 f"({per_batch} of {global_batch_size} at weight {share:.3g}), so its rows would "
                                 f"repeat within every batch; give it more data or a smaller weight, or use a "
                                 f"smaller batch")
        self.global_batch_size = global_batch_size
        self.process_index = process_index
        self.process_count = process_count
        self.seed = seed
        # A per-source seed from its name: reordering the spec does not reshuffle a source.
        self._source_seeds = [int(stable_key("mixture-source", name)[:15], 16) for name in self.names]
        self.step = 0
        self.taken = np.zeros(len(self.names), dtype=np.int64)  # rows served so far by each source, all processes
        self._orders: dict[tuple[int, int], np.ndarray] = {}

    def _assign(self) -> tuple[np.ndarray, np.ndarray]:
        """For each row of the next global batch: its source, and its position in that source's sequence."""
        source = np.empty(self.global_batch_size, dtype=np.int64)
        position = np.empty(self.global_batch_size, dtype=np.int64)
        taken = self.taken.copy()
        served = int(taken.sum())
        for row in range(self.global_batch_size):
            chosen = int(np.argmax(self.weights * (served + row + 1) - taken))
            source[row], position[row] = chosen, taken[chosen]
            taken[chosen] += 1
        return source, position

    def _order(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        if key not in self._orders:
            if len(self._orders) > 2 * len(self.names):  # only the current epochs are ever asked for again
                self._orders.clear()
            rng = np.random.default_rng([self.seed, self._source_seeds[source], epoch])
            self._orders[key] = rng.permutation(len(self.rows[source]))
        return self._orders[key]

    def __iter__(self) -> MixtureLoader:
        return self

    def __next__(self) -> np.ndarray:
        source, position = self._assign()
        local = slice(self.process_index * self.local_batch_size, (self.process_index + 1) * self.local_batch_size)
        batch = np.empty((self.local_batch_size, *self.rows[0].shape[1:]), dtype=np.int32)
        for index in np.unique(source[local]):
            mine = source[local] == index
            num_rows = len(self.rows[index])
            epochs, offsets = np.divmod(position[local][mine], num_rows)
            rows = np.empty(len(offsets), dtype=np.int64)
            for epoch in np.unique(epochs):
                at = epochs == epoch
                rows[at] = self._order(int(index), int(epoch))[offsets[at]]
            batch[mine] = self.rows[index][rows]
        self.taken += np.bincount(source, minlength=len(self.names))
        self.step += 1
        return batch

    def state(self) -> dict:
        """Where the loader stands, as plain JSON-able values (store it with the checkpoint)."""
        return {
            "kind": "mixture",
            "step": self.step,
            "taken": {name: int(count) for name, count in zip(self.names, self.taken)},
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "weights": {name: float(weight) for name, weight in zip(self.names, self.weights)},
            "num_rows": {name: len(rows) for name, rows in zip(self.names, self.rows)},
        }

    def restore(self, state: dict) -> None:
        """Continue exactly where `state()` was taken; refuses a state from other data or settings, and a
        damaged one (DamagedLoaderState)."""
        now = self.state()
        if not isinstance(state, dict):
            raise DamagedLoaderState(f"the loader state is a JSON {type(state).__name__}, not an object")
        if state.get("kind") != "mixture":
            raise ValueError("loader state is not a mixture loader's (was the run started without a mixture?)")
        if not isinstance(state.get("taken"), dict):
            raise DamagedLoaderState(f"the mixture loader state's 'taken' is {state.get('taken')!r}, not an object")
        mismatched = {
            key: (state.get(key), now[key])
            for key in ("seed", "global_batch_size", "weights", "num_rows")
            if state.get(key) != now[key]
        }
        if set(state.get("taken", {})) != set(self.names):
            mismatched["sources"] = (sorted(state.get("taken", {})), sorted(self.names))
        if mismatched:
            details = ", ".join(f"{key}: saved {saved}, now {current}" for key, (saved, current) in mismatched.items())
            raise ValueError(f"mixture loader state does not match this loader ({details})"
                             f"{rows_changed_hint(mismatched)}")
        self.step = saved_count(state, "step")
        self.taken = np.array([saved_count(state["taken"], name) for name in self.names], dtype=np.int64)
