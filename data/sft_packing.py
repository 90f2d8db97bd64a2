"""Fine-tuning examples packed into rows, whole: tokens, target flags and example ids, cached as `.npy`.

`prepare_sft_rows` turns a chat/instruct source into `PackedData` whose
`train`/`val` arrays are [rows, 3, seq_len + 1]:

    plane 0 (TOKENS)   token ids (0 on padding)
    plane 1 (TARGETS)  1 where the token is a target (an answer's token, data/sft_targets.py)
    plane 2 (SEGMENTS) which example of the row the token belongs to: 1, 2, ...; 0 on padding

A row holds whole examples: an example of up to `seq_len + 1` tokens (the
row's `seq_len` inputs and its last target) is never split across rows.
`packing="pack"` puts consecutive examples into a row while they fit;
`"pad"` gives each example its own row. An example longer than a row is cut
to its first `seq_len + 1` tokens (`overlong="truncate"`) or left out
(`"drop"`); either way it is counted (`PackedData.overlong_examples`).
Whole examples are held out for validation by a seeded hash of their index
(data/holdout.py).

Out of core: the examples are tokenized as a stream into flat files on
disk (only their lengths are held), then laid out into rows memory-mapped.
The folder is named by a key of everything the rows depend on and written
under a temporary name, so a killed preparation leaves nothing half-made
(and starts over); a finished one is only loaded.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from spillway.layers.errors import DataError

from .cache import atomic_directory, stable_key
from .chat_template import ChatTemplate
from .holdout import document_scores
from .packing import PackedData, _readable
from .sft_formats import iter_records, messages_of
from .sft_targets import conversation_tokens, special_token_texts
from .sources import source_fingerprint
from .tokenizer import Tokenizer

TOKENS, TARGETS, SEGMENTS = 0, 1, 2
PACKINGS = ("pack", "pad")
OVERLONG_POLICIES = ("truncate", "drop")
_SFT_PACKING_VERSION = 1


@dataclasses.dataclass(frozen=True)
class SftOptions:
    """What the rows depend on besides the source and tokenizer."""

    data_format: str
    seq_len: int
    packing: str = "pack"
    overlong: str = "truncate"
    train_on_prompt: bool = False
    val_fraction: float = 0.02
    seed: int = 0

    def key_parts(self) -> tuple:
        return dataclasses.astuple(self)


@dataclasses.dataclass
class _SplitWriter:
    """One split's examples as flat files of tokens and flags, and their lengths."""

    folder: Path
    name: str
    lengths: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.tokens = open(self.folder / f"{self.name}.tokens", "wb")
        self.flags = open(self.folder / f"{self.name}.flags", "wb")

    def add(self, ids: np.ndarray, flags: np.ndarray) -> None:
        self.tokens.write(np.asarray(ids, np.int32).tobytes())
        self.flags.write(np.asarray(flags, np.uint8).tobytes())
        self.lengths.append(len(ids))

    def close(self) -> None:
        self.tokens.close()
        self.flags.close()


def row_layout(lengths: list[int], row_len: int, packing: str) -> list[list[int]]:
    """The examples (indices) of each row: consecutive examples while they fit, or one a row (`pad`)."""
    rows: list[list[int]] = []
    used = row_len
    for index, length in enumerate(lengths):
        if packing == "pad" or used + length > row_len:
            rows.append([])
            used = 0
        rows[-1].append(index)
        used += length
    return rows


def _write_rows(writer: _SplitWriter, path: Path, row_len: int, packing: str) -> int:
    layout = row_layout(writer.lengths, row_len, packing)
    rows = np.lib.format.open_memmap(path, mode="w+", dtype=np.int32, shape=(len(layout), 3, row_len))
    total = sum(writer.lengths)
    tokens = np.memmap(writer.folder / f"{writer.name}.tokens", np.int32, "r", shape=(total,)) if total else None
    flags = np.memmap(writer.folder / f"{writer.name}.flags", np.uint8, "r", shape=(total,)) if total else None
    starts = np.concatenate([[0], np.cumsum(writer.lengths)]).astype(np.int64)
    for row, examples in enumerate(layout):
        column = 0
        for segment, example in enumerate(examples, start=1):
            a, b = starts[example], starts[example + 1]
            rows[row, TOKENS, column: column + b - a] = tokens[a:b]
            rows[row, TARGETS, column: column + b - a] = flags[a:b]
            rows[row, SEGMENTS, column: column + b - a] = segment
            column += b - a
    rows.flush()
    del rows, tokens, flags
    return len(layout)


