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
(`"drop"`); either way it is counted (`PackedData.overlong_examples`). An
example with no token to train on (no assistant message, and not
`train_on_prompt`) is skipped and counted (`PackedData.no_answer_examples`).
`max_tokens` (`data.max_tokens`) takes whole examples from the head of the
source, in order, while their tokens (as packed) fit in it, and reads no
further.
Whole examples are held out for validation by a seeded hash of their index
(data/holdout.py).

Out of core and resumable: the examples are tokenized as a stream into flat
files on disk (only their lengths are held), then laid out into rows
memory-mapped. The folder is named by a key of everything the rows depend on;
a finished one is only loaded. It is written as `.<name>.partial` beside it,
under a lock (two jobs take turns), and renamed into place once whole. Every
`PROGRESS_EVERY` examples the flat files are flushed to disk, their lengths
saved, and then `progress.json` rewritten (by rename) with how many records
were read and how many bytes each file holds: a preparation killed at any
point resumes from its last progress, cutting the files back to those bytes
and skipping the records already read, and makes the rows an uninterrupted
one makes. A record that stops it (a DataError) removes the partial folder:
the source must change, and with it the key.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np

from spillway.layers.errors import DataError

from .cache import atomic_write_array, atomic_write_bytes, disk_full_named, exclusive_lock, stable_key
from .chat_template import ChatTemplate
from .holdout import document_scores
from .npy_stream import NpyStreamWriter
from .packing import PackedData, _readable
from .sft_formats import conversation_of, iter_records
from .sft_targets import conversation_tokens, special_token_texts
from .sources import source_fingerprint
from .tokenizer import Tokenizer

TOKENS, TARGETS, SEGMENTS = 0, 1, 2
PACKINGS = ("pack", "pad")
OVERLONG_POLICIES = ("truncate", "drop")
# 2: messages keep their tool calls (and other keys), records their tools and system prompt; examples without
# an answer skipped; data.max_tokens. 3: examples whose truncation cut their whole answer skipped (they were kept,
# rows with nothing to train on), and examples whose answers are all empty (they trained the end of turn alone).
# 4: a message's reasoning under its dataset names reaches the template, and a record with tools renders with the
# tokenizer's tool_use template (data/chat_template.py): rows of such records changed. 5: assistant messages of
# OpenAI's "weight": 0 are not trained (they were). 6: an empty answer after a block the template writes (Qwen3's
# empty <think> block) trains through its end of turn (it trained nothing), and an answer whose text its reasoning
# says first trains to its end (it stopped inside the reasoning). 7: objects of Parquet, save_to_disk and Hub sources
# leave out the null keys Arrow's struct columns gave them (every tool call held every record's arguments), and
# datasets' Json columns are read as their JSON (they were refused as strings, or written into a tool as one)
_SFT_PACKING_VERSION = 7
PROGRESS = "progress.json"
# Examples between two progress saves: a kill loses at most this many examples' tokenizing (seconds).
PROGRESS_EVERY = 4096
# Rows laid out in memory before each write of the rows' file (4 MiB at seq_len 1024).
ROWS_A_WRITE = 256


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
    split: str = "train"   # the source's split (data.split); keyed through the source's fingerprint
    max_tokens: int | None = None   # data.max_tokens: whole examples from the head while they fit in it

    def key_parts(self) -> tuple:
        # without `split`: it is in `source_fingerprint`, and a tuple without it keeps the keys of rows
        # prepared before there was a split to choose
        return tuple(getattr(self, field.name) for field in dataclasses.fields(self) if field.name != "split")


@dataclasses.dataclass
class _SplitWriter:
    """One split's examples as flat files of tokens and flags, and their lengths; reopened where the last
    progress left it (`lengths`: the examples it then held; the files are cut back to their tokens)."""

    folder: Path
    name: str
    lengths: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        tokens = int(sum(self.lengths))
        self.tokens = _reopened(self.folder / f"{self.name}.tokens", 4 * tokens)
        self.flags = _reopened(self.folder / f"{self.name}.flags", tokens)

    def add(self, ids: np.ndarray, flags: np.ndarray) -> None:
        self.tokens.write(np.asarray(ids, np.int32).tobytes())
        self.flags.write(np.asarray(flags, np.uint8).tobytes())
        self.lengths.append(len(ids))

    def save_progress(self) -> None:
        """The flat files on disk, then the lengths (as many as the files hold, or more: a resume cuts them)."""
        for file in (self.tokens, self.flags):
            file.flush()
            os.fsync(file.fileno())
        atomic_write_array(self.folder / f"{self.name}.lengths.npy", np.asarray(self.lengths, np.int64))

    def close(self) -> None:
        self.tokens.close()
        self.flags.close()


