"""`spillway prepare RECIPE`: a run's data prepared ahead of it, so a large corpus is tokenized once before the
GPUs are taken.

It runs the train loop's checks that need no run directory (recipes/train/loop.py `run_checks`), then the
loop's data phase (recipes/train/run_data.py), and nothing else: no model, no run folder written. The rows
land in the cache the run reads (data.cache_dir, keyed by the source, the tokenizer's fingerprint and every
setting that shapes a row), so the run that follows says "cached". A run already started is refused: it
tokenizes with its own copy of the tokenizer, and its resume prepares its own rows.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from spillway.recipes.config import Recipe
from spillway.recipes.train.errors import RunError
from spillway.recipes.train.run_data import prepare_run_data


class RunAlreadyStartedError(RunError):
    """`spillway prepare` on a recipe whose run folder already holds checkpoints."""


def prepare_ahead(recipe: Recipe, *, echo=print):
    """(tokenizer, data_pipeline.TrainingData) of a run of `recipe` not started yet, prepared into the cache it
    will read; the run folder is neither made nor written."""
    from spillway.recipes.train.checkpoint import CHECKPOINTS_DIRNAME, finalised_step_dirs
    from spillway.recipes.train.finetune import with_source_tokenizer
    from spillway.recipes.train.init_weights import hf_checkpoint_dir
    from spillway.recipes.train.loop import run_checks

    recipe, _, say = run_checks(recipe, echo, host_ram_gb=None)
    checkpoints = Path(recipe.run_dir) / CHECKPOINTS_DIRNAME
    if checkpoints.is_dir() and finalised_step_dirs(checkpoints):
        # with train.resume=false too: `spillway train` then refuses a folder that holds steps (resume.py)
        raise RunAlreadyStartedError(
            f"{recipe.run_dir} holds a run that has started (checkpoints in {checkpoints}): its data was prepared "
            f"when it started, with its own copy of the tokenizer, and `spillway train` resumes it; to prepare "
            f"the data of a new run, set checkpoint.dir to a folder without one (or delete its steps to start "
            f"over there)")
    _refuse_a_live_run(Path(recipe.run_dir))
    with tempfile.TemporaryDirectory(prefix="spillway-prepare-") as scratch:
        init_from = recipe.checkpoint.init_from
        if init_from and hf_checkpoint_dir(init_from) is None:
            # a fine-tune from a spillway run tokenizes with that run's tokenizer (and its BOS rule): the run
            # copies it into its folder, this copies it into a scratch folder that goes when the rows are ready
            recipe = with_source_tokenizer(recipe, Path(scratch), resuming=False, say=lambda line: None)
            say(f"fine-tune: tokenizing with the tokenizer of {init_from}")
        tokenizer, data = prepare_run_data(recipe, None, None, say)
    say(f"ready: `spillway train` of this recipe (the same --set) reads these rows from {recipe.data.cache_path}")
    return tokenizer, data


def _refuse_a_live_run(run_dir: Path) -> None:
    """A run training in the folder now (its lock's owner alive), before its first checkpoint: it is preparing
    (or has prepared) its own rows, with its own copy of the tokenizer; this would only say "ready"."""
    from spillway.recipes.train.run_lock import live_owner

    owner = live_owner(run_dir)
    if owner is not None:
        raise RunAlreadyStartedError(f"{run_dir} holds a run training now ({owner.describe()}): it prepares its own "
                                     f"data; to prepare the data of a new run, set checkpoint.dir to another folder")
