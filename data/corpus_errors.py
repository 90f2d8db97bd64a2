"""A local corpus file that `datasets` cannot read, named with its 1-based line: one DataError, no log lines.

`datasets`' json builder parses with pyarrow, whose errors name a row of the
block it was reading ("JSON parse error: Invalid encoding in string. in row
300"), not a line of the file, and it logs the failure twice (its own ERROR
logger) before raising. A stream raises only when the bad line is read, long
after `load_dataset` returned. So:

* `first_json_error` finds the first line of a .jsonl (or the place in a
  .json) that pyarrow refuses: bytes that are not UTF-8, JSON that does not
  parse (control characters in strings included), a lone UTF-16 surrogate
  escape (which Python's json accepts and pyarrow does not), a record that is
  not an object;
* `ErrorsNamed` wraps a stream of local files so that a failure while it is
  read becomes that DataError, with the builders' logger silenced meanwhile;
* `unreadable_corpus` is the one error for either path (`load_dataset` failing
  at once, or a stream failing later);
* `record_fields` reads the fields of a file's first record, so that files
  whose fields differ (a stray `config.json` among `.jsonl` shards, which
  `datasets` reports as a CastError between two schemas, neither named) and a
  text field no record has are named with the file and what it holds.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

from spillway.layers.errors import DataError

from .local_files import UTF8_BOM, builder_for, compression_of, corpus_suffix, open_binary, read_bytes

# A .json file (one document, parsed whole) is read for its fields only up to this size: a larger one is
# data, not the stray metadata file the check looks for, and parsing it would cost its size in memory.
_FIELDS_READ_MAX_BYTES = 64 << 20

_BUILDERS_LOGGER = "datasets.packaged_modules"


def parse_jsonl_line(raw: bytes, expected: str = "an object with a text field") -> tuple[dict | None, str | None]:
    """One .jsonl line (bytes, without its newline): (its object, None); (None, None) for a blank line; or
    (None, what is wrong with it). `expected` names what a line must hold, for the message. A leading UTF-8 BOM
    (Windows Notepad writes one) is no character of the record: dropped, as pyarrow's reader drops it."""
    raw = raw.removeprefix(UTF8_BOM)
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
            return None, "not UTF-8 but UTF-16 (its byte order mark, 0xff 0xfe or 0xfe 0xff, opens the file)"
        return None, f"not UTF-8 (byte 0x{raw[error.start]:02x} at column {error.start + 1})"
    if not line.strip():
        return None, None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        return None, f"not valid JSON ({error.msg}, column {error.colno})"
    if not isinstance(record, dict):
        return None, f"a JSON {type(record).__name__}, not {expected}"
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return None, "a string holds a lone UTF-16 surrogate escape (such as \\ud800), which is no character"
    return record, None


def _what_to_do(problem: str, last: bool) -> str:
    """The advice after a .jsonl line's problem: a last line without its newline that does not parse is a
    file cut short; bytes that are not UTF-8 are another encoding."""
    if problem.startswith("not UTF-8 but UTF-16"):
        return "; re-encode the file to UTF-8 (iconv -f utf-16 -t utf-8 FILE > NEW)"
    if problem.startswith("not UTF-8"):
        return "; re-encode the file to UTF-8 (for cp1252/Latin-1: iconv -f cp1252 -t utf-8)"
    if last and problem.startswith("not valid JSON"):
        return ("; it is the file's last line, without a newline: the file looks cut short (an interrupted "
                "download or write): fetch it again, or delete that line")
    return ""


def json_kind(path: Path) -> str | None:
    """How a `.json` file holds its records: "array" (one JSON array), "lines" (an object a line, as many
    `.json` files on the Hub do), or None (anything else, told by its first line: one object, pretty-printed
    or of columns). The first line is read whole: a first record over a fixed limit was read as "not lines"."""
    try:
        with open_binary(path) as file:
            head = file.read(1 << 16).removeprefix(UTF8_BOM)
            if head.lstrip().startswith(b"["):
                return "array"
            rest = head.lstrip(b" \t\r\n")
            first = rest.split(b"\n", 1)[0] if b"\n" in rest else rest + file.readline()
    except (OSError, DataError):
        return None   # named where it is read
    record, problem = parse_jsonl_line(first.rstrip(b"\r\n"))
    return "lines" if record is not None and problem is None else None


