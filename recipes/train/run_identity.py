"""A run's identity, kept in its folder: what an export folder records of the run that wrote it.

An export folder may be replaced only by a later export of the same run (recipes/export.py). Named by the run's
path, a run moved or copied elsewhere (another disk, the project tree relocated) was "another run" for its own
earlier export. A random id written into `RUN_DIR/run_id` when the run first trains goes with the folder
instead; a run from before it has none and is known by its path, as before.
"""

from __future__ import annotations

import secrets
from pathlib import Path

RUN_ID_FILE = "run_id"


def run_identity(run_dir: Path) -> str | None:
    """The id kept in `run_dir`, or None (a run from before ids were kept, a step folder outside any run)."""
    try:
        kept = (Path(run_dir) / RUN_ID_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return kept if len(kept) == 32 and all(c in "0123456789abcdef" for c in kept) else None


def keep_run_identity(run_dir: Path) -> str:
    """The run's id, written once (atomically: a kill leaves none or the whole id) when it has none."""
    from spillway.data.cache import atomic_write_bytes

    kept = run_identity(run_dir)
    if kept is None:
        kept = secrets.token_hex(16)
        atomic_write_bytes(Path(run_dir) / RUN_ID_FILE, (kept + "\n").encode())
    return kept
