"""Checkpoint items and errors: the item names a step folder holds, their orbax handlers, the recipe stored as a
plain file, and the one exception type every checkpoint failure a user can cause raises (recipes/train/checkpoint.py
says how a step folder is laid out)."""

from __future__ import annotations

import dataclasses

import jax
import orbax.checkpoint as ocp
from etils import epath

from spillway.recipes.train.checkpoint_io import PieceWiseCheckpointHandler
from spillway.recipes.train.errors import RunError
from spillway.recipes.train.host_memory import RESTORE_CONCURRENT_GB   # orbax's own reads, at most at once

PARAMS = "params"
OPT_STATE = "opt_state"
LOADER_STATE = "loader_state"
META = "meta"
RECIPE = "recipe"
RECIPE_FILENAME = "recipe.json"
CHECKPOINTS_DIRNAME = "checkpoints"  # <run>/checkpoints holds the step folders of a training run

_ARRAY_ITEMS = (PARAMS, OPT_STATE)
_JSON_ITEMS = (LOADER_STATE, META)
_MAX_CAUSE_CHARS = 400


class CheckpointError(RunError):
    """A checkpoint could not be saved or restored; the message names the path and the reason."""


class CorruptCheckpointError(CheckpointError):
    """A step folder is damaged (truncated or missing files, unreadable metadata): other steps may be intact."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint's parameter tree differs from the model's: a configuration problem, not damage."""


def _cause(e: BaseException) -> str:
    """The exception in one readable line: tensorstore errors embed a full JSON spec, kept in the
    chained traceback (`raise ... from e`) but not in our message."""
    text = " ".join(str(e).split())
    if len(text) > _MAX_CAUSE_CHARS:
        text = text[:_MAX_CAUSE_CHARS] + " ..."
    return f"{type(e).__name__}: {text}"


# -- the recipe as a plain file -------------------------------------------------------------
#
# orbax's JsonCheckpointHandler re-serialises whatever it is given; the recipe arrives
# already serialised (the recipe module chose its formatting), so it is stored verbatim
# and read back byte for byte.


def _write_text(path: epath.Path, text: str) -> None:
    path.write_text(text)


class _TextFileHandler(ocp.AsyncCheckpointHandler):
    """Stores one string as `<item dir>/<filename>`; written by process 0 in the background commit."""

    def __init__(self, filename: str):
        self._filename = filename

    async def async_save(self, directory: epath.Path, args: _TextSave):
        async def write():
            if jax.process_index() == 0:
                _write_text(directory / self._filename, args.text)

        # the item directory may still be being created; this future waits for orbax's signal
        return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="recipe_text_save")]

    def save(self, directory: epath.Path, args: _TextSave):
        if jax.process_index() == 0:
            _write_text(directory / self._filename, args.text)

    def restore(self, directory: epath.Path, args: _TextRestore | None = None) -> str:
        return (directory / self._filename).read_text()


@ocp.args.register_with_handler(_TextFileHandler, for_save=True)
@dataclasses.dataclass
class _TextSave(ocp.args.CheckpointArgs):
    text: str


@ocp.args.register_with_handler(_TextFileHandler, for_restore=True)
@dataclasses.dataclass
class _TextRestore(ocp.args.CheckpointArgs):
    pass


def _item_handlers() -> dict[str, ocp.CheckpointHandler]:
    handlers: dict[str, ocp.CheckpointHandler] = {
        name: PieceWiseCheckpointHandler(restore_concurrent_gb=RESTORE_CONCURRENT_GB) for name in _ARRAY_ITEMS}
    handlers.update({name: ocp.JsonCheckpointHandler() for name in _JSON_ITEMS})
    handlers[RECIPE] = _TextFileHandler(RECIPE_FILENAME)
    return handlers
