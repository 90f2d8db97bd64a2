"""A run's identity, kept in its folder: what an export folder records of the run that wrote it.

An export folder may be replaced only by a later export of the same run (recipes/export.py). Named by the run's
path, a run moved elsewhere (another disk, the project tree relocated) was "another run" for its own earlier
export. A random id written into `RUN_DIR/run_id` when the run first trains goes with the folder instead, beside
the folder it was written in. A copy (`cp -r`) carries the same file: where that folder still holds a run with the
same id, this one is a copy, and it has no identity of its own until it trains (then it is given a new id), so
its exports never replace the original's. A run from before ids were kept has none and is known by its path.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

RUN_ID_FILE = "run_id"


def _kept(run_dir: Path) -> tuple[str, str] | None:
    """(id, the folder it was written in) from `run_dir`'s file, or None."""
    try:
        kept = json.loads((Path(run_dir) / RUN_ID_FILE).read_text())
        run_id, folder = kept["id"], kept["folder"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (isinstance(run_id, str) and len(run_id) == 32 and isinstance(folder, str)):
        return None
    return run_id, folder


def _a_copy(run_dir: Path, run_id: str, folder: str) -> bool:
    """Whether the run whose id was written in `folder` is still there, so that `run_dir` is a copy of it."""
    there = Path(folder).resolve()
    if there == Path(run_dir).resolve():
        return False
    original = _kept(there)
    return original is not None and original[0] == run_id


def run_identity(run_dir: Path) -> str | None:
    """The id kept in `run_dir`: None for a run from before ids were kept, a step folder outside any run, or a
    copy of a run that is still where it was (module docstring)."""
    kept = _kept(run_dir)
    if kept is None or _a_copy(run_dir, *kept):
        return None
    return kept[0]


def keep_run_identity(run_dir: Path) -> str:
    """The run's id, written (atomically: a kill leaves the old file or the new) when it has none, when it is a
    copy (a new id), and when it was moved (the same id, its new folder)."""
    from spillway.data.cache import atomic_write_bytes

    here = str(Path(run_dir).resolve())
    kept = _kept(run_dir)
    run_id = kept[0] if kept is not None and not _a_copy(run_dir, *kept) else secrets.token_hex(16)
    if kept != (run_id, here):
        atomic_write_bytes(Path(run_dir) / RUN_ID_FILE, (json.dumps({"id": run_id, "folder": here}) + "\n").encode())
    return run_id
