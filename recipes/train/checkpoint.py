"""Checkpoints for a training run: glue between the train loop and orbax's CheckpointManager.

A checkpoint directory (`<run>/checkpoints` in a training run, written here as
<ckpt>) holds one folder per finalised step, in orbax's layout:

    <ckpt>/<step>/params/               parameter tree (orbax StandardSave: OCDBT + tensorstore)
    <ckpt>/<step>/opt_state/            optimizer state tree (host-resident leaves included)
    <ckpt>/<step>/loader_state/metadata JSON: where the data loader resumes
    <ckpt>/<step>/meta/metadata         JSON: step, seed, tokens seen, ...
    <ckpt>/<step>/recipe/recipe.json    the resolved recipe, verbatim: `cat` it
    <ckpt>/<step>.<reason>/             a step set aside (corrupt, diverged, abandoned): orbax ignores it
    <ckpt>/.deleting/<step>/            an old step retention is removing (recipes/train/deleted_steps.py)

Orbax does the hard parts and this file leans on them:

* async saves: `save()` returns once the arrays are copied off the accelerator;
  tensorstore writes them in a background thread while training goes on.
  That copies everything saved into host memory; where the host cannot hold
  it, `save_in_pieces` writes each array from where it lies, a chunk at a
  time, in the same format (recipes/train/checkpoint_io.py).
* atomic finalisation: a step is written into `<step>.orbax-checkpoint-tmp`
  and renamed to `<step>` when every item is committed. Orbax's step discovery
  only lists finalised names, so a process killed mid-save (SIGKILL, OOM, node
  loss) leaves the previous step as the latest; the stale tmp folder is deleted
  the next time a `RunCheckpointer` opens the directory, before the constructor
  returns (here, not by orbax's `cleanup_tmp_directories`, whose background
  thread only a save joins: opened and closed unsaved, a manager left it
  deleting in the directory after `close()`).
* keep-last-K garbage collection (orbax's `LatestN`), and the steps a LoRA run stands on kept beside them
  (recipes/train/base_pins.py).
* restoring into target shardings: every array is read into the sharding
  (mesh, spec, memory kind) of the abstract target, so a run saved on one
  mesh restores onto another, and state saved from `pinned_host` memory comes
  back there (or onto the device) as the target says. Orbax reads a whole
  shard into NumPy first; here each array is read a piece at a time straight
  into its target, LayerHalves' halves included (recipes/train/checkpoint_read.py).

What this file adds is the run's policy and the failure reporting (its parts: checkpoint_items.py the item
names, errors and handlers; checkpoint_dirs.py run and step folders; checkpoint_restore.py reading a step
folder, checked against the target):

* which steps to save (`step % every_steps == 0`, or forced), never re-saving a
  step, never saving a step older than the newest one (resume would skip it);
* a directory that cannot be written fails when the RunCheckpointer opens, before
  any training, not at the first save;
* one exception type, `CheckpointError` (a `RunError`: one line, printed by the
  command line without a traceback), carrying the path and what is wrong, for
  every failure a user can cause: no checkpoint, a corrupt one
  (`CorruptCheckpointError`), one whose parameter tree does not match the model
  (`CheckpointMismatchError`, checked against the checkpoint's own metadata
  before any array is read, naming keys and both shapes), a JSON field that is
  not JSON, an async save that failed in the background (`raise_if_save_failed`
  polls for it at every step, so the run stops at the failing save);
* setting a step aside (`set_aside`: `<step>` renamed `<step>.<reason>`, which
  orbax no longer lists) when it is corrupt, diverged, or abandoned by a resume
  from an earlier step, so that the run can save that step number again;
* a run directory, its `checkpoints/` folder or one step folder are all accepted
  wherever a checkpoint is read (`resolve_step_dir`).

Which step to resume from, and whether its recipe matches, is decided by
recipes/train/resume.py. Preemption (SIGTERM, SIGINT) is the train loop's: it
sets a flag and saves at the next step boundary (recipes/train/preemption.py),
never in the middle of a step or of a save here.

dtypes are not compared: orbax casts to the target's dtype on restore, which is
what a fine-tune that loads fp32 weights into bf16 wants.

Multi-host: every process must call `save`, `restore` and `wait` (orbax
synchronises them); JSON items and the recipe are written by process 0 only.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time

import jax
import orbax.checkpoint as ocp
from etils import epath

from spillway.recipes.train.checkpoint_dirs import (_STEP_NAMES, _absolute, _check_writable, _sync_processes,
                                                    checkpoint_dir_of, finalised_step_dirs, resolve_step_dir,
                                                    run_dir_of)
from spillway.recipes.train.checkpoint_io import PieceWiseSave, as_pieces, chunked, joined, settle_writes
from spillway.recipes.train.checkpoint_items import (CHECKPOINTS_DIRNAME, LOADER_STATE, META, OPT_STATE,
                                                     PARAMS, RECIPE, RECIPE_FILENAME, CheckpointError,
                                                     CheckpointMismatchError, CorruptCheckpointError,
                                                     _cause, _item_handlers, _TextFileHandler, _TextRestore,
                                                     _TextSave)
from spillway.recipes.train.deleted_steps import DELETING_DIRNAME, Reclaimer, remove_now
from spillway.recipes.train.row_pieces import from_pieces
from spillway.recipes.train.checkpoint_restore import (_as_restore_target, _restore_step_dir,
                                                       read_recipe_json, restore_params_only)

# The module the rest of the project imports checkpoints from: its parts live in checkpoint_items (names,
# errors, handlers), checkpoint_dirs (run and step folders), checkpoint_restore (reading a step folder),
# checkpoint_io and checkpoint_read (arrays written and read in pieces).
__all__ = ["CHECKPOINTS_DIRNAME", "LOADER_STATE", "META", "OPT_STATE", "PARAMS", "RECIPE", "RECIPE_FILENAME",
           "CheckpointError", "CheckpointMismatchError", "CorruptCheckpointError", "RunCheckpointer",
           "checkpoint_dir_of", "finalised_step_dirs", "read_recipe_json", "resolve_step_dir",
           "restore_params_only", "run_dir_of"]


def _json_text(value, what: str) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what} must be JSON-serialisable (it is saved as JSON): {e}") from e


# -- the run's checkpointer ---------------------------------------------------------------------

_SAVE_POLL_S = 0.02   # how often `wait` looks whether the save in flight has finished


class RunCheckpointer:
    """Saves and restores one training run in `directory`.

    `keep`: how many of the newest steps to keep on disk. `every_steps`: the
    save period used by `should_save` / `save`. `async_save`: write in a
    background thread (errors surface at `raise_if_save_failed`, which the train
    loop calls every step, or at the next `save`, `wait` or `close`).
    `save_in_pieces` (settable later: the train loop sets it from the run's host
    memory, host_memory.check_run): `save` writes every array itself, one zarr
    chunk at a time, before it returns (checkpoint_io.py); the host holds a few
    pieces beside the state instead of orbax's copy of everything saved. The
    format is the same either way.

    Opening checks that the directory can be written (a probe file), so a
    read-only or full filesystem fails here, before any training.

    Open a RunCheckpointer only from the run that writes the directory (the
    train loop holds the run's lock, recipes/train/run_lock.py): opening one
    deletes unfinished `<step>.orbax-checkpoint-tmp` folders, which would
    include a save in progress by another job. Readers (evaluation, fine-tunes)
    use `restore_params_only` and `read_recipe_json`, which never write.
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int, every_steps: int, async_save: bool = True,
                 save_in_pieces: bool = False):
        if keep < 1:
            raise CheckpointError(f"{directory}: keep must be >= 1, got {keep}")
        if every_steps < 1:
            raise CheckpointError(f"{directory}: every_steps must be >= 1, got {every_steps}")
        self.directory = _absolute(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: exists and is not a directory")
        _check_writable(self.directory)
        from spillway.recipes.train.save_failures import quiet_orbax_error_logs
        quiet_orbax_error_logs()   # a failed save is raised as one line; orbax's tracebacks would bury it
        self.keep = keep
        self.every_steps = every_steps
        self._async_save = async_save
        self._save_in_pieces = save_in_pieces
        self._remove_unfinished_saves()
        self._reclaimer = Reclaimer(self.directory)
        self._manager = self._open_manager()
        self._step_in_flight: int | None = None
        self._failure_reported = False
        self._closed = False

    def _open_manager(self) -> ocp.CheckpointManager:
        from spillway.recipes.train.base_pins import PinnedSteps

        managers = ocp.checkpoint_managers
        options = ocp.CheckpointManagerOptions(
            # the newest `keep` steps, and any a LoRA run stands on (its base: base_pins.py)
            preservation_policy=managers.AnyPreservationPolicy([managers.LatestN(n=self.keep),
                                                                PinnedSteps(self.directory)]),
            # in pieces, the arrays are written in the caller's thread: orbax's background commit (its
            # directories made in another thread meanwhile) raced those writes, so that save is orbax's sync one
            enable_async_checkpointing=self._async_save and not self._save_in_pieces,
            step_name_format=_STEP_NAMES,
            # what a killed save left is removed by _remove_unfinished_saves, in this thread: orbax's cleanup
            # runs in a thread of its own that only its first save() joins, so a manager closed unsaved (the
            # save_in_pieces switch, a look at latest_step) left it running, deleting in this directory beside
            # the next manager's saves
            cleanup_tmp_directories=False,
            # an old step is renamed aside in one step and removed by deleted_steps.py: deleted in place, a kill
            # meanwhile left it half deleted under its step's name
            todelete_subdir=DELETING_DIRNAME,
            create=True,
        )
        try:
            return ocp.CheckpointManager(self.directory, options=options, item_handlers=_item_handlers())
        except Exception as e:
            raise CheckpointError(f"{self.directory}: cannot open the checkpoint directory: "
                                  f"{_cause(e)}") from e

    def _remove_unfinished_saves(self) -> None:
        """Deletes the `<step>.orbax-checkpoint-tmp*` folders a killed save left (they hold its space), before
        anything else reads or writes the directory; every process waits for process 0 to finish."""
        if jax.process_index() == 0:
            from spillway.recipes.train.save_failures import unfinished_saves
            for folder in (f for f in unfinished_saves(self.directory) if f.is_dir()):
                try:
                    shutil.rmtree(folder)
                except OSError as e:
                    raise CheckpointError(f"{folder}: cannot remove this unfinished save: {_cause(e)}") from e
            remove_now(self.directory)   # old steps a kill stopped removing (deleted_steps.py)
        _sync_processes("spillway-remove-unfinished-saves")

    @property
    def save_in_pieces(self) -> bool:
        return self._save_in_pieces

    @save_in_pieces.setter
    def save_in_pieces(self, in_pieces: bool) -> None:
        """Switches the save mode (the train loop, once it knows the run's host memory); waits for a save
        in flight."""
        if in_pieces == self._save_in_pieces:
            return
        self.wait()
        self._manager.close()
        self._save_in_pieces = in_pieces
        self._manager = self._open_manager()

    # -- queries

    def latest_step(self) -> int | None:
        """Newest step saved: finalised on disk, or (in this process) in flight. Unfinished saves
        left by a killed process are never reported."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def should_save(self, step: int) -> bool:
        return step % self.every_steps == 0

    def step_dir(self, step: int) -> epath.Path:
        return self.directory / _STEP_NAMES.build_name(step)

    def read_recipe_json(self, step: int) -> str:
        """The recipe saved with `step`, verbatim (cheap: no array is read)."""
        recipe_file = self.step_dir(step) / RECIPE / RECIPE_FILENAME
        try:
            return recipe_file.read_text()
        except OSError as e:
            raise CorruptCheckpointError(f"{recipe_file}: cannot read the saved recipe, the checkpoint is "
                                         f"corrupt: {_cause(e)}") from e

    # -- setting steps aside

    def set_aside(self, step: int, reason: str) -> epath.Path:
        """Renames `<step>` to `<step>.<reason>` (orbax no longer lists it) and returns the new path.

        For a step that is corrupt, diverged, or newer than the step a run resumes
        from: left in place, it would stop the run from saving that step number
        again (see `save`), and a later resume would pick it. Nothing is deleted:
        the folder stays for inspection and can be removed by hand.
        """
        self._check_open()
        self.wait()
        source = self.step_dir(step)
        target = self.directory / f"{source.name}.{reason}"
        suffix = 1
        while target.exists():  # set aside before, e.g. corrupt twice
            suffix += 1
            target = self.directory / f"{source.name}.{reason}{suffix}"
        if jax.process_index() == 0:
            try:
                source.rename(target)
            except OSError as e:
                raise CheckpointError(f"{source}: cannot set this step aside as {target.name}: {_cause(e)}") from e
        _sync_processes(f"spillway-set-aside-{step}")
        self._manager.reload()
        return target

    # -- save

    def save(self, step: int, *, params, opt_state, loader_state: dict, meta: dict, recipe_json: str,
             force: bool = False) -> None:
        """Starts saving `step` if it is due (`should_save`) or `force`; returns once the arrays are
        copied off the accelerator (async), or written (sync, or in pieces). A step already saved is not
        saved again (a SIGTERM right after the periodic save of the same step costs nothing).

        `opt_state` may hold LayerHalves (host state kept as two buffers): the step holds each as the one
        array `Optimizer.saved_form` would make, written from the halves in pieces (or joined first for
        orbax's whole save)."""
        self._check_open()
        if not (force or self.should_save(step)):
            return
        # validate the JSON parts here, in the caller's thread, rather than fail in orbax's background thread
        _json_text(loader_state, f"{self.directory}: loader_state")
        _json_text(meta, f"{self.directory}: meta")
        try:
            json.loads(recipe_json)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{self.directory}: recipe_json is not valid JSON: {e}") from e

        self.wait()  # orbax would wait for the previous save anyway; this reports its failure clearly
        latest = self.latest_step()
        if latest is not None and step == latest:
            return
        if latest is not None and step < latest:
            raise CheckpointError(
                f"{self.directory}: refusing to save step {step}: step {latest} is newer, and resuming "
                f"picks the newest step, so step {step} would be skipped (or deleted by keep={self.keep}). "
                f"Delete the newer steps or save into another directory.")
        # in pieces: every array written a chunk at a time before save returns (checkpoint_io.py); else
        # orbax's path: whole arrays staged in host memory, written in the background
        as_saved = as_pieces if self.save_in_pieces else joined
        # the whole save's chunks at most a piece too, so that a restore reads it a piece at a time
        save_args = (lambda tree: None) if self.save_in_pieces else chunked
        args = ocp.args.Composite(**{
            PARAMS: PieceWiseSave(as_saved(params), save_args=save_args(params)),
            OPT_STATE: PieceWiseSave(as_saved(opt_state), save_args=save_args(opt_state)),
            LOADER_STATE: ocp.args.JsonSave(loader_state),
            META: ocp.args.JsonSave(meta),
            RECIPE: _TextSave(recipe_json),
        })
        threads_before = set(threading.enumerate())
        try:
            # force: the decision is ours (should_save above); orbax's own policy would also
            # save the first step it sees, whatever its number
            self._manager.save(step, args=args, force=True)
        except Exception as e:
            if not self.save_in_pieces:
                raise CheckpointError(f"{self.step_dir(step)}: saving failed: {_cause(e)}") from e
            # the pieces are written here, so a full disk or a failed write surfaces now: name the intact step
            # (and remove the unfinished folder once what the save started has stopped writing into it: its
            # tensorstore writes, orbax's commit threads: save_failures.py)
            from spillway.recipes.train.save_failures import SETTLE_LIMIT_S, join_threads_started_since
            settle_writes()
            join_threads_started_since(threads_before, SETTLE_LIMIT_S)
            self._manager.reload()
            raise self._failed_save_error(step, e, what="the save in pieces") from e
        self._step_in_flight = step

    def raise_if_save_failed(self) -> None:
        """Raises CheckpointError now if the async save in flight has failed; never waits for one running.

        Called at every step boundary, so a run stops at the save that failed
        rather than at the next one, `every_steps` later. Orbax keeps a failure
        in its finalize thread until someone joins it: once the save is no
        longer in progress, `wait` joins it at once and reports the failure.
        """
        if self._step_in_flight is None or self._manager.is_saving_in_progress():
            return
        self.wait()

    def _failed_save_error(self, step: int | None, e: BaseException, what: str = "the async save") -> CheckpointError:
        self._failure_reported = True
        where = self.step_dir(step) if step is not None else self.directory
        previous = self.latest_step()  # orbax has dropped the failed step by now
        if previous == step:
            previous = None
        intact = f"step {previous} is intact" if previous is not None else "no earlier checkpoint exists"
        from spillway.recipes.train.save_failures import remove_unfinished
        left = remove_unfinished(self.directory, step)
        full = "No space left on device" in str(e) or getattr(e, "errno", None) == errno.ENOSPC
        if full:
            resume = f"a rerun resumes from step {previous}" if previous is not None else "a rerun starts over"
            return CheckpointError(f"{where}: {what} failed and was not finalised ({intact}): No space "
                                   f"left on device in {self.directory}; {left}; free space there and {resume}")
        return CheckpointError(f"{where}: {what} failed and was not finalised ({intact}): {_cause(e)}; "
                               f"{left}")

    def wait(self) -> None:
        """Blocks until the async save in flight (if any) is finalised; raises CheckpointError if it failed."""
        step = self._step_in_flight
        self._step_in_flight = None
        try:
            # Polled before orbax joins its thread: a Ctrl-C that interrupts Thread.join (Python 3.11, 3.12) marks
            # the thread finished while it still commits, and close() then waited for nothing and the command left
            # mid-save (the step it deleted half deleted, the step it saved never finalised). In a sleep it does not.
            # (Only for a save this object started: orbax leaves the flag set after a synchronous save that failed.)
            while step is not None and self._manager.is_saving_in_progress():
                time.sleep(_SAVE_POLL_S)
            self._manager.wait_until_finished()
        except Exception as e:
            raise self._failed_save_error(step, e) from e
        self._reclaimer.start()   # the steps that save's retention moved aside

    # -- restore

    def restore(self, step: int | None = None, *, abstract_params, abstract_opt_state) -> dict:
        """Restores `step` (default: the latest) into the shardings of the abstract targets.

        Every array is read a piece at a time straight into its target (checkpoint_read.py). A target may
        hold LayerHalves or ResidentSplits (e.g. `Optimizer.abstract_state`): the saved leaf is read into
        their parts, and they come back in that form.
        Returns {"params", "opt_state", "loader_state", "meta", "recipe_json"}.
        """
        self._check_open()
        params_form, opt_state_form = abstract_params, abstract_opt_state
        abstract_params = _as_restore_target(abstract_params, "abstract_params")
        abstract_opt_state = _as_restore_target(abstract_opt_state, "abstract_opt_state")
        self.wait()  # a step in flight is not readable until finalised
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointError(f"{self.directory}: no checkpoint found")
            step = steps[-1]
        elif step not in steps:
            raise CheckpointError(f"{self.step_dir(step)}: no checkpoint for step {step} "
                                  f"(steps present: {steps or 'none'})")
        items = _restore_step_dir(
            self.step_dir(step),
            {PARAMS: abstract_params, OPT_STATE: abstract_opt_state},
            {LOADER_STATE: ocp.args.JsonRestore(), META: ocp.args.JsonRestore(), RECIPE: _TextRestore()},
        )
        return {
            "params": from_pieces(params_form, items[PARAMS]),
            "opt_state": from_pieces(opt_state_form, items[OPT_STATE]),
            "loader_state": items[LOADER_STATE],
            "meta": items[META],
            "recipe_json": items[RECIPE],
        }

    # -- shutdown

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"{self.directory}: this RunCheckpointer is closed")

    def close(self) -> None:
        """Waits for the save in flight and closes orbax."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
            self._reclaimer.join()
            remove_now(self.directory)   # no save runs now: what is left, and the folder, go
        finally:
            try:
                self._manager.close()
            except Exception as e:
                # orbax raises a failed save once more from close() when its failure reached the manager before
                # the commit thread's (a full disk fails both): the run already stopped on it, in one line, and
                # that line, naming the intact step, is the error to see, not orbax's repeat of it
                if not self._failure_reported:
                    raise self._failed_save_error(None, e) from e

    def __enter__(self) -> RunCheckpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