def _tokenized_examples(source: str, tokenizer: Tokenizer, template: ChatTemplate, options: SftOptions,
                        cache_dir: Path):
    """(index, ids, flags, where) of every record, as a stream."""
    specials = special_token_texts(tokenizer)
    for index, record in enumerate(iter_records(source, cache_dir=cache_dir)):
        ids, flags = conversation_tokens(template, tokenizer, messages_of(record, options.data_format), specials,
                                         record.where, options.train_on_prompt)
        yield index, ids, flags, record.where


def prepare_sft_rows(source: str, tokenizer: Tokenizer, template: ChatTemplate, options: SftOptions, *,
                     cache_dir: str | os.PathLike) -> PackedData:
    """Tokenize, pack and cache a chat/instruct source (module docstring); a second call only loads."""
    row_len = options.seq_len + 1
    key = stable_key("sft", _SFT_PACKING_VERSION, source_fingerprint(source), tokenizer.fingerprint,
                     template.source, sorted(template.special_tokens.items()), options.key_parts())
    final = Path(cache_dir) / "sft" / f"{_readable(source)}-{options.seq_len}-{key[:16]}"
    if (final / "meta.json").is_file():
        return PackedData.load(final, from_cache=True)
    overlong = examples = target_tokens = 0
    num_tokens = 0
    with atomic_directory(final) as partial:
        splits = {"train": _SplitWriter(partial, "train"), "val": _SplitWriter(partial, "val")}
        try:
            for index, ids, flags, _ in _tokenized_examples(source, tokenizer, template, options,
                                                            Path(cache_dir) / "datasets"):
                examples += 1
                if len(ids) > row_len:
                    overlong += 1
                    if options.overlong == "drop":
                        continue
                    ids, flags = ids[:row_len], flags[:row_len]
                score = document_scores(index, 1, options.seed)[0]
                held_out = options.val_fraction > 0 and score < options.val_fraction
                splits["val" if held_out else "train"].add(ids, flags)
                num_tokens += len(ids)
                target_tokens += int(flags[1:].sum())
        finally:
            for writer in splits.values():
                writer.close()
        if not splits["train"].lengths or (options.val_fraction > 0 and not splits["val"].lengths):
            wanted = "a training and a validation example" if options.val_fraction > 0 else "a training example"
            raise DataError(f"data.source {source!r}: {examples} examples ({overlong} longer than a row of "
                            f"{row_len} tokens{', dropped' if options.overlong == 'drop' else ''}) do not give "
                            f"{wanted}; use more records" + (" or data.val_fraction=0" if options.val_fraction else ""))
        counts = {name: _write_rows(writer, partial / f"{name}.npy", row_len, options.packing)
                  for name, writer in splits.items()}
        for name in splits:
            for suffix in ("tokens", "flags"):
                (partial / f"{name}.{suffix}").unlink()
        meta = {"seq_len": options.seq_len, "vocab_size": tokenizer.vocab_size, "num_tokens": num_tokens,
                "num_documents": examples, "train_rows": counts["train"], "val_rows": counts["val"],
                "train_examples": len(splits["train"].lengths), "val_examples": len(splits["val"].lengths),
                "overlong_examples": overlong, "overlong_policy": options.overlong, "target_tokens": target_tokens,
                "source": source, "tokenizer": tokenizer.fingerprint, "chat_template": template.origin,
                "options": dataclasses.asdict(options), "key": key}
        (partial / "meta.json").write_text(json.dumps(meta, indent=2))
    return PackedData.load(final, from_cache=False)
