"""Cache keys, crash-safe writes and a writer's lock for the data cache (tokenizers, token shards, packed rows).

Every cached artifact is named by a hash of everything that determines its
content, so a changed input is a cache miss rather than a stale hit. Artifacts
are written under a temporary name in the same directory and renamed into place
only once complete: `rename` is atomic on one filesystem, so a reader (or a run
restarted after a crash) sees either the whole artifact or nothing, never half.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np


def stable_key(*parts: object) -> str:
    """A hex SHA-256 of JSON-serialisable parts; equal inputs give equal keys across runs."""
    blob = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


# What a full disk gets, after the path and the bytes, from every command: each keeps what it finished (a file
# is renamed into place whole), so the same command goes on from there.
DISK_FULL_ADVICE = ("free space on that disk, or write to another (the data cache: data.cache_dir, --cache-dir for "
                    "python -m spillway.data; a run: checkpoint.dir; an export: another folder), and run the same "
                    "command again: what is finished is kept (an export's folder loads again once one finishes)")


@contextlib.contextmanager
def disk_full_named(final: Path, size: int | None) -> Iterator[None]:
    """A write of `size` bytes (None: not known ahead) that fails for want of space is a DataError naming `final`
    and what is free: the OS says "No space left on device" without a path, NumPy "100037 requested and 26560
    written"."""
    try:
        yield
    except OSError as error:
        free = shutil.disk_usage(final.parent).free if final.parent.is_dir() else None
        short = error.errno is None and free is not None and size is not None and free < size
        if not (error.errno == errno.ENOSPC or short):
            raise
        from spillway.layers.errors import DataError

        needs = f" ({size / 2**20:.1f} MiB)" if size is not None else ""
        raise DataError(f"cannot write {final}{needs}: no space left on its disk "
                        f"({(free or 0) / 2**20:.1f} MiB free); {DISK_FULL_ADVICE}") from None


def _temporary_sibling(final: Path) -> Path:
    # Unique per writer so concurrent writers (several hosts sharing a cache
    # directory) never write into each other's files.
    return final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def atomic_write_bytes(final: Path, data: bytes) -> None:
    """Write `data` to `final` so that `final` is either absent or complete."""
    final.parent.mkdir(parents=True, exist_ok=True)
    temporary = _temporary_sibling(final)
    try:
        with disk_full_named(final, len(data)):
            temporary.write_bytes(data)
        os.replace(temporary, final)
    finally:
        temporary.unlink(missing_ok=True)


def atomic_write_array(final: Path, array: np.ndarray) -> None:
    """Save `array` as `.npy` at `final` so that `final` is either absent or complete.

    Flushed to disk before the rename: a file that a resumed run trusts
    without re-reading must not be a renamed but still half-written one.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    temporary = _temporary_sibling(final)
    try:
        with disk_full_named(final, array.nbytes), open(temporary, "wb") as file:
            np.save(file, array)  # a file object: np.save would append ".npy" to a path
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, final)
    finally:
        temporary.unlink(missing_ok=True)


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on `path` (created if absent) for the block.

    Two preparations of the same cache entry (two jobs started on one machine)
    take turns instead of writing the same shards at once; the second then
    finds the first one's work done. The lock dies with its process, so a
    killed writer never leaves the entry locked.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield an empty temporary directory; on success it becomes `final`.

    On any exception (KeyboardInterrupt included) the temporary directory is
    removed and `final` is untouched. If another writer finished `final` first,
    its copy is kept and ours is discarded: both were built from the same key.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    temporary = _temporary_sibling(final)
    temporary.mkdir()
    try:
        yield temporary
        try:
            os.rename(temporary, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def load_cached_array(path: Path, *, mmap: bool, rebuild: Path) -> np.ndarray:
    """np.load of a cache file; one that is truncated or unreadable is a DataError naming it and the folder
    to delete so that the next run rebuilds it (never numpy's "mmap length is greater than file size")."""
    from spillway.layers.errors import DataError

    try:
        return np.load(path, mmap_mode="r" if mmap else None)
    except (ValueError, OSError, EOFError) as error:
        if isinstance(error, FileNotFoundError):
            reason = "missing"
        else:
            reason = f"damaged, e.g. truncated by a full disk or an interrupted copy ({error})"
        raise DataError(f"cache file {path} is {reason}: delete {rebuild} and run again to rebuild it "
                        f"(the corpus itself is not touched)") from None
