"""Corpus sources: turn a source spec string into a `datasets` dataset with a "text" column.

A source spec is one of:

- `builtin:stdlib[:MAX_BYTES]`: the embedded default corpus (see `corpus.py`),
  optionally capped at MAX_BYTES;
- a local `.txt` / `.py` / `.md` file, or a folder of them: one document per file;
- a local `.jsonl` / `.json` file or folder: one document per record, text in `text_field`;
- a local `.parquet` file or folder: one document per row, text in `text_field`;
- any of these but .parquet compressed (`.jsonl.gz`, `.txt.zst`, ...: gz, bz2, xz, zst);
- a `datasets` `save_to_disk` folder (read with `datasets.load_from_disk`);
- a folder holding a dataset's splits (`train.jsonl` + `test.jsonl`, `data/train-*.parquet`, ...):
  the files of one split, `split` (data/local_files.py names splits as `datasets` does);
- `hf:owner/name[:config]`, or a bare `owner/name` that is not an existing path
  (and whose first part is no local folder either): a Hugging Face Hub dataset,
  streamed (nothing is downloaded up front). Hub datasets need a network; when a
  bare name cannot be loaded from the Hub, the error says that no such local
  path exists either.

A run streams its source (`stream_documents`): local text, `.jsonl` and
`.parquet` files are read file by file by our own readers (a text file whole,
records for their text field alone: data/record_documents.py), `.json` files,
saved datasets and Hub datasets through `datasets`' packaged builders.
`source_fingerprint` names a source's content for cache keys without loading
it, so a warm cache never re-reads the corpus. A file that does not parse is
reported as one `DataError` naming the file and line.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

from spillway.layers.errors import DataError

from .cache import stable_key
from .corpus import BUILTIN_STDLIB, default_corpus_files
from .corpus_errors import (ErrorsNamed, fields_differ, first_non_text_record, format_hint, non_text_field,
                            non_text_in_a_later_file, normalization_hint, quiet_builders, records_under,
                            unreadable_corpus)
from .local_files import (BUILDER_BY_SUFFIX, COMPRESSIONS, HIDDEN_FOLDER, JSON_SUFFIXES, PARQUET_SUFFIXES,  # noqa: F401
                          SAVED, TEXT_SUFFIXES, UTF8_BOM, builder_for, check_codec, corpus_suffix, data_splits,
                          documentation_beside_records, empty_parquet, named, read_bytes, saved_dataset_splits,
                          walk_files)
from .record_documents import RecordFileDocuments, RecordsWithoutText, batches, has_text, readable_by_field

_BUILDER_BY_SUFFIX = BUILDER_BY_SUFFIX
_SUPPORTED = f"{', '.join(BUILDER_BY_SUFFIX)}, and those of them but .parquet compressed ({', '.join(COMPRESSIONS)})"
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
    """A parsed local source: the packaged builder and the files of one split it reads, sorted."""

    builder: str          # "text" | "json" | "parquet" | SAVED (a `save_to_disk` folder)
    files: tuple[Path, ...]
    split: str = "train"
    splits: tuple[str, ...] = ("train",)          # every split the source holds
    skipped: tuple[tuple[Path, str], ...] = ()    # files not read, and why
    root: Path | None = None                      # SAVED: the folder `datasets.load_from_disk` reads

    def notes(self, source: str) -> list[str]:
        """One line for the splits left out (when there are several), one for the files skipped."""
        lines = []
        others = [name for name in self.splits if name != self.split]
        if others:
            lines.append(f"data: {source}: reading split {self.split!r} ({_files(len(self.files))}); left out: "
                         f"{', '.join(others)} (data.split chooses)")
        if self.skipped:
            folders = sum(why == HIDDEN_FOLDER for _, why in self.skipped)
            counted = " and ".join(part for part in (_files(len(self.skipped) - folders) if len(self.skipped) > folders
                                                     else "", _folders(folders) if folders else "") if part)
            unsplit = [path for path, why in self.skipped if why == IN_NO_SPLIT]
            hint = ""
            if len(unsplit) >= len(self.files):   # most of a folder left out by other files' names
                named_for = ", ".join(f"{path.name} -> {self.split}" for path in self.files[:2])
                hint = (f" (files named for a split, {named_for}, make the folder a dataset of splits, as `datasets` "
                        f"reads one, and the {len(unsplit)} named for none are left out: rename those named for a "
                        f"split, or move the others into a folder of their own and point data.source there)")
            lines.append(f"data: {source}: skipped {counted}: {named(list(self.skipped))}{hint}")
        return lines


IN_NO_SPLIT = "in no split"


def _files(count: int) -> str:
    return f"{count} file{'s' if count != 1 else ''}"


def _folders(count: int) -> str:
    return f"{count} folder{'s' if count != 1 else ''}"


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
    if builder_for(Path(source)) is not None or Path(source).suffix.lower() in COMPRESSIONS:
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


def _builtin_options(source: str) -> dict[str, int]:
    # `builtin:stdlib:N` caps the built-in corpus at N bytes (smoke tests, demos).
    _, _, cap = source[len(BUILTIN_STDLIB) :].partition(":")
    if not cap:
        return {}
    if not cap.isdigit():
        raise ValueError(f"{source!r}: expected {BUILTIN_STDLIB}[:MAX_BYTES] with an integer byte cap")
    return {"max_bytes": int(cap)}


def parse_local_spec(source: str, split: str = "train") -> LocalSpec:
    """Resolve `builtin:stdlib` or a local file/folder into its builder and the files of `split`."""
    if source == BUILTIN_STDLIB or source.startswith(BUILTIN_STDLIB + ":"):
        _check_split(source, split, ["train"])
        return LocalSpec("text", tuple(default_corpus_files(**_builtin_options(source))))
    path = Path(source).expanduser()
    if not path.exists():
        pattern = any(c in source for c in "*?[")   # no shell expanded it: a quoted glob, or one in a recipe
        raise FileNotFoundError(
            f"corpus path {str(path)!r} does not exist (and is not builtin:stdlib or a Hub id "
            f"like hf:owner/name)" + ("; patterns are not expanded: give the folder that holds the files (or "
                                      "one file)" if pattern else "")
        )
    if path.is_file():
        return _file_spec(path, split)
    saved = saved_dataset_splits(path)
    if saved is not None:
        return _saved_spec(path, saved, split)
    return _folder_spec(path, split)


class MissingSplitError(DataError):
    """A source without the split asked for: the line lists the splits it has."""


def _check_split(source: str, split: str, splits: list[str]) -> None:
    if split not in splits:
        raise MissingSplitError(f"corpus {source!r} has no split {split!r}; its splits: {', '.join(splits)} "
                                f"(data.split, or --split, chooses one)")


def _file_spec(path: Path, split: str) -> LocalSpec:
    """One file: one split, `train` (as `datasets` names the split of the data files it is given)."""
    builder = builder_for(path)
    if builder is None:
        raise ValueError(f"corpus file {str(path)!r} has an unsupported type; supported: {_SUPPORTED}")
    _check_split(str(path), split, ["train"])
    check_codec([path])
    if builder == "parquet" and empty_parquet(path):
        raise ValueError(f"corpus file {str(path)!r} is an empty parquet file (0 rows): no record to read")
    return LocalSpec(builder, (path,))


def _saved_spec(folder: Path, splits: list[str], split: str) -> LocalSpec:
    """A `save_to_disk` folder: a Dataset (one split, `train`) or a DatasetDict's chosen split folder."""
    if splits == [""]:
        _check_split(str(folder), split, ["train"])
        root, splits = folder, ["train"]
    else:
        _check_split(str(folder), split, splits)
        root = folder / split
    files, _ = walk_files(root)
    return LocalSpec(SAVED, tuple(files), split, tuple(splits), root=root)


