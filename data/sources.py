"""Corpus sources: turn a source spec string into a `datasets` dataset with a "text" column.

A source spec is one of:

- `builtin:stdlib[:MAX_BYTES]`: the embedded default corpus (see `corpus.py`),
  optionally capped at MAX_BYTES;
- a local `.txt` / `.py` / `.md` file, or a folder of them: one document per file;
- a local `.jsonl` / `.json` file or folder: one document per record, text in `text_field`;
- a local `.parquet` file or folder: one document per row, text in `text_field`;
- `hf:owner/name[:config]`, or a bare `owner/name` that is not an existing path
  (and whose first part is no local folder either): a Hugging Face Hub dataset,
  streamed (nothing is downloaded up front). Hub datasets need a network; when a
  bare name cannot be loaded from the Hub, the error says that no such local
  path exists either.

Loading goes through `datasets.load_dataset` with its packaged builders
("text", "json", "parquet"), so local corpora get Arrow caching and memory
mapping for free. `source_fingerprint` names a source's content for cache keys
without loading it, so a warm cache never re-reads the corpus. A file that
does not parse is reported as one `DataError` naming the file and line.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

from spillway.layers.errors import DataError

from .cache import stable_key
from .corpus import BUILTIN_STDLIB, default_corpus_files
from .corpus_errors import ErrorsNamed, first_non_text_record, quiet_builders, unreadable_corpus

TEXT_SUFFIXES = (".txt", ".py", ".md")
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
_BUILDER_BY_SUFFIX = {
    **{suffix: "text" for suffix in TEXT_SUFFIXES},
    **{suffix: "json" for suffix in JSON_SUFFIXES},
    **{suffix: "parquet" for suffix in PARQUET_SUFFIXES},
}
HUB_PREFIX = "hf:"
# A Hub repository id: exactly one slash, no path-like prefix. Anything else
# that does not exist on disk is reported as a missing path, not sent to the Hub.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class HubSpec:
    """A parsed Hub source: the repository id and an optional config name."""

    repo_id: str
    config: str | None = None

    def load_dataset_kwargs(self, *, split: str, streaming: bool) -> dict[str, Any]:
        """The keyword arguments `datasets.load_dataset` gets for this source."""
        return {"path": self.repo_id, "name": self.config, "split": split, "streaming": streaming}


@dataclass(frozen=True)
class LocalSpec:
    """A parsed local source: the packaged builder and the files it reads, sorted."""

    builder: str
    files: tuple[Path, ...]


def parse_hub_spec(source: str) -> HubSpec | None:
    """The Hub dataset a spec names, or None when the spec is not a Hub id.

    `hf:owner/name[:config]` is always a Hub id; a bare `owner/name` is one only
    when no such local path exists and it has no local-file suffix (so a
    mistyped `corpus/train.jsonl` is a missing file, not a network request).
    """
    if source.startswith(HUB_PREFIX):
        repo_id, _, config = source[len(HUB_PREFIX) :].partition(":")
        if not _HUB_ID.match(repo_id):
            raise ValueError(f"{source!r}: expected hf:owner/name[:config]")
        return HubSpec(repo_id, config or None)
    if os.path.exists(source) or not _HUB_ID.match(source):
        return None
    if Path(source).suffix.lower() in _BUILDER_BY_SUFFIX:
        return None
    if os.path.isdir(source.split("/")[0]):
        return None   # `corpus/train` next to a `corpus/` folder is a mistyped path, not a Hub id
    return HubSpec(source)


def _hub_failure(source: str, hub: HubSpec, cause: BaseException) -> DataError:
    """One line for a Hub source that could not be loaded: what was tried, why it failed."""
    if source.startswith(HUB_PREFIX):
        head = f"data.source {source!r}: the Hugging Face Hub dataset {hub.repo_id!r} could not be loaded"
    else:
        head = (f"data.source {source!r}: no such file or folder (relative to {os.getcwd()}), and as a "
                f"Hugging Face Hub dataset {hub.repo_id!r} it could not be loaded")
    reason = " ".join(f"{type(cause).__name__}: {cause}".split())[:300]
    return DataError(f"{head} ({reason}); Hub datasets need a network, a local corpus a path that exists")


def _builder_for(path: Path) -> str | None:
    return _BUILDER_BY_SUFFIX.get(path.suffix.lower())


def _folder_files(folder: Path) -> list[Path]:
    # Hidden files and folders (.git, .cache) are never corpus.
    return sorted(
        path
        for path in folder.rglob("*")
        if path.is_file()
        and _builder_for(path) is not None
        and not any(part.startswith(".") for part in path.relative_to(folder).parts)
    )


def _builtin_options(source: str) -> dict[str, int]:
    # `builtin:stdlib:N` caps the built-in corpus at N bytes (smoke tests, demos).
    _, _, cap = source[len(BUILTIN_STDLIB) :].partition(":")
    if not cap:
        return {}
    if not cap.isdigit():
        raise ValueError(f"{source!r}: expected {BUILTIN_STDLIB}[:MAX_BYTES] with an integer byte cap")
    return {"max_bytes": int(cap)}


def parse_local_spec(source: str) -> LocalSpec:
    """Resolve `builtin:stdlib` or a local file/folder into its builder and files."""
    if source == BUILTIN_STDLIB or source.startswith(BUILTIN_STDLIB + ":"):
        return LocalSpec("text", tuple(default_corpus_files(**_builtin_options(source))))
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"corpus path {str(path)!r} does not exist (and is not builtin:stdlib or a Hub id "
            f"like hf:owner/name)"
        )
    if path.is_file():
        builder = _builder_for(path)
        if builder is None:
            raise ValueError(
                f"corpus file {str(path)!r} has an unsupported type; supported: "
                f"{', '.join(_BUILDER_BY_SUFFIX)}"
            )
        return LocalSpec(builder, (path,))
    files = _folder_files(path)
    if not files:
        raise ValueError(
            f"corpus folder {str(path)!r} holds no supported files "
            f"({', '.join(_BUILDER_BY_SUFFIX)})"
        )
    builders = sorted({_builder_for(file) for file in files})
    if len(builders) > 1:
        raise ValueError(
            f"corpus folder {str(path)!r} mixes file kinds ({', '.join(builders)}); "
            f"point the source at a folder holding one kind"
        )
    return LocalSpec(builders[0], tuple(files))


def source_fingerprint(source: str, *, text_field: str = "text", split: str = "train") -> str:
    """A key that changes whenever the source's content may have changed.

    Local files are keyed by path, size and modification time (as `make` does),
    which is cheap for any corpus size. Hub sources are keyed by their spec:
    a Hub dataset is assumed not to change under the same id and config.
    """
    hub = parse_hub_spec(source)
    if hub is not None:
        return stable_key("hub", hub.repo_id, hub.config, split, text_field)
    local = parse_local_spec(source)
    stats = [(str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns) for path in local.files]
    return stable_key("local", local.builder, stats, split, text_field)


def select_text_column(
    dataset: datasets.Dataset | datasets.IterableDataset, text_field: str, source: str
) -> datasets.Dataset | datasets.IterableDataset:
    """Keep only `text_field`, renamed to "text"; `source` names the corpus in errors.

    A stream whose schema is unknown until read is renamed lazily; a missing
    field then shows up as a KeyError when it is first iterated.
    """
    columns = dataset.column_names
    if columns is not None:
        if not columns:   # json files of blank lines: "its columns are []" would read as a schema problem
            raise ValueError(f"source {source!r} holds no records: its files are empty or hold only blank lines")
        if text_field not in columns:
            raise ValueError(
                f"source {source!r} has no text field {text_field!r}; its columns are {columns}"
            )
        feature = dataset.features[text_field] if dataset.features else None
        if feature is not None and getattr(feature, "dtype", None) not in ("string", "large_string"):
            raise ValueError(f"source {source!r}: field {text_field!r} holds {feature}, not text")
    dataset = dataset.select_columns([text_field])
    if text_field != "text":
        dataset = dataset.rename_column(text_field, "text")
    return dataset


def _has_text(batch: dict[str, list]) -> list[bool]:
    return [bool(text and not text.isspace()) for text in batch["text"]]


class RecordsWithoutText:
    """The filter of a stream's documents that also counts the records it drops for having no text field
    (absent or null; an empty text is dropped uncounted). Read `count` once the stream was read to its end."""

    def __init__(self):
        self.count = 0

    def __call__(self, batch: dict[str, list]) -> list[bool]:
        self.count += sum(text is None for text in batch["text"])
        return _has_text(batch)


def load_documents(
    source: str,
    *,
    text_field: str = "text",
    split: str = "train",
    streaming: bool | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> datasets.Dataset | datasets.IterableDataset:
    """Load a corpus as documents in a single "text" column, empty documents dropped.

    `streaming=None` streams Hub sources and loads local ones into an Arrow
    cache (under `cache_dir`, default the `datasets` cache). Streamed sources
    are checked lazily: an empty stream shows up when it is tokenized.
    """
    cache = None if cache_dir is None else str(cache_dir)
    hub = parse_hub_spec(source)
    if hub is not None:
        try:
            dataset = datasets.load_dataset(
                **hub.load_dataset_kwargs(split=split, streaming=True if streaming is None else streaming),
                cache_dir=cache,
            )
        except Exception as error:   # connection, not found, gated: all end the run with this one line
            raise _hub_failure(source, hub, error) from error
    else:
        local = parse_local_spec(source)
        builder_options: dict[str, Any] = {}
        if local.builder == "text":
            # One document per file; undecodable bytes become U+FFFD rather
            # than aborting a whole corpus over one stray file.
            builder_options = {"sample_by": "document", "encoding_errors": "replace"}
        try:
            with quiet_builders():
                dataset = datasets.load_dataset(
                    local.builder,
                    data_files=[str(path) for path in local.files],
                    split=split,
                    streaming=bool(streaming),
                    cache_dir=cache,
                    **builder_options,
                )
        except Exception as error:   # datasets wraps the parser's error; find the file and line ourselves
            raise unreadable_corpus(local.builder, local.files, error) from error
    try:
        dataset = select_text_column(dataset, text_field, source)
    except ValueError as error:
        where = first_non_text_record(local.files, text_field) if hub is None and local.builder == "json" else None
        if where is None:
            raise
        raise DataError(f"corpus file {where}: field {text_field!r} is not a string; every record's "
                        f"{text_field!r} must be text (or null, to skip the record)") from None
    streamed = isinstance(dataset, datasets.IterableDataset)
    counter = RecordsWithoutText() if streamed else None   # a stream is filtered here, as it is read
    dataset = dataset.filter(counter or _has_text, batched=True)
    if isinstance(dataset, datasets.Dataset) and len(dataset) == 0:
        raise ValueError(f"source {source!r} holds no non-empty documents")
    if counter is not None:
        dataset.records_without_text = counter
    return dataset


@contextlib.contextmanager
def _torch_left_alone() -> Iterator[None]:
    # Wherever torch is installed, `datasets` imports it on creating any
    # stream, to share an epoch counter with torch DataLoader workers: about
    # 6 s and 180 MB in a process that never uses torch. Our own streams are
    # never handed to torch, so while torch is not loaded anyway, skip that.
    if "torch" in sys.modules or not datasets.config.TORCH_AVAILABLE:
        yield
        return
    datasets.config.TORCH_AVAILABLE = False
    try:
        yield
    finally:
        datasets.config.TORCH_AVAILABLE = True


class TextFileDocuments:
    """Local text files read one at a time, one document each, as a stream with a "text" column.

    What `datasets`' "text" builder does with `sample_by="document"` (UTF-8,
    undecodable bytes replaced, universal newlines, blank files dropped),
    without its per-file bookkeeping: a `datasets` stream over local files
    holds about 2 kB per file (33 MB for 14k files, measured), which a corpus
    of many small files would feel. Offers the two methods preparation uses,
    `iter(batch_size)` and `skip(count)`.
    """

    column_names = ["text"]

    def __init__(self, files: tuple[Path, ...], start: int = 0):
        self.files = files
        self.start = start

    def skip(self, count: int) -> TextFileDocuments:
        return TextFileDocuments(self.files, self.start + count)

    def iter(self, batch_size: int) -> Iterator[dict[str, list[str]]]:
        batch: list[str] = []
        seen = 0
        for path in self.files:
            with open(path, encoding="utf-8", errors="replace") as file:
                text = file.read()
            check_is_text(path, text)
            if not text or text.isspace():
                continue
            seen += 1
            if seen <= self.start:
                continue
            batch.append(text)
            if len(batch) == batch_size:
                yield {"text": batch}
                batch = []
        if batch:
            yield {"text": batch}


BINARY_SHARE = 0.01   # undecodable bytes (U+FFFD after decoding) above this share of a file: not text


def check_is_text(path: Path, text: str) -> None:
    """DataError naming a file of a text corpus that holds binary data (NUL bytes, or more than 1% of it not
    UTF-8): such bytes would otherwise surface as a tokenizer that "needs" thousands of pieces."""
    nul = text.count("\x00")
    undecodable = text.count("\ufffd")
    if nul or undecodable > max(16, BINARY_SHARE * len(text)):
        what = f"{nul} NUL bytes" if nul else f"{undecodable} of its {len(text)} characters are not UTF-8"
        raise DataError(f"corpus file {path} is not text ({what}): a text corpus holds UTF-8 .txt/.py/.md files; "
                        f"remove it from the corpus, or point data.source at a folder without it")


def stream_documents(
    source: str, *, text_field: str = "text", start: int = 0, cache_dir: str | os.PathLike | None = None
) -> TextFileDocuments | datasets.IterableDataset:
    """The documents of `source` from its document `start` on, as a stream for reading once in order.

    The same documents as `load_documents`, in the same order. Local text
    files are read file by file (`TextFileDocuments`); other local files and
    Hub datasets through a `datasets` stream. Nothing is copied into an Arrow
    cache. Skipping reads the skipped documents but does nothing else with them.
    """
    if parse_hub_spec(source) is None:
        local = parse_local_spec(source)
        if local.builder == "text":
            if text_field != "text":
                raise ValueError(f"source {source!r} has no text field {text_field!r}; its columns are ['text']")
            return TextFileDocuments(local.files, start)
    with _torch_left_alone():
        documents = load_documents(source, text_field=text_field, streaming=True, cache_dir=cache_dir)
        if start:
            skipped = documents.skip(start)   # the skipped records still pass the counting filter
            skipped.records_without_text = getattr(documents, "records_without_text", None)
            documents = skipped
    if parse_hub_spec(source) is None:   # a local file that fails as it is read: named with its line
        return ErrorsNamed(documents, local.builder, local.files)
    return documents
