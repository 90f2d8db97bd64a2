"""Fine-tuning records as conversations: `data.format` chat and instruct, and where records come from.

* `chat`: a record holds `messages`, a list of `{"role", "content"}`; the
  ShareGPT spelling `conversations` with `{"from", "value"}` is accepted too
  (`human` -> user, `gpt` -> assistant, `system` stays).
* `instruct`: a record holds `instruction`, an optional `input` and `output`;
  it becomes a one-turn chat: the user's message is the instruction, then a
  blank line and the input when there is one; the assistant's is the output.

Records are read as a stream (`iter_records`) of one split (`data.split`;
data/local_files.py names a folder's splits): local `.jsonl` files (also
compressed) line by line (so a bad record is named by file and line),
everything else (`.json`, `.parquet`, `save_to_disk` folders, Hub datasets)
through a `datasets` stream (named by record number). Nothing is held beyond
the record being converted.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from spillway.layers.errors import DataError

from .corpus_errors import parse_jsonl_line
from .local_files import SAVED, corpus_suffix, open_binary
from .sources import TEXT_SUFFIXES, parse_hub_spec, parse_local_spec

FORMATS = ("text", "chat", "instruct")
SFT_FORMATS = ("chat", "instruct")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "tool": "tool", "function": "tool"}


@dataclass(frozen=True)
class Record:
    """One record of a fine-tuning source and where it is (for messages)."""

    fields: dict
    where: str   # "FILE, line N" or "SOURCE, record N"


def _where_fields(record: Record) -> str:
    return f"{record.where} (fields found: {', '.join(sorted(record.fields)) or 'none'})"


def _text(value) -> bool:
    return isinstance(value, str)


def _json_kind(value) -> str:
    """What a JSON value is, as a message names it ("null", "a number", ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    kinds = ((str, "a string"), (int, "a number"), (float, "a number"), (list, "a list"), (dict, "an object"))
    return next((kind for cls, kind in kinds if isinstance(value, cls)), type(value).__name__)


def _not_text(fields: dict, names: tuple[str, ...]) -> str:
    """'; "content" is null' for each field that is there but not a string: "fields found" lists a field whose
    value is null as found, so the line must say why it does not count."""
    return "".join(f'; "{name}" is {_json_kind(fields[name])}' for name in names
                   if name in fields and not _text(fields[name]))


def chat_messages(record: Record) -> list[dict]:
    """The conversation of a `chat` record; DataError naming the record when it is not one."""
    fields = record.fields
    if "messages" in fields:
        raw, role_key, text_key, roles = fields["messages"], "role", "content", None
    elif "conversations" in fields:
        raw, role_key, text_key, roles = fields["conversations"], "from", "value", _SHAREGPT_ROLES
    else:
        hint = ("; a text corpus? set data.format=text" if "text" in fields else
                "; an instruction record? set data.format=instruct" if "instruction" in fields else "")
        raise DataError(f"data.format=chat: record {_where_fields(record)} has no \"messages\" (a list of "
                        f"{{\"role\", \"content\"}}) or \"conversations\" (a list of {{\"from\", \"value\"}})"
                        f"{hint}")
    if not isinstance(raw, list) or not raw:
        raise DataError(f"data.format=chat: record {record.where}: the conversation is not a non-empty list")
    messages = []
    for index, message in enumerate(raw):
        if not isinstance(message, dict) or not _text(message.get(role_key)) or not _text(message.get(text_key)):
            found = (f"fields found: {', '.join(sorted(message))}{_not_text(message, (role_key, text_key))}"
                     if isinstance(message, dict) else f"it is {_json_kind(message)}, not an object")
            raise DataError(f"data.format=chat: record {record.where}, message {index}: needs string "
                            f"\"{role_key}\" and \"{text_key}\" ({found})")
        role = message[role_key]
        role = roles.get(role, role) if roles else role
        messages.append({"role": role, "content": message[text_key]})
    return messages


def instruct_messages(record: Record) -> list[dict]:
    """The one-turn conversation of an `instruct` record (module docstring)."""
    fields = record.fields
    missing = [name for name in ("instruction", "output") if not _text(fields.get(name))]
    if missing or not (fields.get("input") is None or _text(fields.get("input"))):
        need = ", ".join(f'"{name}"' for name in missing) or '"input" as a string'
        # a chat file read as instructions
        hint = "; a chat record? set data.format=chat" if "messages" in fields or "conversations" in fields else ""
        wrong = _not_text(fields, ("instruction", "output")) + (
            _not_text(fields, ("input",)) if fields.get("input") is not None else "")
        raise DataError(f"data.format=instruct: record {_where_fields(record)} needs {need} (\"instruction\" "
                        f"and \"output\" strings, \"input\" optional{wrong}){hint}")
    user = fields["instruction"]
    if fields.get("input"):
        user = f"{user}\n\n{fields['input']}"
    return [{"role": "user", "content": user}, {"role": "assistant", "content": fields["output"]}]


def messages_of(record: Record, data_format: str) -> list[dict]:
    return chat_messages(record) if data_format == "chat" else instruct_messages(record)


def _jsonl_records(path: Path) -> Iterator[Record]:
    # read as bytes and judged as the text corpus's lines are (corpus_errors.py): a byte that is not UTF-8
    # is named with its line, never replaced inside a conversation
    with open_binary(path) as file:   # compressed files decompressed as they are read
        for number, raw in enumerate(file, start=1):
            fields, problem = parse_jsonl_line(raw.rstrip(b"\r\n"), expected="an object")
            if problem is not None:
                raise DataError(f"corpus file {str(path)!r}, line {number}: {problem}")
            if fields is not None:
                yield Record(fields, f"{path}, line {number}")


def check_not_text_corpus(source: str, data_format: str, split: str = "train") -> None:
    """DataError for a chat/instruct format on a corpus of text files (which has no records)."""
    if parse_hub_spec(source) is None:
        local = parse_local_spec(source, split)
        if local.builder == "text":
            kinds = ", ".join(sorted({corpus_suffix(path) for path in local.files})) or ", ".join(TEXT_SUFFIXES)
            raise DataError(f"data.format={data_format}: data.source {source!r} is a text corpus ({kinds} files, "
                            f"one document each), not records of conversations; set data.format=text, or point "
                            f"data.source at .jsonl/.parquet records")


def iter_records(source: str, *, split: str = "train", cache_dir: str | Path | None = None) -> Iterator[Record]:
    """Every record of a source's `split`, in order, as a stream (module docstring)."""
    hub = parse_hub_spec(source)
    if hub is None:
        local = parse_local_spec(source, split)
        if local.builder != SAVED and all(corpus_suffix(path) == ".jsonl" for path in local.files):
            for path in local.files:
                yield from _jsonl_records(path)
            return
    stream = _record_stream(source, split, cache_dir)
    for number, fields in enumerate(stream, start=1):
        yield Record(dict(fields), f"{source}, record {number}")


def _record_stream(source: str, split: str, cache_dir):
    """A `datasets` stream of whole records (every column) of `split`, through the same loaders as text sources
    (a local source's files are that split's already: `datasets` sees them as its one split, train)."""
    import datasets

    hub = parse_hub_spec(source)
    cache = None if cache_dir is None else str(cache_dir)
    try:
        if hub is not None:
            return datasets.load_dataset(**hub.load_dataset_kwargs(split=split, streaming=True), cache_dir=cache)
        local = parse_local_spec(source, split)
        if local.builder == SAVED:
            return datasets.load_from_disk(str(local.root)).to_iterable_dataset()
        return datasets.load_dataset(local.builder, data_files=[str(p) for p in local.files], split="train",
                                     streaming=True, cache_dir=cache)
    except Exception as error:
        raise DataError(f"data.source {source!r}: cannot read its records ({type(error).__name__}: "
                        f"{' '.join(str(error).split())[:300]})") from error
