"""The newest readable step of a run another process may still be writing, for the commands that only read it.

`spillway generate` and `spillway export` take a run (its folder, or its
`checkpoints/` folder: the newest finalised step) or one step folder. While a
run trains, its retention (`checkpoint.keep`) deletes old steps: the step a
reader resolved may be gone before it is read. Such a step is resolved again
to the run's newest, at most `RETENTION_RETRIES` times, and never reported as
corrupt. A step named by its own folder is not replaced by another: its
removal is said in one line.

A corrupt newest step is passed over for the one before it, with a warning,
only where the caller gives a `warn` (generate: sampling an older step of the
run is what a user asks of it). Export passes none: it records which step it
wrote, and an export of an older step than the user meant, said only in a
warning line, would be a silent mistake; it refuses in one line instead.
"""

from __future__ import annotations

import json
from pathlib import Path

from spillway.layers.errors import ConfigError
from spillway.recipes.config import Recipe

RETENTION_RETRIES = 3


def saved_recipe(step_dir) -> Recipe:
    """The recipe a step was saved with. Its JSON damaged is a CorruptCheckpointError naming the file and place
    (the step before it is read instead, as for a damaged array); JSON this version cannot read as a recipe is
    a ConfigError naming the file (every step of that run would say the same, as `train` says it)."""
    from spillway.recipes.train.checkpoint import RECIPE, RECIPE_FILENAME, CorruptCheckpointError, read_recipe_json

    text = read_recipe_json(step_dir)
    where = Path(step_dir) / RECIPE / RECIPE_FILENAME
    try:
        tree = json.loads(text)
    except json.JSONDecodeError as error:
        raise CorruptCheckpointError(f"{where}: not valid JSON (line {error.lineno}, column {error.colno}: "
                                     f"{error.msg}), the step is corrupt") from None
    from spillway.recipes.blocks import ModuleNotHere, where_the_block_is_needed

    try:
        return Recipe.from_dict(tree)
    except ModuleNotHere as error:
        raise ConfigError(where_the_block_is_needed(where, error)) from None
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{where}: the saved recipe cannot be read by this version of spillway ({error}); "
                          f"read it with the version that wrote it") from None


def restore_readable(path, step_dir, target_of, warn=None, with_base: bool = True):
    """(step folder, recipe, params) of the newest readable step `path` names, starting from `step_dir` (its
    resolution); `target_of(recipe)` gives the abstract target to restore into (module docstring);
    `with_base=False`: a LoRA run's base weights are left abstract (lora_state.restore_run_params)."""
    from spillway.recipes.train.checkpoint import (CheckpointError, CorruptCheckpointError, finalised_step_dirs,
                                                   resolve_step_dir)
    from spillway.recipes.train.lora_state import base_where_the_run_went, restore_run_params   # LoRA: base + adapters

    explicit = Path(path).absolute() == Path(step_dir)
    retries = 0
    while True:
        try:
            recipe = base_where_the_run_went(saved_recipe(step_dir), step_dir)   # the project tree moved
            return step_dir, recipe, restore_run_params(step_dir, recipe, target_of(recipe), with_base)
        except CheckpointError as error:
            if not Path(step_dir).exists():   # deleted under us: a live run's retention, not damage
                if explicit:
                    raise CheckpointError(f"{step_dir}: removed while it was being read (the run writing it keeps "
                                          f"only its newest checkpoint.keep steps); pass a newer step or the run "
                                          f"directory") from None
                retries += 1
                if retries > RETENTION_RETRIES:
                    raise
                step_dir = resolve_step_dir(path)
                continue
            if warn is None and not explicit and isinstance(error, CorruptCheckpointError):
                # export stops at a damaged newest step rather than take another: it names the ones to pass
                from etils import epath

                from spillway.recipes.train.checkpoint_restore import _with_older_steps_hint
                raise _with_older_steps_hint(error, epath.Path(Path(path).absolute()),
                                             epath.Path(step_dir)) from error
            if warn is None or explicit or not isinstance(error, CorruptCheckpointError):
                raise
            older = [d for d in finalised_step_dirs(Path(step_dir).parent) if int(d.name) < int(Path(step_dir).name)]
            if not older:
                raise
            warn(f"warning: {step_dir} is corrupt, using the step before it ({older[-1]}): {error}")
            step_dir = older[-1]
