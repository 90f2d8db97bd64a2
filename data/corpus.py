"""The built-in default corpus: the Python standard library's own source files.

Every CPython installation ships its standard library as `.py` source, so this
corpus exists offline on any fresh machine, with no download and no data files
in this repository. It is small (about 8 MB by default) and real (code,
docstrings, comments), which is what smoke runs and tests need: enough text to
train a tokenizer and see a loss curve fall.

The selection is deterministic for a given installation: files are visited in
sorted order of their path relative to the stdlib root. Different CPython
versions give different (but each deterministic) corpora; the data cache keys
on the files themselves, so switching interpreters never reuses stale tokens.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

BUILTIN_STDLIB = "builtin:stdlib"
DEFAULT_MAX_BYTES = 8_000_000

# Directories that are not ordinary library source: test suites (huge, full of
# deliberately odd encodings and fixtures), third-party packages, IDLE and
# turtle demos (application data rather than library code), and directories
# whose .py files are generated tables (codecs, pydoc topic dumps) or bundled
# installers. Matched against every path component.
_SKIP_DIRS = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "turtledemo",
        "site-packages",
        "dist-packages",
        "__pycache__",
        "lib-dynload",
        "encodings",
        "pydoc_data",
        "ensurepip",
    }
)
# Generated modules outside those directories (build-time configuration dumps).
_SKIP_FILE_PREFIXES = ("_sysconfigdata",)


def stdlib_root() -> Path:
    """The directory holding this interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _library_sources(root: Path) -> list[Path]:
    """Every library `.py` file under `root`, sorted by relative path."""
    found: list[tuple[str, Path]] = []
    for directory, subdirectories, filenames in os.walk(root):
        relative = Path(directory).relative_to(root)
        # Prune in place so the (large) skipped trees are never walked.
        subdirectories[:] = [
            name
            for name in subdirectories
            if name not in _SKIP_DIRS
            and not name.startswith(".")
            # config-3.x-<platform> holds build files (Makefile, python-config.py).
            and not (relative == Path(".") and name.startswith("config-"))
        ]
        for name in filenames:
            if name.endswith(".py") and not name.startswith(_SKIP_FILE_PREFIXES):
                found.append(((relative / name).as_posix(), Path(directory) / name))
    return [path for _, path in sorted(found)]


def default_corpus_files(max_bytes: int = DEFAULT_MAX_BYTES) -> list[Path]:
    """Standard-library `.py` files, sorted by relative path, totalling at most `max_bytes`.

    Files that would push the total over the cap are skipped (not the rest of
    the list), so the corpus fills the cap with modules from the whole library
    rather than stopping at the first large one.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    root = stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"the standard library directory {root} does not exist")
    candidates = _library_sources(root)
    selected: list[Path] = []
    total = 0
    for path in candidates:
        size = path.stat().st_size
        if size == 0 or total + size > max_bytes:
            continue
        selected.append(path)
        total += size
    if not selected:
        raise FileNotFoundError(
            f"no standard-library .py files of at most {max_bytes} bytes under {root}"
        )
    return selected
