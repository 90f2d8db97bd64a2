"""Local `.jsonl`, `.parquet` and `.json` files read for their text field alone, a file at a time, as a stream.

What a run reads of a record corpus is one field. Read through `datasets`' json and parquet builders, the
other fields decide whether the corpus can be read at all: the builders unify every file's (and every
block's) schema, so a corpus whose later records carry a field the first ones lack (a `meta` added half-way
through a scrape, an `id` in one shard) stopped with "column names don't match", and a file whose text is a
number was cast into the first file's string column as JSON text. Here each file is read with pyarrow (in
C++, as the builders read it) for the text field only: the JSON reader is given the field as a string and
skips every other field, the parquet reader reads that column alone; a `.json` file holding one array of
records is read whole, as `datasets` reads it.

`RecordFileDocuments` offers what preparation uses of a stream (`iter(batch_size)`, `skip(count)`,
`column_names`, `records_without_text`) and the documents `datasets` gave, in the same order. A file that
cannot be read is one DataError naming it (and the line, for JSON lines): not JSON, not UTF-8, a text that is
not a string, or no record holding the field at all. `RecordsWithoutText` counts what a stream of documents
(this one, the text files', a `datasets` stream) drops: records without text, and empty ones.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

from spillway.layers.errors import DataError

from .corpus_errors import (first_duplicate_key, first_json_error, first_non_text_record, is_text_type, json_kind,
                            missing_text_field, non_text_field, record_fields, read_as_lines, unreadable_corpus)
from .local_files import UTF8_BOM, compression_of, corpus_suffix, open_binary, read_bytes

# pyarrow's JSON reader needs each record inside one block: it starts at this size and grows fourfold for a
# record larger than the block (a long book on one line), up to the file's size.
FIRST_BLOCK_BYTES = 16 << 20
MAX_BLOCK_BYTES = 1 << 34   # a record of a compressed file larger than this (16 GiB) is refused


def readable_by_field(files) -> bool:
    """Whether every file is one this module reads: JSON lines (maybe compressed), parquet, and `.json` files
    that hold JSON lines or one array of records (`json_kind`; another `.json`, such as one object of
    columns, is left to `datasets`, with its folder). The chat records' reader reads the same files
    (data/sft_formats.py `iter_records`)."""
    return bool(files) and all(corpus_suffix(path) in (".jsonl", ".parquet") or
                               (corpus_suffix(path) == ".json" and json_kind(path) is not None) for path in files)


def batches(documents: Generator[str, None, None], start: int, batch_size: int) -> Iterator[dict[str, list[str]]]:
    """`documents` from the one after the first `start` on, in batches of `batch_size` as a `datasets` stream
    gives them ({"text": [...]}); the skipped ones are read, nothing else is done with them. A reader that
    stops early closes `documents` at once (their reader's end-of-reading work runs then)."""
    batch: list[str] = []
    try:
        for seen, text in enumerate(documents, start=1):
            if seen <= start:
                continue
            batch.append(text)
            if len(batch) == batch_size:
                yield {"text": batch}
                batch = []
        if batch:
            yield {"text": batch}
    finally:
        documents.close()


def has_text(batch: dict[str, list]) -> list[bool]:
    """Which documents of a batch hold text (not None, empty or blank)."""
    return [bool(text and not text.isspace()) for text in batch["text"]]


class RecordsWithoutText:
    """The filter of a stream's documents that also counts the records it drops: `count` those with no text
    field (absent or null), `empty` those whose text is empty or blank. Read them once the stream was read to
    its end."""

    def __init__(self):
        self.count = 0
        self.empty = 0

    def __call__(self, batch: dict[str, list]) -> list[bool]:
        kept = has_text(batch)
        self.count += sum(text is None for text in batch["text"])
        self.empty += sum(text is not None and not keep for text, keep in zip(batch["text"], kept))
        return kept


class RecordFileDocuments:
    """The non-empty texts of `files`' records from document `start` on (module docstring)."""

    column_names = ["text"]

    def __init__(self, files: tuple[Path, ...], text_field: str, source: str, start: int = 0):
        self.files = tuple(files)
        self.text_field = text_field
        self.source = source
        self.start = start
        self.records_without_text = RecordsWithoutText()

    def check_the_field_is_there(self) -> RecordFileDocuments:
        """Self; a DataError now, before anything is read for training, when the first file's records have no
        text field (`data.text_field` named wrong, or chat records read as text: the message says which
        data.format reads them). Read beyond its first record only when that record lacks the field."""
        first = self.files[0]
        if self.text_field not in (record_fields(first) or (self.text_field,)):
            if not any(text is not None for texts in self._file_texts(first) for text in texts):
                raise self._no_field_in(first)
        return self

    def skip(self, count: int) -> RecordFileDocuments:
        return RecordFileDocuments(self.files, self.text_field, self.source, self.start + count)

    def iter(self, batch_size: int) -> Iterator[dict[str, list[str]]]:
        counter = self.records_without_text
        counter.count = counter.empty = 0   # counted again by each read
        return batches(self._kept_texts(counter), self.start, batch_size)

    def _kept_texts(self, counter: RecordsWithoutText) -> Generator[str, None, None]:
        """Every record's text that holds text, file by file; a file of no record, or of none with the field, is
        refused once read."""
        for path in self.files:
            rows = with_field = 0
            for texts in self._file_texts(path):
                rows += len(texts)
                with_field += sum(text is not None for text in texts)
                yield from (text for text, keep in zip(texts, counter({"text": texts})) if keep)
            if not rows:   # no record at all (blank lines at most), compressed or not
                once = " once decompressed" if compression_of(path) else ""
                raise DataError(f"corpus file {str(path)!r} is empty{once}: no record to read; remove it from the "
                                f"corpus or fill it")
            if not with_field and self.text_field not in (record_fields(path) or ()):
                raise self._no_field_in(path)   # (a file whose every text is null has the field, to skip)

    def _file_texts(self, path: Path) -> Iterator[list]:
        try:
            if corpus_suffix(path) == ".parquet":
                yield from _parquet_texts(path, self.text_field)
            elif corpus_suffix(path) == ".json" and json_kind(path) == "array":
                yield from _json_array_texts(path, self.text_field)
            else:
                yield from _json_lines_texts(path, self.text_field)
        except DataError:
            raise
        except Exception as error:   # pyarrow's ArrowInvalid, a UnicodeDecodeError: find the line ourselves
            raise self._unreadable(path, error) from None

    def _unreadable(self, path: Path, error: BaseException) -> DataError:
        if read_as_lines(path):
            where = first_json_error(path)
            if where is not None:
                return DataError(f"corpus file {str(path)!r}, {where}")
            where = first_non_text_record([path], self.text_field)
            if where is not None:
                return non_text_field(where, self.text_field)
            where = first_duplicate_key(path, self.text_field) if "specified twice" in str(error) else None
            if where is not None:
                return DataError(f"corpus file {str(path)!r}, {where}")
        return unreadable_corpus(self._builder(path), [path], error)

    @staticmethod
    def _builder(path: Path) -> str:
        return "parquet" if corpus_suffix(path) == ".parquet" else "json"

    def _no_field_in(self, path: Path) -> DataError:
        """A file none of whose records holds the text field: a stray file of other records among the corpus's
        (told by its fields), or the source's field named wrong."""
        fields = record_fields(path)
        others = [other for other in self.files if other != path]
        if fields is not None and any(self.text_field in (record_fields(other) or ()) for other in others):
            return DataError(f"corpus file {str(path)!r} holds records with fields {list(fields)}, none "
                             f"{self.text_field!r} as the other files' have: move it out of the corpus folder (a "
                             f"stray metadata file?), or give data.source the files' own folder")
        return missing_text_field(self.source, self.text_field, [path])


def _json_lines_texts(path: Path, text_field: str) -> Iterator[list]:
    """The `text_field` of each record of a JSON lines file (None where a record has none), block by block."""
    import pyarrow as pa
    import pyarrow.json as pa_json

    parse = pa_json.ParseOptions(explicit_schema=pa.schema([(text_field, pa.string())]),
                                 unexpected_field_behavior="ignore")
    block, done = FIRST_BLOCK_BYTES, 0
    while True:
        rows = 0
        try:
            with open_binary(path) as file:
                reader = pa_json.open_json(file, read_options=pa_json.ReadOptions(block_size=block),
                                           parse_options=parse)
                for record_batch in reader:
                    texts = record_batch.column(0).to_pylist()
                    rows += len(texts)
                    if rows > done:   # a retry with larger blocks passes over what was given already
                        yield texts[len(texts) - (rows - done):]
                        done = rows
            return
        except pa.ArrowInvalid as error:
            # no record is longer than the file; a compressed file's size says nothing of its records'
            longest = path.stat().st_size if compression_of(path) is None else MAX_BLOCK_BYTES
            if "straddl" not in str(error) or block >= longest:
                if "Empty JSON stream" in str(error) and rows == 0 and done == 0:
                    return   # blank lines only: no record (a file of no bytes is refused earlier, by name)
                raise
            block *= 4


def _json_array_texts(path: Path, text_field: str) -> Iterator[list]:
    """The `text_field` of each record of a `.json` file holding one array of records, read whole (as `datasets`
    reads such a file)."""
    import json

    records = json.loads(read_bytes(path).removeprefix(UTF8_BOM).decode("utf-8"))
    texts = []
    for index, record in enumerate(records if isinstance(records, list) else [records]):
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(record, dict) or not (text is None or isinstance(text, str)):
            what = f"a JSON {type(text).__name__} in field {text_field!r}" if isinstance(record, dict) else \
                f"a JSON {type(record).__name__}, not an object"
            raise DataError(f"corpus file {path}, record {index}: {what}; every record must be an object whose "
                            f"{text_field!r} is text (or null, to skip the record)")
        if text is not None and not _encodable(text):   # "\ud800" parses, and no tokenizer takes it
            raise DataError(f"corpus file {path}, record {index}: a string holds a lone UTF-16 surrogate escape "
                            f"(such as \\ud800), which is no character")
        texts.append(text)
    yield texts


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _parquet_texts(path: Path, text_field: str) -> Iterator[list]:
    """The `text_field` column of a parquet file, batch by batch; a file without that column gives no texts
    (None for each row), a column of another type a DataError naming it."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    schema = parquet.schema_arrow
    if text_field not in schema.names:
        for row_group in range(parquet.num_row_groups):
            yield [None] * parquet.metadata.row_group(row_group).num_rows
        return
    kind = schema.field(text_field).type
    if not is_text_type(kind):
        raise DataError(f"corpus file {path} (a column of {kind}): field {text_field!r} is not a string; every "
                        f"record's {text_field!r} must be text (or null, to skip the record)")
    # a name with a dot is a nested path to the reader ("a.b": field b of a struct a): the column of that
    # name is taken from all of them
    columns = [text_field] if "." not in text_field else None
    for record_batch in parquet.iter_batches(columns=columns):
        yield record_batch.column(record_batch.schema.get_field_index(text_field)).to_pylist()
