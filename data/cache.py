"""Cache keys and crash-safe writes for the data cache (tokenizers, packed tokens).

Every cached artifact is named by a hash of everything that determines its
content, so a changed input is a cache miss rather than a stale hit. Artifacts
are written under a temporary name in the same directory and renamed into place
only once complete: `rename` is atomic on one filesystem, so a reader (or a run
restarted after a crash) sees either the whole artifact or nothing, never half.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path


def stable_key(*parts: object) -> str:
    """A hex SHA-256 of JSON-serialisable parts; equal inputs give equal keys across runs."""
    blob = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _temporary_sibling(final: Path) -> Path:
    # Unique per writer so concurrent writers (several hosts sharing a cache
    # directory) never write into each other's files.
    return final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def atomic_write_bytes(final: Path, data: bytes) -> None:
    """Write `data` to `final` so that `final` is either absent or complete."""
    final.parent.mkdir(parents=True, exist_ok=True)
    temporary = _temporary_sibling(final)
    try:
        temporary.write_bytes(data)
        os.replace(temporary, final)
    finally:
        temporary.unlink(missing_ok=True)


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