def read_as_lines(path: Path) -> bool:
    """Whether a record file is read line by line: `.jsonl`, and a `.json` of an object a line."""
    suffix = corpus_suffix(path)
    return suffix == ".jsonl" or (suffix == ".json" and json_kind(path) == "lines")


def first_json_error(path: Path) -> str | None:
    """Where `path` (JSON lines: one object per line; .json: one document) stops being readable JSON, or None."""
    if read_as_lines(path):
        with open_binary(path) as f:
            for number, raw in enumerate(f, start=1):
                if number > 1 and raw.startswith(UTF8_BOM):   # pyarrow drops only the file's own first one
                    return (f"line {number}: a UTF-8 byte order mark (BOM) opens it, inside the file (files "
                            f"joined with cat keep each one's); remove it (sed -i '2,$ s/^\\xEF\\xBB\\xBF//' FILE)")
                _, problem = parse_jsonl_line(raw.rstrip(b"\r\n"))
                if problem is not None:
                    advice = _what_to_do(problem, last=not raw.endswith(b"\n"))
                    return f"line {number}: {problem}{advice}"
        return None
    data = read_bytes(path).removeprefix(UTF8_BOM)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        return f"line {line}: not UTF-8 (byte 0x{data[error.start]:02x})"
    try:
        json.loads(text)
    except json.JSONDecodeError as error:
        return f"line {error.lineno}, column {error.colno}: not valid JSON ({error.msg})"
    return None


def first_duplicate_key(path: Path, key: str) -> str | None:
    """'line N: the key K twice' for the first record of a JSON lines file that holds `key` twice (pyarrow refuses
    it as "Column(/K) was specified twice in row R", naming no line; Python's json keeps the last), else None.
    Only a record's own `key` counts: a nested object's repeated keys are nothing pyarrow reads."""
    def twice_at_the_top(items):
        return [name for name, _ in items].count(key) > 1

    with open_binary(path) as f:
        for number, raw in enumerate(f, start=1):
            hooked: list = []   # the innermost objects come first, the record itself last
            try:
                json.loads(raw.removeprefix(UTF8_BOM).decode("utf-8", errors="replace"),
                           object_pairs_hook=lambda items: hooked.append(items) or dict(items))
            except json.JSONDecodeError:
                continue
            if hooked and raw.lstrip(UTF8_BOM + b" \t").startswith(b"{") and twice_at_the_top(hooked[-1]):
                return f"line {number}: the key {key!r} twice in one record; keep one"
    return None


def first_non_text_record(files, text_field: str) -> str | None:
    """'FILE, line N (a JSON int)' for the first .jsonl record (or .json array item) whose `text_field` is
    present and neither a string nor null, else None."""
    def kind(value) -> str | None:
        return None if value is None or isinstance(value, str) else type(value).__name__

    for path in files:
        if read_as_lines(path):
            with open_binary(path) as f:
                for number, raw in enumerate(f, start=1):
                    line = raw.removeprefix(UTF8_BOM).decode("utf-8", errors="replace")
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    found = kind(record.get(text_field)) if isinstance(record, dict) else None
                    if found:
                        return f"{path}, line {number} (a JSON {found})"
        else:
            try:
                records = json.loads(read_bytes(path).removeprefix(UTF8_BOM).decode("utf-8", errors="replace"))
            except json.JSONDecodeError:
                continue
            # one object (pretty-printed) is one record: its number in a text field was read as a document
            for index, record in enumerate(records if isinstance(records, list) else [records]):
                found = kind(record.get(text_field)) if isinstance(record, dict) else None
                if found:
                    return f"{path}, record {index} (a JSON {found})"
    return None