def _folder_spec(folder: Path, split: str) -> LocalSpec:
    """A folder's files of `split` (data/local_files.py: kinds, splits, what is skipped and why)."""
    found, skipped = walk_files(folder)
    corpus = [path for path in found if builder_for(path) is not None]
    skipped += [(path, "not a corpus file type") for path in found if builder_for(path) is None]
    if not corpus:
        raise ValueError(f"corpus folder {str(folder)!r} holds no supported files ({_SUPPORTED})"
                         + (f"; skipped: {named(skipped)}" if skipped else ""))
    splits = data_splits(folder, corpus) or {"train": corpus}
    _check_split(str(folder), split, sorted(splits))
    in_splits = {path for paths in splits.values() for path in paths}
    skipped += [(path, IN_NO_SPLIT) for path in corpus if path not in in_splits]
    files = splits[split]
    empty = [path for path in files if builder_for(path) == "parquet" and empty_parquet(path)]
    skipped += [(path, "empty parquet, 0 rows") for path in empty]
    files = [path for path in files if path not in empty]
    if not files:
        raise ValueError(f"corpus folder {str(folder)!r}: every file of split {split!r} is an empty parquet file "
                         f"(0 rows): no record to read")
    docs = documentation_beside_records(files)   # a dataset card (README.md) beside its .jsonl/.parquet files
    skipped += [(path, "documentation beside record files") for path in docs]
    files = [path for path in files if path not in docs]
    builders = sorted({builder_for(file) for file in files})
    if len(builders) > 1:
        kinds = sorted({corpus_suffix(Path(file)) for file in files})   # a.jsonl.gz is a .jsonl
        raise ValueError(
            f"corpus folder {str(folder)!r} mixes file kinds ({', '.join(kinds)}); "
            f"point the source at a folder holding one kind (or list each folder in data.mixture)"
        )
    check_codec(files)
    return LocalSpec(builders[0], tuple(files), split, tuple(sorted(splits)), tuple(sorted(skipped)))