def _reopened(path: Path, size: int):
    """`path` opened for appending after its first `size` bytes (what the last progress saved)."""
    file = open(path, "ab")
    file.truncate(size)
    file.seek(size)
    return file


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
    total = sum(writer.lengths)
    tokens = np.memmap(writer.folder / f"{writer.name}.tokens", np.int32, "r", shape=(total,)) if total else None
    flags = np.memmap(writer.folder / f"{writer.name}.flags", np.uint8, "r", shape=(total,)) if total else None
    starts = np.concatenate([[0], np.cumsum(writer.lengths)]).astype(np.int64)
    # Written with plain writes, a block of rows at a time, not through a writable memory map: on a full disk a
    # write through a map is a SIGBUS that ends the process without a word, a plain write an error naming it.
    with NpyStreamWriter(path, (len(layout), 3, row_len), np.int32) as rows:
        for first in range(0, len(layout), ROWS_A_WRITE):
            block = np.zeros((min(ROWS_A_WRITE, len(layout) - first), 3, row_len), np.int32)   # 0: padding
            for row, examples in enumerate(layout[first:first + ROWS_A_WRITE]):
                column = 0
                for segment, example in enumerate(examples, start=1):
                    a, b = starts[example], starts[example + 1]
                    block[row, TOKENS, column: column + b - a] = tokens[a:b]
                    block[row, TARGETS, column: column + b - a] = flags[a:b]
                    block[row, SEGMENTS, column: column + b - a] = segment
                    column += b - a
            rows.append(block)
    del tokens, flags
    return len(layout)


def _tokenized_examples(source: str, tokenizer: Tokenizer, template: ChatTemplate, options: SftOptions,
                        cache_dir: Path, skip: int = 0):
    """(index, ids, flags, where) of every record from the `skip`-th on, as a stream (earlier ones are read,
    not tokenized)."""
    specials = special_token_texts(tokenizer)
    for index, record in enumerate(iter_records(source, split=options.split, cache_dir=cache_dir)):
        if index < skip:
            continue
        conversation = conversation_of(record, options.data_format)
        if not conversation.messages:   # an empty conversation: nothing to render (a template may index turn 0)
            yield index, np.zeros(0, np.int64), np.zeros(0, bool), record.where
            continue
        ids, flags = conversation_tokens(template, tokenizer, conversation.messages, specials, record.where,
                                         options.train_on_prompt, tools=conversation.tools)
        if not options.train_on_prompt and not _answers(conversation.messages):
            # empty answers only: their targets are the end of turn alone, which would teach the model to stop at
            # once; an example with no answer (skipped and counted in _take)
            flags = np.zeros_like(flags)
        yield index, ids, flags, record.where


def _answers(messages: list[dict]) -> bool:
    """Whether any assistant message trained (not of weight 0) says something: text that is not blank, or a tool
    call."""
    return any(message.get("role") == "assistant" and message.get("weight", 1) != 0
               and (message.get("tool_calls") or str(message.get("content") or "").strip()) for message in messages)


@dataclasses.dataclass
class _Progress:
    """What `progress.json` holds: records read, and the counts of the examples written so far."""

    key: str
    records: int = 0
    overlong: int = 0
    num_tokens: int = 0
    target_tokens: int = 0
    cut_target_tokens: int = 0   # answer tokens past a row's end, cut by data.overlong=truncate
    no_answer: int = 0           # examples with no answer to train on (none, or empty ones), skipped
    answer_cut: int = 0          # examples whose answer lay wholly past a row's end (truncate), skipped
    examples: dict = dataclasses.field(default_factory=lambda: {"train": 0, "val": 0})

    @classmethod
    def resumed(cls, folder: Path, key: str) -> _Progress:
        """The folder's saved progress for `key`, or a fresh start (no file, another key, unreadable)."""
        try:
            saved = json.loads((folder / PROGRESS).read_text())
            return cls(**saved) if saved.get("key") == key else cls(key)
        except (OSError, ValueError, TypeError):
            return cls(key)

    def files_hold_their_examples(self, folder: Path) -> bool:
        for name, count in self.examples.items():
            if not count:
                continue
            try:
                tokens = int(np.load(folder / f"{name}.lengths.npy")[:count].sum())
                if (folder / f"{name}.tokens").stat().st_size < 4 * tokens or \
                        (folder / f"{name}.flags").stat().st_size < tokens:
                    return False
            except (OSError, ValueError):
                return False
        return True

    def lengths(self, folder: Path, name: str) -> list:
        """The split's example lengths as far as this progress counts them."""
        if not self.examples[name]:
            return []
        return np.load(folder / f"{name}.lengths.npy")[: self.examples[name]].tolist()

    def save(self, folder: Path, splits: dict) -> None:
        for writer in splits.values():
            writer.save_progress()
        self.examples = {name: len(writer.lengths) for name, writer in splits.items()}
        atomic_write_bytes(folder / PROGRESS, json.dumps(dataclasses.asdict(self)).encode())