def non_text_field(where: str, text_field: str) -> DataError:
    """The one line for a record whose text field is not a string (`where` from first_non_text_record). A first
    record whose text is an object is most likely a file of columns (pandas' default `to_json`), not of records."""
    columns = (" (the file looks like one object of columns, as pandas' DataFrame.to_json writes by default: write "
               "records, df.to_json(path, orient=\"records\", lines=True))"
               if where.endswith(("line 1 (a JSON dict)", "record 0 (a JSON dict)")) else "")
    return DataError(f"corpus file {where}: field {text_field!r} is not a string; every record's {text_field!r} "
                     f"must be text (or null, to skip the record){columns}")


def is_text_type(kind) -> bool:
    """Whether an Arrow column type holds text (or nothing): string, large_string, string_view (newer writers),
    either dictionary-encoded, or null."""
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)
            or pa.types.is_string_view(kind))


def non_text_in_a_later_file(files, text_field: str) -> str | None:
    """Like first_non_text_record, for a source of several files, checked file by file (once per process for
    files unchanged since: a preparation opens its source several times).

    `datasets` reads each file by itself: a file whose field mixes types gets its own type (JSON) and is
    then cast into the first file's string column as JSON text, every record of that file (`7` becomes
    "7", a string "a" becomes '"a"'), so the merged column's type says nothing. A parquet file is checked
    by its schema (its footer alone); a JSON lines file by pyarrow's reader with the field declared a
    string (C++, the other fields skipped), and only a file that reader refuses is scanned record by
    record for the place (a .json array is always scanned)."""
    stats = tuple((str(path), path.stat().st_size, path.stat().st_mtime_ns) for path in files)
    return _non_text_in_files(stats, text_field)


@functools.lru_cache(maxsize=16)
def _non_text_in_files(stats: tuple, text_field: str) -> str | None:
    import pyarrow as pa
    import pyarrow.json as pa_json
    import pyarrow.parquet as pq

    files = [Path(name) for name, _, _ in stats]
    text_only = pa_json.ParseOptions(explicit_schema=pa.schema([(text_field, pa.string())]),
                                     unexpected_field_behavior="ignore")
    for path in files:
        suffix = corpus_suffix(path)
        if suffix == ".parquet":
            schema = pq.read_schema(path)
            if text_field in schema.names:
                kind = schema.field(text_field).type
                if not is_text_type(kind):
                    return f"{path} (a column of {kind})"
            continue
        if suffix == ".jsonl":
            try:
                with open_binary(path) as f:
                    pa_json.read_json(f, parse_options=text_only)
                continue
            except (pa.ArrowInvalid, OSError, EOFError):   # refused: find the record (or nothing: fine)
                pass
        where = first_non_text_record([path], text_field)
        if where is not None:
            return where
    return None


@contextlib.contextmanager
def quiet_builders():
    """Silence the packaged builders' own error log: a parse failure is raised as one DataError naming the
    file and line, and their multi-line log of it would only repeat it."""
    logger = logging.getLogger(_BUILDERS_LOGGER)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _holds_nothing(path: Path) -> bool:
    """An empty file, or one of blank lines only (read only when small: a large file holds something)."""
    size = path.stat().st_size
    return size == 0 or (size < 1 << 16 and not path.read_bytes().strip())