def source_notes(source: str, split: str = "train") -> list[str]:
    """What a run says about reading `source`: the split it reads when there are several, and the files it
    skips (module docstring of data/local_files.py); nothing for a Hub source."""
    if parse_hub_spec(source) is not None:
        return []
    return parse_local_spec(source, split).notes(source)


def source_fingerprint(source: str, *, text_field: str = "text", split: str = "train") -> str:
    """A key that changes whenever the source's content may have changed.

    Local files are keyed by path, size and modification time (as `make` does),
    which is cheap for any corpus size. Hub sources are keyed by their spec:
    a Hub dataset is assumed not to change under the same id and config.
    """
    hub = parse_hub_spec(source)
    if hub is not None:
        return stable_key("hub", hub.repo_id, hub.config, split, text_field)
    local = parse_local_spec(source, split)   # the split's files: another split's corpus is another key
    return stable_key("local", local.builder, file_stats(local.files), split, text_field)


def file_stats(files) -> list[tuple[str, int, int]]:
    """(resolved path, size, modification time) of each file: what a key of their contents is made of, as `make`
    judges a file changed."""
    return [(str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns) for path in files]


def _records_under_a_column(dataset, text_field: str) -> str:
    """corpus_errors.records_under for a dataset whose column holds a list of records ({"data": [...]} read by
    `datasets` as one row): told by the column's features, without reading it."""
    features = dataset.features or {}
    inner = {name: getattr(feature, "feature", None) for name, feature in features.items()}
    return records_under({name: [item] for name, item in inner.items() if isinstance(item, dict)}, (text_field,))


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
                f"source {source!r} has no text field {text_field!r}; its columns are {columns} (data.text_field "
                f"names the field holding the text; --text-field for python -m spillway.data){format_hint(columns)}"
                f"{normalization_hint(text_field, columns)}{_records_under_a_column(dataset, text_field)}"
            )
        feature = dataset.features[text_field] if dataset.features else None
        if feature is not None and getattr(feature, "dtype", None) not in ("string", "large_string"):
            raise ValueError(f"source {source!r}: field {text_field!r} holds {feature}, not text")
    dataset = dataset.select_columns([text_field])
    if text_field != "text":
        dataset = dataset.rename_column(text_field, "text")
    return dataset


