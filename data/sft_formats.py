"""Fine-tuning records as conversations: `data.format` chat and instruct, and where records come from.

A record becomes what transformers' `apply_chat_template(messages, tools=...)`
takes (`Conversation`): its messages, each with its `role`, its `content` and
every other key it has (`tool_calls`, `tool_call_id`, `name`: what a template
renders them as is its business), and the record's `tools`.

* `chat`: a record holds `messages`, a list of `{"role", "content"}` (an
  assistant message with `tool_calls` may have a null `content`, OpenAI's
  form; a content given as OpenAI's list of text parts is their text,
  joined); the ShareGPT spelling `conversations` with `{"from", "value"}` is
  accepted too, with LLaMA-Factory's roles (`human` -> user, `gpt` ->
  assistant, `observation` and `function` -> tool, `system` stays;
  `function_call` -> an assistant message whose `tool_calls` are the calls
  its value holds as JSON, `{"name", "arguments"}` or a list of them). An assistant message with OpenAI's
  `"weight": 0` stays in the conversation and is not trained (data/sft_targets.py); a weight is 0 or 1.
  TRL's prompt-completion records are conversations too: `prompt` and `completion` as two lists of
  messages (joined), or as two strings (the user's message and the assistant's answer).
* `instruct`: a record holds `instruction`, an optional `input` and `output`;
  it becomes a one-turn chat: the user's message is the instruction, then a
  blank line and the input when there is one; the assistant's is the output.
  An optional `history`, a list of `[instruction, response]` pairs, gives the
  turns before it (LLaMA-Factory's alpaca format).
* Either format: a top-level `system` string is the first message (unless the
  conversation opens with that same system message), and a top-level `tools`
  (a list of function descriptions, or its JSON text, as LLaMA-Factory stores
  it) is the template's `tools`.

Records are read as a stream (`iter_records`) of one split (`data.split`;
data/local_files.py names a folder's splits): local `.jsonl` files (also
compressed) line by line (so a bad record is named by file and line),
`.parquet` files row by row and `.json` files (JSON lines, or one array) record
by record, each file by itself (a shard may have columns the others lack);
`save_to_disk` folders and Hub datasets (a `datasets` stream) batch by batch
from their Arrow tables (these with their objects as written, `_as_written`);
a `.json` of another shape through a `datasets` stream. The last three are
named by record number. Nothing is held beyond the record being converted
and its batch (a `.json` array is read whole).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from spillway.layers.errors import DataError

from .corpus_errors import first_json_error, json_kind, parse_jsonl_line, records_under, unreadable_corpus
from .local_files import SAVED, UTF8_BOM, corpus_suffix, open_binary, read_bytes
from .record_documents import readable_by_field
from .sources import TEXT_SUFFIXES, load_local_files, parse_hub_spec, parse_local_spec

FORMATS = ("text", "chat", "instruct")
SFT_FORMATS = ("chat", "instruct")
# LLaMA-Factory's ShareGPT roles, and the OpenAI names some ShareGPT exports write instead
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "function_call": "assistant", "observation": "tool", "tool": "tool",
                   "function": "tool"}
# Rows of a `save_to_disk` folder or a Hub dataset read at a time (_arrow_rows): a few MB of conversations.
ARROW_BATCH_ROWS = 1024


@dataclass(frozen=True)
class Record:
    """One record of a fine-tuning source and where it is (for messages)."""

    fields: dict
    where: str   # "FILE, line N" or "SOURCE, record N"
    from_arrow: bool = False   # read from Arrow columns (`_as_written`), which leave an object's null fields out


@dataclass(frozen=True)
class Conversation:
    """What a chat template renders: the messages, and the record's tools (the template's `tools`; None: none)."""

    messages: list
    tools: list | None = None


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


def _json_list(record: Record, what: str, value) -> list | None:
    """A list of objects given as itself, as one object, or as its JSON text (LLaMA-Factory stores `tools` as a
    string); None for none (null, "" or []: a column every record has, empty where a record has none)."""
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise DataError(f"record {record.where}: {what} is a string that is not JSON ({error.msg}, "
                            f"column {error.colno})") from None
    if isinstance(value, dict):
        value = [value]
    if value is not None and not (isinstance(value, list) and all(isinstance(v, dict) for v in value)):
        raise DataError(f"record {record.where}: {what} is {_json_kind(value)}, not a list of objects")
    return value or None


def _bad_message(record: Record, index: int, message, role_key: str, text_key: str) -> DataError:
    if not isinstance(message, dict):
        found = f"it is {_json_kind(message)}, not an object"
    else:
        found = f"fields found: {', '.join(sorted(message))}{_not_text(message, (role_key, text_key))}"
    calls_empty = isinstance(message, dict) and message.get("tool_calls") == []
    null = (f': a null "{text_key}" is read only beside a non-empty "tool_calls" (an assistant calling a tool)'
            + ('; this message\'s "tool_calls" is empty: write "" for an answer with no text' if calls_empty else "")
            if isinstance(message, dict) and text_key in message and message[text_key] is None else
            ': an empty list of parts; write "" for a message with no text'
            if isinstance(message, dict) and message.get(text_key) == [] else "")
    return DataError(f"data.format=chat: record {record.where}, message {index}: needs string "
                     f"\"{role_key}\" and \"{text_key}\" ({found}){null}")


def _sharegpt_role(record: Record, index: int, name: str) -> str:
    if name not in _SHAREGPT_ROLES:
        raise DataError(f"data.format=chat: record {record.where}, message {index}: \"from\" {name!r} is not a "
                        f"ShareGPT role read here ({', '.join(_SHAREGPT_ROLES)}); rename it in the data")
    return _SHAREGPT_ROLES[name]


def _sharegpt_call(record: Record, index: int, value) -> dict:
    """A ShareGPT `function_call` turn: the assistant calling the tools its value names (LLaMA-Factory)."""
    calls = _json_list(record, f'message {index} ("function_call")', value)
    if not calls or not all(_text(call.get("name")) for call in calls):
        raise DataError(f"data.format=chat: record {record.where}, message {index}: a \"function_call\" value "
                        f"needs the call as JSON: {{\"name\", \"arguments\"}} or a list of them")
    return {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": call} for call in calls]}


def _joined_parts(record: Record, index: int, content):
    """Content given as OpenAI's list of parts (`[{"type": "text", "text": ...}, ...]`, as transformers'
    multimodal templates take it) as the one string a text model's template renders: the text parts joined as
    those templates write them, one after the other. A part that is not text is one line: the models here read
    text only. Any other content is returned as it is, for the caller to judge."""
    if not (isinstance(content, list) and content and all(isinstance(part, dict) for part in content)):
        return content
    for number, part in enumerate(content):
        if part.get("type") != "text" or not _text(part.get("text")):
            kind = part.get("type")
            raise DataError(f"data.format=chat: record {record.where}, message {index}, content part {number}: "
                            + (f"of type {kind!r}; the models here read text only: keep the text parts"
                               if kind not in (None, "text") else "needs \"type\": \"text\" and a string \"text\""))
    return "".join(part["text"] for part in content)


def _message(record: Record, index: int, message, role_key: str, text_key: str, sharegpt: bool) -> dict:
    """One message as a template takes it: role, content and every other key of the record's message. A key
    whose value is null is left out: a Parquet record holds every column for every message, null where the
    message has none, and templates test `'tool_calls' in message` as often as its value."""
    if not isinstance(message, dict) or not _text(message.get(role_key)):
        raise _bad_message(record, index, message, role_key, text_key)
    if sharegpt and message[role_key] == "function_call":
        return _sharegpt_call(record, index, message.get(text_key))
    extras = {key: value for key, value in message.items() if key not in (role_key, text_key) and value is not None}
    if "tool_calls" in extras:
        calls = _json_list(record, f'message {index}: "tool_calls"', extras.pop("tool_calls"))
        if calls:
            extras["tool_calls"] = calls
    content = _joined_parts(record, index, message.get(text_key))
    if not (_text(content) or (content is None and "tool_calls" in extras)):
        raise _bad_message(record, index, message, role_key, text_key)
    if "weight" in extras and not (isinstance(extras["weight"], (int, float)) and extras["weight"] in (0, 1)):
        raise DataError(f"data.format=chat: record {record.where}, message {index}: \"weight\" is "
                        f"{json.dumps(extras['weight'])}; OpenAI's weight of a message is 0 (kept as context, not "
                        f"trained) or 1 (trained)")
    role = _sharegpt_role(record, index, message[role_key]) if sharegpt else message[role_key]
    return {"role": role, "content": content, **extras}


def _with_system(record: Record, messages: list[dict]) -> list[dict]:
    """The record's top-level `system` (LLaMA-Factory's ShareGPT and alpaca) as the first message: left out,
    the model would learn the answers without the prompt they were written under."""
    system = record.fields.get("system")
    if system is None or system == "":
        return messages
    if not _text(system):
        raise DataError(f'record {record.where}: "system" is {_json_kind(system)}, not a string')
    if messages and messages[0]["role"] == "system":
        if messages[0]["content"] == system:
            return messages
        raise DataError(f'record {record.where}: a "system" field and a different system message open '
                        f"the conversation: keep one")
    return [{"role": "system", "content": system}, *messages]


def chat_messages(record: Record) -> list[dict]:
    """The conversation of a `chat` record (module docstring); DataError naming the record when it is not one."""
    fields = record.fields
    if "messages" in fields:
        raw, role_key, text_key, sharegpt = fields["messages"], "role", "content", False
    elif "conversations" in fields:
        raw, role_key, text_key, sharegpt = fields["conversations"], "from", "value", True
    elif "prompt" in fields and "completion" in fields:
        raw, role_key, text_key, sharegpt = _prompt_completion(record), "role", "content", False
    else:
        hint = ("; a text corpus? set data.format=text" if "text" in fields else
                "; an instruction record? set data.format=instruct" if "instruction" in fields else
                records_under(fields, ("messages", "conversations")))
        raise DataError(f"data.format=chat: record {_where_fields(record)} has no \"messages\" (a list of "
                        f"{{\"role\", \"content\"}}), \"conversations\" (a list of {{\"from\", \"value\"}}) or "
                        f"\"prompt\" and \"completion\"{hint}")
    if not isinstance(raw, list):   # an empty list is a conversation with no answer: skipped and counted
        field = "messages" if "messages" in fields else "conversations"
        raise DataError(f"data.format=chat: record {record.where}: \"{field}\" holds {_json_kind(raw)}, not a list "
                        f"of turns (a JSON string of the list? store the list itself)")
    if record.from_arrow and any(isinstance(message, dict) and text_key in message for message in raw):
        # the messages' column holds the text field, so a message without it wrote null there (_as_written left
        # it out): put back, a null content is named as one, not as "fields found: role"
        raw = [{text_key: None, **message} if isinstance(message, dict) else message for message in raw]
    messages = [_message(record, index, message, role_key, text_key, sharegpt) for index, message in enumerate(raw)]
    return _with_system(record, messages)


def _prompt_completion(record: Record) -> list:
    """TRL's prompt-completion record as one conversation: two lists of messages (its conversational form)
    joined, or two strings (its standard form) as the user's message and the assistant's answer; either way
    the completion is what is trained (TRL's completion-only loss), rendered by the chat template."""
    prompt, completion = record.fields["prompt"], record.fields["completion"]
    if isinstance(prompt, list) and isinstance(completion, list):
        return [*prompt, *completion]
    if _text(prompt) and _text(completion):
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    raise DataError(f"data.format=chat: record {record.where}: \"prompt\" holds {_json_kind(prompt)} and "
                    f"\"completion\" {_json_kind(completion)}; a prompt-completion record holds two strings or two "
                    f"lists of {{\"role\", \"content\"}} messages")


def _pair_kind(pair) -> str:
    """What a `history` item holds instead of two strings: "a list of 3 items", "a list holding a JSON null"."""
    if not isinstance(pair, list):
        return _json_kind(pair)
    if len(pair) != 2:
        return f"a list of {len(pair)} item{'s' if len(pair) != 1 else ''}"
    return f"a list holding {_json_kind(next(item for item in pair if not _text(item)))}"


def _history(record: Record) -> list[dict]:
    """An alpaca record's `history` (LLaMA-Factory): [instruction, response] pairs, the turns before its own."""
    history = record.fields.get("history")
    if history is None:
        return []
    bad = (f"it is {_json_kind(history)}" if not isinstance(history, list) else
           next((f"item {k} is {_pair_kind(pair)}" for k, pair in enumerate(history)
                 if not (isinstance(pair, list) and len(pair) == 2 and all(map(_text, pair)))), None))
    if bad is not None:
        raise DataError(f"data.format=instruct: record {record.where}: \"history\" needs a list of [instruction, "
                        f"response] string pairs ({bad})")
    return [{"role": role, "content": text} for pair in history for role, text in zip(("user", "assistant"), pair)]


def instruct_messages(record: Record) -> list[dict]:
    """The conversation of an `instruct` record (module docstring)."""
    fields = record.fields
    missing = [name for name in ("instruction", "output") if not _text(fields.get(name))]
    if missing or not (fields.get("input") is None or _text(fields.get("input"))):
        need = ", ".join(f'"{name}"' for name in missing) or '"input" as a string'
        # a chat file (TRL's prompt-completion records too) read as instructions
        chat = "messages" in fields or "conversations" in fields or ("prompt" in fields and "completion" in fields)
        hint = "; a chat record? set data.format=chat" if chat else records_under(fields, ("instruction", "output"))
        wrong = _not_text(fields, ("instruction", "output")) + (
            _not_text(fields, ("input",)) if fields.get("input") is not None else "")
        raise DataError(f"data.format=instruct: record {_where_fields(record)} needs {need} (\"instruction\" "
                        f"and \"output\" strings, \"input\" optional{wrong}){hint}")
    user = fields["instruction"]
    if fields.get("input"):
        user = f"{user}\n\n{fields['input']}"
    turn = [{"role": "user", "content": user}, {"role": "assistant", "content": fields["output"]}]
    return _with_system(record, _history(record) + turn)


def messages_of(record: Record, data_format: str) -> list[dict]:
    return chat_messages(record) if data_format == "chat" else instruct_messages(record)


def conversation_of(record: Record, data_format: str) -> Conversation:
    """The record's messages and its `tools` (module docstring)."""
    return Conversation(messages_of(record, data_format), _json_list(record, '"tools"', record.fields.get("tools")))


def _file_records(path: Path) -> Iterator[Record]:
    if corpus_suffix(path) == ".parquet":
        return _parquet_records(path)
    if corpus_suffix(path) == ".json" and json_kind(path) == "array":
        return _json_array_records(path)
    return _jsonl_records(path)


def _json_array_records(path: Path) -> Iterator[Record]:
    where = first_json_error(path)
    if where is not None:
        raise DataError(f"corpus file {str(path)!r}, {where}")
    records = json.loads(read_bytes(path).removeprefix(UTF8_BOM).decode("utf-8"))
    for number, fields in enumerate(records, start=1):
        if not isinstance(fields, dict):
            raise DataError(f"corpus file {str(path)!r}, record {number}: a JSON {type(fields).__name__}, not an "
                            f"object")
        yield Record(fields, f"{path}, record {number}")


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


def _parquet_records(path: Path) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        number = 0
        for fields in _arrow_rows(parquet.iter_batches()):
            number += 1
            yield Record(fields, f"{path}, row {number}", from_arrow=True)
    except DataError:
        raise
    except Exception as error:   # not parquet, cut short: pyarrow's error, with the file named
        raise unreadable_corpus("parquet", [path], error) from None


def _arrow_rows(batches) -> Iterator[dict]:
    """The rows of Arrow record batches (a parquet file's, a `save_to_disk` folder's) as the JSON records they
    were written from, as far as their column types can tell (`_as_written`)."""
    for batch in batches:
        readers = [_as_written(field.type) for field in batch.schema]
        for row in batch.to_pylist():
            yield {name: read(value) for (name, value), read in zip(row.items(), readers)}


def _as_it_is(value):
    return value


def _as_written(arrow_type) -> Callable:
    """What gives a value of an Arrow column (as pyarrow's `to_pylist` gives it) as the JSON it was written from.

    A struct column has a field for every key any record's object had (pyarrow and `datasets` union them when
    the file is written), null in each object that lacked it: tool calls whose arguments differ from record to
    record came back with every argument of every call, and tools with every parameter of every tool, which the
    template wrote into the trained text. A key a record wrote as JSON null is null in the same way, so no reader
    of the file can tell the two apart; a struct's null fields are left out, as most are keys the object never
    had (a null argument is rare: an argument not given is left out, not written as null). Their order is the
    column's too, which no reader can undo. `datasets`' own answer is its Json feature (`on_mixed_types=
    "use_json"`, as its json builder reads objects whose keys differ), which keeps each object as its JSON text,
    in the `arrow.json` extension type: that is read back as the JSON it holds, its nulls and order included
    (pyarrow gives its text). A map's keys are those the record had, nulls kept. Made once for a batch's schema;
    a column with no struct, map or JSON inside is taken as it is."""
    import pyarrow as pa

    if isinstance(arrow_type, pa.JsonType):
        return lambda value: None if value is None else json.loads(value)
    if isinstance(arrow_type, pa.ExtensionType):
        return _as_written(arrow_type.storage_type)
    if pa.types.is_struct(arrow_type):
        fields = [(field.name, _as_written(field.type)) for field in arrow_type]
        return lambda value: None if value is None else {name: read(value[name]) for name, read in fields
                                                         if value[name] is not None}
    if pa.types.is_map(arrow_type):   # pyarrow gives its (key, value) pairs
        read = _as_written(arrow_type.item_type)
        return lambda value: None if value is None else {key: read(item) for key, item in value}
    lists = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list, pa.types.is_list_view,
             pa.types.is_large_list_view)
    if any(is_list(arrow_type) for is_list in lists):
        read = _as_written(arrow_type.value_type)
        return _as_it_is if read is _as_it_is else (
            lambda value: None if value is None else [read(item) for item in value])
    if hasattr(arrow_type, "value_type"):   # a dictionary's (or run-end encoding's) values, each one itself
        return _as_written(arrow_type.value_type)
    return _as_it_is


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
        # file by file, record by record as they are: files whose other columns differ (a `source` in one shard)
        # are read all the same, and a `.json` array whose messages differ in their keys (a `name` on one), which
        # `datasets` gave back with every message a JSON string, refused at a record that was fine
        if local.builder != SAVED and readable_by_field(local.files):
            for path in local.files:
                yield from _file_records(path)
            return
        cache = None if cache_dir is None else str(cache_dir)
        if local.builder == SAVED:   # its Arrow table read as a parquet file's (_as_written)
            stream = _arrow_rows(load_local_files(local, False, cache).with_format("arrow").iter(
                batch_size=ARROW_BATCH_ROWS))
        else:   # the reader of a text corpus's files: a file that fails is named (its line, its fields)
            stream = load_local_files(local, True, cache)
    else:
        stream = _hub_records(source, hub, split, cache_dir)
    records = enumerate(stream, start=1)
    while True:
        try:
            number, fields = next(records)
        except StopIteration:
            return
        except DataError:
            raise
        except Exception as error:   # a stream fails as it is read
            raise (_unreadable_records(source, error) if hub is not None else
                   unreadable_corpus(local.builder, local.files, error)) from error
        yield Record(dict(fields), f"{source}, record {number}", from_arrow=hub is not None or local.builder == SAVED)


def _hub_records(source: str, hub, split: str, cache_dir):
    """A `datasets` stream of a Hub dataset's whole records (every column) of `split`, read from its Arrow
    batches as a parquet file's rows are (`_as_written`): a Hub dataset is parquet files, whose rows `datasets`
    gives with every key of the column's structs."""
    import datasets

    try:
        dataset = datasets.load_dataset(**hub.load_dataset_kwargs(split=split, streaming=True),
                                        cache_dir=None if cache_dir is None else str(cache_dir))
    except Exception as error:
        raise _unreadable_records(source, error) from error
    return _arrow_rows(dataset.with_format("arrow").iter(batch_size=ARROW_BATCH_ROWS))


def _unreadable_records(source: str, error: BaseException) -> DataError:
    return DataError(f"data.source {source!r}: cannot read its records ({type(error).__name__}: "
                     f"{' '.join(str(error).split())[:300]})")