def prepare_sft_rows(source: str, tokenizer: Tokenizer, template: ChatTemplate, options: SftOptions, *,
                     cache_dir: str | os.PathLike) -> PackedData:
    """Tokenize, pack and cache a chat/instruct source (module docstring); a second call only loads, a call
    after a killed one resumes it."""
    encoding = [tokenizer.chat_encoding] if getattr(tokenizer, "chat_encoding", None) else []   # (keys kept)
    named = [sorted(template.named.items())] if template.named else []   # the tool_use template renders rows too
    key = stable_key("sft", _SFT_PACKING_VERSION, source_fingerprint(source, split=options.split),
                     tokenizer.fingerprint, template.source, sorted(template.special_tokens.items()), options.key_parts(),
                     *encoding, *named)
    final = Path(cache_dir) / "sft" / f"{_readable(source)}-{options.seq_len}-{key[:16]}"
    partial = final.with_name(f".{final.name}.partial")
    with exclusive_lock(final.with_name(f".{final.name}.lock")):
        if not (final / "meta.json").is_file():
            partial.mkdir(parents=True, exist_ok=True)
            # a full disk names the folder (outside the `except` below: what was prepared is kept for the rerun)
            with disk_full_named(final, None):
                try:
                    _prepare_into(partial, source, tokenizer, template, options, key, Path(cache_dir) / "datasets")
                except DataError:
                    shutil.rmtree(partial, ignore_errors=True)
                    raise
            os.rename(partial, final)
            return PackedData.load(final, from_cache=False)
    packed = PackedData.load(final, from_cache=True)
    # rows an earlier version prepared without this check are refused as fresh ones are
    _check_targets(source, packed.num_documents, packed.target_tokens or 0, options,
                   overlong=packed.overlong_examples, answer_cut=packed.answer_cut_examples)
    return packed


def _prepare_into(partial: Path, source: str, tokenizer: Tokenizer, template: ChatTemplate, options: SftOptions,
                  key: str, datasets_dir: Path) -> None:
    """The rows and meta.json of `source` in `partial`, from its saved progress on."""
    row_len = options.seq_len + 1
    progress = _Progress.resumed(partial, key)
    if not progress.files_hold_their_examples(partial):
        progress = _Progress(key)   # files shorter than their progress says (a copy, a disk): start over
    splits = {name: _SplitWriter(partial, name, progress.lengths(partial, name)) for name in ("train", "val")}
    try:
        for index, ids, flags, _ in _tokenized_examples(source, tokenizer, template, options, datasets_dir,
                                                        skip=progress.records):
            if not _take(progress, splits, index, ids, flags, options):
                break   # data.max_tokens reached: the rest of the source is not read
            if progress.records % PROGRESS_EVERY == 0:
                progress.save(partial, splits)
        _check_targets(source, progress.records, progress.target_tokens, options, overlong=progress.overlong,
                       answer_cut=progress.answer_cut)
        _check_examples(source, splits, progress.records, progress.overlong, row_len, options)
        progress.save(partial, splits)   # every example counted: a kill while the rows are laid out resumes here
    finally:
        for writer in splits.values():
            writer.close()
    counts = {name: _write_rows(writer, partial / f"{name}.npy", row_len, options.packing)
              for name, writer in splits.items()}
    (partial / PROGRESS).unlink()    # before the flat files go: a kill from here on starts over, whole
    for name in splits:
        for suffix in ("tokens", "flags", "lengths.npy"):
            (partial / f"{name}.{suffix}").unlink(missing_ok=True)
    meta = {"seq_len": options.seq_len, "vocab_size": tokenizer.vocab_size, "num_tokens": progress.num_tokens,
            "num_documents": progress.records, "train_rows": counts["train"], "val_rows": counts["val"],
            "train_examples": len(splits["train"].lengths), "val_examples": len(splits["val"].lengths),
            "overlong_examples": progress.overlong, "overlong_policy": options.overlong,
            "target_tokens": progress.target_tokens, "cut_target_tokens": progress.cut_target_tokens,
            "no_answer_examples": progress.no_answer, "answer_cut_examples": progress.answer_cut,
            "source": source, "tokenizer": tokenizer.fingerprint,
            "chat_template": template.origin, "options": dataclasses.asdict(options), "key": key}
    (partial / "meta.json").write_text(json.dumps(meta, indent=2))