def load_local_files(local: LocalSpec, streaming: bool,
                     cache: str | None) -> datasets.Dataset | datasets.IterableDataset:
    """A local source's files through `datasets`: a `save_to_disk` folder with `load_from_disk`, data files with
    the packaged builder (their split is chosen already, so `datasets` sees them as its one split, train); a
    failure to open them is `unreadable_corpus`'s one line. Text documents and chat records alike."""
    if local.builder == SAVED:
        dataset = datasets.load_from_disk(str(local.root))
        return dataset.to_iterable_dataset() if streaming else dataset
    builder_options: dict[str, Any] = {}
    if local.builder == "text":
        # One document per file, a leading BOM dropped (utf-8-sig); undecodable bytes become U+FFFD rather
        # than aborting a whole corpus over one stray file.
        builder_options = {"sample_by": "document", "encoding": "utf-8-sig", "encoding_errors": "replace"}
    try:
        with quiet_builders():
            dataset = datasets.load_dataset(local.builder, data_files=[str(path) for path in local.files],
                                            split="train", streaming=streaming, cache_dir=cache, **builder_options)
    except Exception as error:   # datasets wraps the parser's error; find the file and line ourselves
        raise unreadable_corpus(local.builder, local.files, error) from error
    # its reader of compressed files keeps the BOM utf-8-sig drops from plain ones
    return dataset.map(_without_bom, batched=True) if local.builder == "text" else dataset


def _text_files_dataset(local: LocalSpec, streaming: bool,
                        cache: str | None) -> datasets.Dataset | datasets.IterableDataset:
    """A text source's documents read as a run reads them (`TextFileDocuments`: a binary or UTF-16 file refused
    in one line, a few bytes not UTF-8 warned of), into a `datasets` dataset; the text builder read UTF-16 as
    mojibake without a word. The Arrow cache is keyed by the files' paths, sizes and times."""
    files = [str(path) for path in local.files]
    key = stable_key("text files", file_stats(local.files))
    options = {"gen_kwargs": {"files": files, "key": key},
               "features": datasets.Features({"text": datasets.Value("string")})}   # all empty: no rows to infer
    if streaming:
        return datasets.IterableDataset.from_generator(_text_rows, **options)
    try:
        return datasets.Dataset.from_generator(_text_rows, cache_dir=cache, **options)
    except datasets.exceptions.DatasetGenerationError as error:   # it wraps the reader's own one-line error
        if isinstance(error.__cause__, (DataError, ValueError, OSError)):
            raise error.__cause__ from None
        raise


def _text_rows(files: list[str], key: str) -> Iterator[dict[str, str]]:
    del key   # in the arguments only for the cache's fingerprint: the files' contents, not just their names
    # empty ones too: a dataset of no rows is an error of `datasets`' own; load_documents drops and names them
    for text in TextFileDocuments(tuple(Path(file) for file in files))._texts(keep_empty=True):
        yield {"text": text}


