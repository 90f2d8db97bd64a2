"""Which files a local corpus folder holds: file kinds, compression, splits, and what is skipped.

A folder is walked following symlinked subfolders (Python 3.11's `Path.rglob`
does not, so a `books -> /data/books` link would vanish), hidden files and
folders excluded. Each file is a corpus file by its suffix, seen through one
compression suffix (`a.jsonl.gz` is JSON lines, gzip-compressed), as
`datasets`' json and text builders read gz/bz2/xz/zst themselves.

Splits are named as `datasets` names them for a folder of data files (its
data_files patterns, `datasets.data_files`): `data/train-00000-of-00001.parquet`
(any split name, as `hf download` leaves a Hub dataset), or the keywords
train/validation/test in a file or folder name (`train.jsonl`, `test/`,
`train_sft.jsonl`). A folder without split names is one split, `train`.

Every file that is not read is kept with the reason (an unknown type, a
dangling symlink, an empty parquet shard, a file in no split, a README.md
dataset card beside JSON or parquet records), so the run can
say what it left out in one line instead of dropping it silently.

A `datasets` `save_to_disk` folder (state.json + dataset_info.json + .arrow;
a DatasetDict: dataset_dict.json and one such folder per split) is recognised
here too: its JSON files are metadata, not records.
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import importlib.util
import io
import json
import lzma
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from spillway.layers.errors import DataError

TEXT_SUFFIXES = (".txt", ".py", ".md")
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
BUILDER_BY_SUFFIX = {
    **{suffix: "text" for suffix in TEXT_SUFFIXES},
    **{suffix: "json" for suffix in JSON_SUFFIXES},
    **{suffix: "parquet" for suffix in PARQUET_SUFFIXES},
}
# Compression suffix -> the module that reads it (zstandard is a package of its own: a dependency, but an
# environment made without it, such as the GPU machine's, is told so in one line).
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma", ".zst": "zstandard"}
SAVED = "saved"   # the builder name of a `save_to_disk` folder, read with `datasets.load_from_disk`
UTF8_BOM = codecs.BOM_UTF8


def corpus_suffix(path: Path) -> str:
    """The suffix naming the file's kind, behind one compression suffix: `a.jsonl.gz` -> `.jsonl`."""
    suffixes = [suffix.lower() for suffix in path.suffixes[-2:]]
    if len(suffixes) == 2 and suffixes[1] in COMPRESSIONS:
        return suffixes[0]
    return suffixes[-1] if suffixes else ""


def compression_of(path: Path) -> str | None:
    suffix = path.suffix.lower()
    return suffix if suffix in COMPRESSIONS else None


def builder_for(path: Path) -> str | None:
    """The `datasets` builder that reads this file, or None; parquet is never read compressed."""
    builder = BUILDER_BY_SUFFIX.get(corpus_suffix(path))
    return None if builder == "parquet" and compression_of(path) else builder


def check_codec(files: Iterable[Path]) -> None:
    """DataError when a compressed file needs a package that is not installed (only zstandard can be missing):
    `datasets` would otherwise fail deep inside its reader."""
    zst = [path for path in files if compression_of(path) == ".zst"]
    if zst and importlib.util.find_spec("zstandard") is None:
        raise DataError(f"corpus file {str(zst[0])!r}{_more(zst)} is zstd-compressed and the zstandard package is "
                        f"not installed: pip install zstandard (or decompress it: zstd -d)")


def _more(paths: list) -> str:
    return f" (and {len(paths) - 1} more)" if len(paths) > 1 else ""


_FORMAT_OF = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd"}