def record_fields(path: Path) -> tuple[str, ...] | None:
    """The sorted field names of `path`'s first record (a .jsonl's first line, a .json list's first element or
    a .json object's keys, a parquet file's schema), or None where they cannot be read cheaply."""
    try:
        if builder_for(path) == "parquet":
            import pyarrow.parquet as pq   # datasets' own dependency; imported only when a parquet file is asked
            return tuple(sorted(pq.read_schema(path).names))
        if corpus_suffix(path) == ".jsonl":
            with open_binary(path) as f:
                for raw in f:
                    record, _ = parse_jsonl_line(raw.rstrip(b"\r\n"))
                    if record is not None:
                        return tuple(sorted(record))
            return None
        if corpus_suffix(path) == ".json" and path.stat().st_size <= _FIELDS_READ_MAX_BYTES:
            document = json.loads(read_bytes(path).removeprefix(UTF8_BOM).decode("utf-8", errors="replace"))
            first = document[0] if isinstance(document, list) and document else document
            return tuple(sorted(first)) if isinstance(first, dict) else None
    except (OSError, ValueError, IndexError):   # unreadable or not JSON: the other checks name it
        return None
    return None


def fields_differ(files: Sequence[Path]) -> DataError | None:
    """A DataError naming the file whose first record's fields differ from the rest's, or None when they agree."""
    by_fields: dict[tuple[str, ...], list[Path]] = {}
    for path in files:
        fields = record_fields(path)
        if fields is not None:
            by_fields.setdefault(fields, []).append(path)
    if len(by_fields) < 2:
        return None
    common, *_ = sorted(by_fields, key=lambda fields: -len(by_fields[fields]))
    odd_fields, odd = next((fields, paths) for fields, paths in by_fields.items() if fields != common)
    more = f" (and {len(odd) - 1} more like it)" if len(odd) > 1 else ""
    return DataError(f"corpus file {str(odd[0])!r}{more} holds records with fields {list(odd_fields)}, the other "
                     f"files {list(common)}: a source's files are read as one table; move the odd file out of the "
                     f"corpus folder (a stray metadata file?) or give data.source the files' own folder")


def format_hint(fields) -> str:
    """"; ... set data.format=chat" where a text corpus's records are conversations (or instructions), which a
    fine-tuning format reads: the text-field advice alone led to training on one field of them."""
    fields = set(fields or ())
    if fields & {"messages", "conversations"}:
        return "; these look like chat records: set data.format=chat to fine-tune on them"
    if {"instruction", "output"} <= fields:
        return "; these look like instruction records: set data.format=instruct to fine-tune on them"
    return ""


def records_under(document, wanted: Sequence[str]) -> str:
    """'; its records are in a list under "data" ...' where `document` (a record, or a .json file's one object)
    holds in a field a list of objects with one of the `wanted` fields: a file written {"data": [...]}, as
    SQuAD's and many exports are, whose one "record" is the wrapper. Else ""."""
    if not isinstance(document, dict):
        return ""
    name = next((name for name, value in document.items() if isinstance(value, list) and
                 any(isinstance(item, dict) and not set(wanted).isdisjoint(item) for item in value[:100])), None)
    return ("" if name is None else f"; its records are in a list under {name!r}: records are read as JSON "
            f"lines or one JSON array: store that list itself (jq '.{name}' FILE > NEW.json)")


def _json_object(path: Path) -> dict | None:
    """The one object a small `.json` file holds (read only to name what it holds), or None."""
    if corpus_suffix(path) != ".json" or json_kind(path) == "array" or path.stat().st_size > _FIELDS_READ_MAX_BYTES:
        return None
    try:
        document = json.loads(read_bytes(path).removeprefix(UTF8_BOM).decode("utf-8", errors="replace"))
    except (OSError, ValueError, DataError):   # unreadable or not JSON: the other checks name it
        return None
    return document if isinstance(document, dict) else None


def missing_text_field(source: str, text_field: str, files: Sequence[Path]) -> DataError:
    """No record of a source whose schema was unknown until read has `text_field`: named with the fields the
    first file's first record has (the same error a source read whole gets from `select_text_column`)."""
    fields = next((fields for fields in map(record_fields, files[:1]) if fields is not None), None)
    held = f"; its records' fields are {list(fields)}" if fields is not None else ""
    return DataError(f"source {source!r} has no text field {text_field!r}{held} (data.text_field names the field "
                     f"holding the text; --text-field for python -m spillway.data){format_hint(fields)}"
                     f"{normalization_hint(text_field, fields)}"
                     f"{records_under(_json_object(files[0]) if files else None, (text_field,))}")