def _take(progress: _Progress, splits: dict, index: int, ids: np.ndarray, flags: np.ndarray,
          options: SftOptions) -> bool:
    """Record `index` read: its example packed (cut to a row), or skipped and counted; False, the record not
    read, when its example would take the tokens past `options.max_tokens` (whole examples, as they come)."""
    row_len = options.seq_len + 1
    if not len(ids) or (not options.train_on_prompt and not flags.any()):
        # no answer (no turns, a system prompt or questions alone): rows the loss never sees, counted in the data:
        # line
        progress.records, progress.no_answer = index + 1, progress.no_answer + 1
        return True
    if len(ids) > row_len and options.overlong == "drop":
        progress.records, progress.overlong = index + 1, progress.overlong + 1
        return True
    if options.max_tokens is not None and progress.num_tokens + min(len(ids), row_len) > options.max_tokens:
        return False
    progress.records = index + 1
    if len(ids) > row_len:
        if not options.train_on_prompt and not flags[1:row_len].any():
            # the cut would take the whole answer: a row the loss never sees (its steps logged a loss of 0.0, its
            # validation NaN), skipped and counted like an example with no answer (not as truncated too)
            progress.answer_cut += 1
            return True
        progress.overlong += 1
        progress.cut_target_tokens += int(flags[row_len:].sum())
        ids, flags = ids[:row_len], flags[:row_len]
    held_out = options.val_fraction > 0 and document_scores(index, 1, options.seed)[0] < options.val_fraction
    splits["val" if held_out else "train"].add(ids, flags)
    progress.num_tokens += len(ids)
    progress.target_tokens += int(flags[1:].sum())
    return True


def _check_targets(source: str, examples: int, target_tokens: int, options: SftOptions, *, overlong: int = 0,
                   answer_cut: int = 0) -> None:
    """DataError when no example holds a token the loss is on: every step's loss would be 0 over 0 tokens,
    a run that trains nothing while it looks finished (conversations without an assistant turn, examples
    dropped as too long, or cut before their answer). No example read at all is _check_examples' to name."""
    if target_tokens or not examples:
        return
    row = f"a row of {options.seq_len + 1} tokens (data.seq_len={options.seq_len})"
    if options.overlong == "drop" and overlong:
        raise DataError(f"data.source {source!r}: {examples} examples and none kept: every one with an answer is "
                        f"longer than {row} and data.overlong=drop dropped it ({overlong}); raise data.seq_len, "
                        f"or set data.overlong=truncate")
    if answer_cut:
        raise DataError(f"data.source {source!r}: {examples} examples and no token to train on: every answer lies "
                        f"past the end of {row} ({answer_cut} examples cut before their answer, skipped); raise "
                        f"data.seq_len")
    raise DataError(f"data.source {source!r}: {examples} examples and no token to train on: the loss is on the "
                    f"assistant's messages and the end of turn after them, and no example has an assistant "
                    f"message with something in it; add the answers, or set data.train_on_prompt=true to train "
                    f"on every token")


def _check_examples(source: str, splits: dict, examples: int, overlong: int, row_len: int,
                    options: SftOptions) -> None:
    """DataError when the examples give no training row (or no validation row when one is asked for)."""
    if splits["train"].lengths and (options.val_fraction == 0 or splits["val"].lengths):
        return
    wanted = "a training and a validation example" if options.val_fraction > 0 else "a training example"
    capped = f" within data.max_tokens={options.max_tokens}" if options.max_tokens is not None else ""
    more = "raise data.max_tokens" if options.max_tokens is not None else "use more records"
    no_validation = (" or data.val_fraction=0 (no validation set; a run then needs train.eval_every=0)"
                     if options.val_fraction else "")
    raise DataError(f"data.source {source!r}: {examples} examples{capped} ({overlong} longer than a row of "
                    f"{row_len} tokens{', dropped' if options.overlong == 'drop' else ''}) do not give "
                    f"{wanted}; {more}{no_validation}")