def _without_bom(batch: dict[str, list]) -> dict[str, list]:
    return {"text": [text.removeprefix("\ufeff") for text in batch["text"]]}


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
        local = parse_local_spec(source, split)
        dataset = (_text_files_dataset(local, bool(streaming), cache) if local.builder == "text"
                   else load_local_files(local, bool(streaming), cache))
    try:
        dataset = select_text_column(dataset, text_field, source)
        # several files: a later file's non-string values were cast to JSON text, the column's type is string
        several = hub is None and len(local.files) > 1 and local.builder in ("json", "parquet")
        where = non_text_in_a_later_file(local.files, text_field) if several else None
    except ValueError:
        # (a saved dataset's files are its own metadata and arrow files: their fields say nothing)
        several = hub is None and len(local.files) > 1 and local.builder != SAVED
        differ = fields_differ(local.files) if several else None
        if differ is not None:   # one file of other fields (a stray config.json) set the columns
            raise differ from None
        where = first_non_text_record(local.files, text_field) if hub is None and local.builder == "json" else None
        if where is None:
            raise
    if where is not None:
        raise non_text_field(where, text_field)
    streamed = isinstance(dataset, datasets.IterableDataset)
    counter = RecordsWithoutText() if streamed else None   # a stream is filtered here, as it is read
    dataset = dataset.filter(counter or has_text, batched=True)
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
    a leading BOM dropped, undecodable bytes replaced and counted in one
    warning line, universal newlines, blank files dropped, gz/bz2/xz/zst read),
    without its per-file bookkeeping: a `datasets` stream over local files
    holds about 2 kB per file (33 MB for 14k files, measured), which a corpus
    of many small files would feel. Offers the two methods preparation uses,
    `iter(batch_size)` and `skip(count)`.
    """

    column_names = ["text"]

    def __init__(self, files: tuple[Path, ...], start: int = 0):
        self.files = files
        self.start = start
        self.records_without_text = RecordsWithoutText()   # a file is never without text: its `empty` only

    def skip(self, count: int) -> TextFileDocuments:
        return TextFileDocuments(self.files, self.start + count)

    def iter(self, batch_size: int) -> Iterator[dict[str, list[str]]]:
        self.records_without_text.empty = 0   # counted again by each read
        return batches(self._texts(), self.start, batch_size)

    def _texts(self, keep_empty: bool = False) -> Generator[str, None, None]:
        """Each file's text that holds text (an empty file counted; `keep_empty`: yielded too), with one warning
        for the files that are not all UTF-8 once the reading ends."""
        not_utf8: dict[Path, int] = {}
        try:
            for path in self.files:
                text, not_utf8[path] = read_text_document(path)
                check_is_text(path, text)
                if not text or text.isspace():
                    self.records_without_text.empty += 1
                    if not keep_empty:
                        continue
                yield text
        except GeneratorExit:   # the reader stopped early (a tokenizer trains on the head of the corpus)
            warn_not_utf8(not_utf8)
            raise
        else:   # read to its end; a file refused (not text) is its error's one line, no warning beside it
            warn_not_utf8(not_utf8)


_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")   # a byte that is not UTF-8, as errors="surrogateescape" reads it


def read_text_document(path: Path) -> tuple[str, int]:
    """A text corpus file as one document (decompressed, a leading BOM dropped, universal newlines) and the
    number of its bytes that are not UTF-8, each read as U+FFFD (as the `datasets` text builder does)."""
    data = read_bytes(path).removeprefix(UTF8_BOM)
    try:
        text, bad = data.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        bad = len(_ESCAPED_BYTE.findall(data.decode("utf-8", errors="surrogateescape")))
    return text.replace("\r\n", "\n").replace("\r", "\n"), bad


_WARNED_NOT_UTF8: set[Path] = set()   # said once a process: a corpus is read twice (tokenizer, then tokens)


def warn_not_utf8(counts: dict[Path, int]) -> None:
    """One warning line naming the files that are text but not all UTF-8, and how many bytes were replaced.

    A warning, not an error: such a file is under the binary threshold (`check_is_text`), so it is text with a
    few bytes in a legacy encoding (cp1252, Latin-1), which a large scraped corpus holds now and then; stopping
    an hours-long preparation for it would cost more than a few U+FFFD. The line names the files and the fix,
    and a re-encoded file changes the cache key, so the next run reads it right."""
    new = {path: count for path, count in counts.items() if count and path not in _WARNED_NOT_UTF8}
    if not new:
        return
    _WARNED_NOT_UTF8.update(new)
    shown = ", ".join(f"{path} ({count})" for path, count in list(new.items())[:3])
    more = f" and {len(new) - 3} more" if len(new) > 3 else ""
    print(f"warning: data: {len(new)} text files are not all UTF-8; {sum(new.values())} bytes were read as U+FFFD: "
          f"{shown}{more}; re-encode them to UTF-8 (for cp1252/Latin-1: iconv -f cp1252 -t utf-8)", file=sys.stderr)


BINARY_SHARE = 0.01   # undecodable bytes (U+FFFD after decoding) above this share of a file: not text


def check_is_text(path: Path, text: str) -> None:
    """DataError naming a file of a text corpus that holds binary data (NUL bytes, or more than 1% of it not
    UTF-8): such bytes would otherwise surface as a tokenizer that "needs" thousands of pieces."""
    nul = text.count("\x00")
    undecodable = text.count("\ufffd")
    if nul or undecodable > max(16, BINARY_SHARE * len(text)):
        if _reads_as_utf16(text):   # Windows' "Unicode" text: a good file in another encoding, not binary
            raise DataError(f"corpus file {path} is UTF-16 text, not UTF-8: re-encode it (iconv -f utf-16 -t utf-8 "
                            f"FILE > NEW), or remove it from the corpus")
        if nul:
            raise DataError(f"corpus file {path} is not text ({nul} NUL bytes): a text corpus holds UTF-8 "
                            f".txt/.py/.md files; remove it from the corpus, or point data.source at a folder "
                            f"without it")
        # no NUL: most likely text in a legacy encoding, which re-encoding saves
        raise DataError(f"corpus file {path}: {undecodable} of its {len(text)} characters are not UTF-8 (binary, or "
                        f"text in a legacy encoding such as cp1252/Latin-1?); re-encode it to UTF-8 (iconv -f cp1252 "
                        f"-t utf-8), or remove it from the corpus")


def _reads_as_utf16(text: str) -> bool:
    """Whether a file's text, decoded as UTF-8 with replacements, was UTF-16: Latin text whose every other byte is
    NUL, after a byte order mark (0xff 0xfe or 0xfe 0xff, two replacements) if one opens it."""
    head = text[:4096].removeprefix("\ufffd\ufffd")   # the byte order mark alone says nothing: random bytes too
    return len(head) >= 8 and any(head[k::2].count("\x00") >= 0.9 * len(head[k::2]) for k in (0, 1))


def stream_documents(
    source: str, *, text_field: str = "text", start: int = 0, cache_dir: str | os.PathLike | None = None,
    split: str = "train",
) -> TextFileDocuments | datasets.IterableDataset:
    """The documents of `source` from its document `start` on, as a stream for reading once in order.

    The same documents as `load_documents`, in the same order. Local text
    files are read file by file (`TextFileDocuments`), local `.jsonl` and
    `.parquet` files too, for their text field alone (`RecordFileDocuments`:
    their other fields may differ from file to file); `.json` files, saved
    datasets and Hub datasets through a `datasets` stream. Nothing is copied
    into an Arrow cache. Skipping reads the skipped documents but does nothing
    else with them.
    """
    if parse_hub_spec(source) is None:
        local = parse_local_spec(source, split)
        if local.builder == "text":
            if text_field != "text":
                raise ValueError(f"source {source!r} has no text field {text_field!r}; its columns are ['text']")
            return TextFileDocuments(local.files, start)
        if local.builder in ("json", "parquet") and readable_by_field(local.files):
            return RecordFileDocuments(local.files, text_field, source, start).check_the_field_is_there()
    with _torch_left_alone():
        documents = load_documents(source, text_field=text_field, split=split, streaming=True, cache_dir=cache_dir)
        if start:
            skipped = documents.skip(start)   # the skipped records still pass the counting filter
            skipped.records_without_text = getattr(documents, "records_without_text", None)
            documents = skipped
    if parse_hub_spec(source) is None:   # a local file that fails as it is read: named with its line
        return ErrorsNamed(documents, local.builder, local.files, source=source, text_field=text_field)
    return documents
