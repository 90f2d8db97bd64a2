"""Steps that retention (checkpoint.keep) deletes: moved aside in one rename, then removed in the background.

Orbax deleted an old step in place, file by file: a process killed meanwhile (SIGKILL, the OOM killer, a node
lost) left `<ckpt>/<step>` half deleted under its step's name, listed as a step with files missing. Here orbax
renames it into `<ckpt>/.deleting/<step>` instead (its `todelete_subdir`; a rename is atomic, and orbax lists
no name that is not a step number), and `Reclaimer` removes what that folder holds in a thread of its own, as
orbax's deletion ran beside the training. What a kill leaves there is removed when a RunCheckpointer next opens
the directory (`remove_now`). Process 0 alone: orbax renames on the primary host only.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
from pathlib import Path

import jax

DELETING_DIRNAME = ".deleting"   # in the checkpoint directory: the steps being removed


def remove_now(directory: Path) -> None:
    """Removes every step left in `directory`/.deleting (a kill stopped its removal), then that folder, in this
    thread: where no save runs (a RunCheckpointer opening, or closing after its last save)."""
    if jax.process_index() != 0:
        return
    _remove(_deleted(directory))
    with contextlib.suppress(OSError):   # absent, or holding what could not be removed
        (Path(directory) / DELETING_DIRNAME).rmdir()


def _deleted(directory: Path) -> list[Path]:
    folder = Path(directory) / DELETING_DIRNAME
    return sorted(folder.iterdir()) if jax.process_index() == 0 and folder.is_dir() else []


def _remove(steps: list[Path]) -> None:
    # .deleting itself stays while the run saves: removed between orbax's making it and its rename into it,
    # that rename (a step's deletion) would fail
    for step in steps:
        shutil.rmtree(step, ignore_errors=True)   # a file that cannot go now is tried again at the next open


class Reclaimer:
    """Removes the steps orbax moved into .deleting, in a daemon thread, one removal at a time."""

    def __init__(self, directory: Path):
        self._directory = directory
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Removes what .deleting holds now, in the background; nothing if a removal is still running (what it
        did not list is removed by the next start, or the next open)."""
        if self._thread is not None and self._thread.is_alive():
            return
        steps = _deleted(self._directory)
        if steps:
            self._thread = threading.Thread(target=_remove, args=(steps,),
                                            name="spillway-remove-deleted-steps", daemon=True)
            self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