class _Decompressing(io.RawIOBase):
    """A compressed file's bytes whose decompression failure (not that format, cut short, corrupt) is one
    DataError naming the file: the decompressors' own errors (EOFError, "Not a gzipped file", zlib's,
    LZMA's, zstd's) name nothing, and `spillway` called an EOFError an internal error."""

    def __init__(self, path: Path, compressed: IO[bytes]):
        super().__init__()
        self.path, self._compressed = path, compressed

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        try:
            data = self._compressed.read(len(buffer))
        except Exception as error:   # noqa: BLE001 (each decompressor raises its own kinds)
            if isinstance(error, OSError) and error.errno is not None:   # the disk's error, not the data's
                raise
            suffix = compression_of(self.path)
            raise DataError(f"corpus file {self.path} cannot be read as {_FORMAT_OF[suffix]}: "
                            f"{type(error).__name__}: {' '.join(str(error).split()) or 'cut short'}; the file "
                            f"is cut short (an interrupted download or copy) or not {_FORMAT_OF[suffix]} "
                            f"despite its name: fetch it again, or remove its {suffix} suffix if it is "
                            f"not compressed") from None
        buffer[:len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._compressed.close()
        super().close()


class _ZstdFrames(io.RawIOBase):
    """A .zst file's bytes, every frame in turn, and an EOFError where the file ends inside a frame: zstandard's
    own reader returned a cut-short file's decompressed part as if whole (an interrupted download read as a
    smaller corpus, without a word), where gzip, bz2 and lzma raise. The compressed bytes go in 4 KiB at a time:
    what one piece decompresses to is bounded (zstd's ratio is at most about 32,000), so memory stays flat on a
    file of one repeated line."""

    _PIECE = 1 << 12

    def __init__(self, path: Path):
        import zstandard

        super().__init__()
        self._file, self._zstd = open(path, "rb"), zstandard.ZstdDecompressor()
        self._frame, self._in_frame = self._zstd.decompressobj(), False
        self._input, self._input_at = b"", 0
        self._output, self._output_at = memoryview(b""), 0

    def readable(self) -> bool:
        return True

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            out.append(self._frame.decompress(data))
            self._in_frame = True
            if not self._frame.eof:
                break
            data = self._frame.unused_data   # the next frame's first bytes, if any
            self._frame, self._in_frame = self._zstd.decompressobj(), False
        return b"".join(out)

    def _next_output(self) -> bytes:
        """The next decompressed bytes; b"" at the end of the file (an EOFError where a frame is unfinished)."""
        while True:
            if self._input_at >= len(self._input):
                self._input, self._input_at = self._file.read(1 << 20), 0
                if not self._input:
                    if self._in_frame:
                        raise EOFError("the file ends inside a zstd frame")
                    return b""
            piece = self._input[self._input_at:self._input_at + self._PIECE]
            self._input_at += len(piece)
            data = self._decompress(piece)
            if data:
                return data

    def readinto(self, buffer) -> int:
        if self._output_at >= len(self._output):
            self._output, self._output_at = memoryview(self._next_output()), 0
        size = min(len(buffer), len(self._output) - self._output_at)
        buffer[:size] = self._output[self._output_at:self._output_at + size]
        self._output_at += size
        return size

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


def open_binary(path: Path) -> IO[bytes]:
    """The file's bytes, decompressed as its suffix says (a failure to decompress: one DataError naming it)."""
    compression = compression_of(path)
    if compression is None:
        return open(path, "rb")
    if compression == ".gz":
        compressed = gzip.open(path, "rb")
    elif compression == ".bz2":
        compressed = bz2.open(path, "rb")
    elif compression == ".xz":
        compressed = lzma.open(path, "rb")
    else:
        check_codec([path])
        compressed = _ZstdFrames(path)
    return io.BufferedReader(_Decompressing(path, compressed), buffer_size=1 << 20)


def read_bytes(path: Path) -> bytes:
    with open_binary(path) as file:
        return file.read()


HIDDEN_FOLDER = "a hidden folder, not read"   # why a skipped entry is a folder: counted apart from files


def walk_files(folder: Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """(every visible file under `folder`, each read once; [(a file or hidden folder not read, why)]).

    Symlinked folders are followed, each real folder walked once, under its own name where it is inside
    `folder` (in sorted order otherwise: the name a folder outside it is read under does not depend on the
    filesystem's listing order). A file reached twice (a symlink beside
    the file it names, `latest.jsonl -> dump-2024-05.jsonl`) is read once, under its own name where the
    folder holds it: read twice, its documents trained twice and landed in both splits."""
    found, skipped = [], []
    seen = set()
    top = os.path.realpath(folder)
    for root, dirs, names in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:   # a link back up the tree, or a second name of a folder: walked once
            dirs[:] = []
            continue
        seen.add(real)
        # hidden files and folders are not read (as `datasets` reads none), but named: a user's `.notes.txt`
        # left out of the corpus without a word was a finding
        skipped += [(Path(root) / name, HIDDEN_FOLDER) for name in sorted(dirs) if name.startswith(".")]
        dirs[:] = sorted(name for name in dirs if not name.startswith("."))
        # a link to a folder of the corpus is not walked: the folder is, under its own name (walked under the
        # link's, it moved in the order, or out of its split, as the link's name sorted)
        inside = [name for name in dirs if os.path.islink(os.path.join(root, name))
                  and _within(os.path.realpath(os.path.join(root, name)), top)]
        skipped += [(Path(root) / name, "a link to a folder of the corpus, read under its own name") for name in inside]
        dirs[:] = [name for name in dirs if name not in inside]
        for name in names:
            if name.startswith("."):
                skipped.append((Path(root) / name, "hidden, not read"))
                continue
            path = Path(root) / name
            if path.is_file():
                found.append(path)
            elif path.is_symlink():
                skipped.append((path, _broken_link(path)))
    kept: dict[str, Path] = {}
    for path in sorted(found, key=lambda path: (path.is_symlink(), path)):   # a file's own name first
        kept.setdefault(os.path.realpath(path), path)
    skipped += [(path, f"the same file as {kept[os.path.realpath(path)]}, read once") for path in sorted(found)
                if kept[os.path.realpath(path)] != path]
    return sorted(kept.values()), skipped


def _within(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip(os.sep) + os.sep)


def _broken_link(path: Path) -> str:
    """Why a symlink leads to no file: nothing at its end, or links that point at each other."""
    try:
        path.resolve(strict=True)
    except FileNotFoundError:
        return "a dangling symlink"
    except (RuntimeError, OSError):   # Python 3.11-3.12 raise RuntimeError for a loop, 3.13 OSError (ELOOP)
        return "a symlink loop"
    return "a symlink to no regular file"


# The metadata files `datasets` never reads as data (its FILES_TO_IGNORE), beside a dataset's record files.
DATASET_METADATA_FILES = ("config.json", "dataset_info.json", "dataset_infos.json", "dataset_dict.json")


def documentation_beside_records(files: list[Path]) -> list[Path]:
    """The Markdown files of a folder whose other files are records (JSON or parquet): its README.md, the
    dataset card every Hub dataset and `hf download` folder has, is not a document of the corpus; nor is a
    metadata file `datasets` leaves beside its records (`DATASET_METADATA_FILES`). In a folder of text files
    a .md file is text like the rest, and stays."""
    metadata = [path for path in files if corpus_suffix(path) == ".md" or path.name in DATASET_METADATA_FILES]
    others = {builder_for(path) for path in files if path not in metadata}
    return metadata if others and others.isdisjoint({"text"}) else []


def empty_parquet(path: Path) -> bool:
    """A parquet file of 0 rows (Spark and `datasets.filter` exports write them): it holds nothing to read, and
    `datasets`' parquet builder stops on it with "BatchSize must be greater than 0"."""
    import pyarrow.parquet as pq

    try:
        return pq.read_metadata(path).num_rows == 0
    except Exception:   # unreadable: the builder names the problem when it reads the file
        return False


def data_splits(folder: Path, files: list[Path]) -> dict[str, list[Path]]:
    """{split: its files} as `datasets` assigns a folder's files to splits (module docstring); a file may be in
    none. `datasets`' own resolver globs the disk; this one matches the files found here (symlinks followed)."""
    from datasets.data_files import EmptyDatasetError, _get_data_files_patterns
    from fsspec.utils import glob_translate

    relative = {path: path.relative_to(folder).as_posix() for path in files}

    def resolve(pattern: str) -> list[str]:
        regex = re.compile(glob_translate(pattern))
        return [name for name in relative.values() if regex.match(name)]

    try:
        patterns = _get_data_files_patterns(resolve)
    except EmptyDatasetError:
        return {}
    splits = {}
    for split, split_patterns in patterns.items():
        regexes = [re.compile(glob_translate(pattern)) for pattern in split_patterns]
        splits[str(split)] = [path for path, name in relative.items() if any(r.match(name) for r in regexes)]
    return {split: paths for split, paths in splits.items() if paths}


def saved_dataset_splits(folder: Path) -> list[str] | None:
    """The splits of a `save_to_disk` folder ([""]: a single Dataset, the folder itself), or None."""
    if (folder / "dataset_dict.json").is_file():
        try:
            return [str(split) for split in json.loads((folder / "dataset_dict.json").read_text())["splits"]]
        except (ValueError, KeyError, TypeError) as error:
            raise DataError(f"{folder}/dataset_dict.json (a datasets save_to_disk folder) is unreadable: "
                            f"{type(error).__name__}: {error}") from None
    if (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file():
        return [""]
    return None


def named(skipped: list[tuple[Path, str]], shown: int = 3) -> str:
    """'a.csv (not a corpus file type), b (a dangling symlink), ...' for up to `shown` files."""
    names = ", ".join(f"{path} ({why})" for path, why in skipped[:shown])
    return names + (f" and {len(skipped) - shown} more" if len(skipped) > shown else "")