def normalization_hint(text_field: str, fields) -> str:
    """What to say when a field is the named one written in another Unicode normalization ('tëxt' as e + a
    combining diaeresis): the two print alike, and the error would show the same name twice."""
    import unicodedata

    same = [field for field in fields or () if field != text_field and
            unicodedata.normalize("NFC", field) == unicodedata.normalize("NFC", text_field)]
    return (f"; the field {same[0]!r} is that name in another Unicode normalization (its characters composed "
            f"otherwise): write data.text_field with the file's own characters, {ascii(same[0])}") if same else ""


def unreadable_corpus(builder: str, files: Sequence[Path], error: BaseException) -> DataError:
    """The DataError for local corpus files `datasets` failed on: the file and line, where one is found; an
    empty file (on which the json builder stops with a bare StopIteration) by its name."""
    empty = [path for path in files if _holds_nothing(path)]
    if empty:
        more = f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
        return DataError(f"corpus file {str(empty[0])!r}{more} is empty: no record to read; remove it from the "
                          f"corpus or fill it")
    if builder == "json":
        for path in files:
            where = first_json_error(path)
            if where is not None:
                return DataError(f"corpus file {str(path)!r}, {where}")
    if builder in ("json", "parquet") and len(files) > 1:
        differ = fields_differ(files)
        if differ is not None:
            return differ
    for path in files:   # a compressed file that does not decompress: named by open_binary's DataError
        if compression_of(path) is not None:
            with open_binary(path) as f:
                while f.read(1 << 24):
                    pass
    cause = error.__cause__ or error.__context__ or error   # datasets' own wrapper says little
    text = " ".join(f"{type(cause).__name__}: {cause}".split())[:300]
    names = ", ".join(repr(str(p)) for p in files[:3]) + (" ..." if len(files) > 3 else "")
    return DataError(f"cannot read the corpus ({builder} files {names}): {text}")


class ErrorsNamed:
    """A `datasets` stream of local files whose read failures are `unreadable_corpus` errors.

    Offers what preparation uses of a stream: `iter(batch_size)`, `column_names`,
    and `records_without_text` (data/record_documents.py `RecordsWithoutText`).
    """

    def __init__(self, stream, builder: str, files: Sequence[Path], *, source: str, text_field: str):
        self.stream = stream
        self.builder = builder
        self.files = tuple(files)
        self.source, self.text_field = source, text_field
        self.records_without_text = getattr(stream, "records_without_text", None)

    @property
    def column_names(self):
        return self.stream.column_names

    def iter(self, batch_size: int) -> Iterator[dict]:
        batches = self.stream.iter(batch_size=batch_size)
        while True:
            try:
                with quiet_builders():   # around each read only: other logs of `datasets` stay as they are
                    batch = next(batches)
            except StopIteration:
                return
            except DataError:
                raise
            except Exception as error:   # pyarrow's, a UnicodeDecodeError, datasets' wrappers: all name a line
                if self._is_missing_text_field(error):   # files of other fields, or none with the text field
                    several = len(self.files) > 1 and self.builder in ("json", "parquet")   # not a saved dataset's
                    differ = fields_differ(self.files) if several else None
                    raise differ or missing_text_field(self.source, self.text_field, self.files) from error
                raise unreadable_corpus(self.builder, self.files, error) from error
            yield batch

    def _is_missing_text_field(self, error: BaseException) -> bool:
        """The KeyError a stream of unknown schema raises when its records lack the text field it selects
        (data/sources.py `select_text_column`), possibly inside datasets' own wrapper."""
        seen: BaseException | None = error
        while seen is not None:
            if isinstance(seen, KeyError) and seen.args and seen.args[0] in (self.text_field, "text"):
                return True
            seen = seen.__cause__ or seen.__context__
        return False
