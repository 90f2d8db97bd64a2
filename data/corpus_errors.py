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
  at once, or a stream failing later).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

from spillway.layers.errors import DataError

from .local_files import UTF8_BOM, corpus_suffix, open_binary, read_bytes

_BUILDERS_LOGGER = "datasets.packaged_modules"


def parse_jsonl_line(raw: bytes, expected: str = "an object with a text field") -> tuple[dict | None, str | None]:
    """One .jsonl line (bytes, without its newline): (its object, None); (None, None) for a blank line; or
    (None, what is wrong with it). `expected` names what a line must hold, for the message. A leading UTF-8 BOM
    (Windows Notepad writes one) is no character of the record: dropped, as pyarrow's reader drops it."""
    raw = raw.removeprefix(UTF8_BOM)
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as error:
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


def first_json_error(path: Path) -> str | None:
    """Where `path` (.jsonl: one object per line; .json: one document) stops being readable JSON, or None."""
    if corpus_suffix(path) == ".jsonl":
        with open_binary(path) as f:
            for number, raw in enumerate(f, start=1):
                _, problem = parse_jsonl_line(raw.rstrip(b"\r\n"))
                if problem is not None:
                    return f"line {number}: {problem}"
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


def first_non_text_record(files, text_field: str) -> str | None:
    """'FILE, line N (a JSON int)' for the first .jsonl record (or .json array item) whose `text_field` is
    present and neither a string nor null, else None."""
    def kind(value) -> str | None:
        return None if value is None or isinstance(value, str) else type(value).__name__

    for path in files:
        if corpus_suffix(path) == ".jsonl":
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
            for index, record in enumerate(records if isinstance(records, list) else []):
                found = kind(record.get(text_field)) if isinstance(record, dict) else None
                if found:
                    return f"{path}, record {index} (a JSON {found})"
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
    cause = error.__cause__ or error.__context__ or error   # datasets' own wrapper says little
    text = " ".join(f"{type(cause).__name__}: {cause}".split())[:300]
    names = ", ".join(repr(str(p)) for p in files[:3]) + (" ..." if len(files) > 3 else "")
    return DataError(f"cannot read the corpus ({builder} files {names}): {text}")


class ErrorsNamed:
    """A `datasets` stream of local files whose read failures are `unreadable_corpus` errors.

    Offers what preparation uses of a stream: `iter(batch_size)`, `column_names`,
    and `records_without_text` (data/sources.py `RecordsWithoutText`).
    """

    def __init__(self, stream, builder: str, files: Sequence[Path]):
        self.stream = stream
        self.builder = builder
        self.files = tuple(files)
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
                raise unreadable_corpus(self.builder, self.files, error) from error
            yield batch
