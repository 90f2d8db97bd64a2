"""What a resumed run may change, and the run's history of changes (`<run>/history.jsonl`).

A run resumed with another model shape, data, tokenizer or data order would
silently continue a different run from the saved weights and data position.
`compare_recipes` holds the recipe a run resumes with against the recipe saved
with the step it resumes from, field by field:

* fields that define the run must match: the model family and architecture,
  the block class, the execution dtypes, the data (source, text field,
  tokenizer, sequence length, validation split, token cap), the data order
  seed (`train.seed`) and global batch (the saved loader position counts
  global batches), and the optimizer state's layout (`optimizer.master_weights`;
  the optimizer itself is always AdamW). The first difference is an error
  naming the field, the saved value and the new one.
* fields that a person changes on purpose when continuing a run may change:
  the step count, learning rate, schedule and other optimizer hyperparameters,
  logging, evaluation, sampling, checkpoint cadence, the mesh and the offload
  plan (they change where numbers live, not the numbers), the attention kernel,
  the auxiliary-loss coefficients (`aux_loss`). Each change is returned, and the train loop records it in history.jsonl.
  One that moves the learning rate at the resumed step (a longer train.steps stretches the schedule) is said
  with that rate before and after (`learning_rate_change`).

Fields are matched by their dotted path, most specific rule first; a field no
rule names (one added to the recipe later) must match until someone decides
it is safe to change, so a new field can never make a resume silently mix
runs.

Which step a run resumes from (`steps_to_try`, `restore_for_resume`): the
newest step, or exactly `train.resume_step`. A newest step that is corrupt
(truncated or deleted files) or whose weights are diverged (checked on device,
recipes/train/divergence.py) is set aside with a warning naming it, and the
next older one is tried; with `train.resume_step` there is no fallback, and
the steps newer than it are set aside (`<step>.abandoned`). Setting aside
renames, never deletes (recipes/train/checkpoint.py `set_aside`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spillway.data.loader import DamagedLoaderState
from spillway.recipes.config import Recipe
from spillway.recipes.optim.schedule import make_schedule
from spillway.recipes.train import distributed
from spillway.recipes.train.checkpoint import CheckpointError, CorruptCheckpointError, RunCheckpointer
from spillway.recipes.train.checkpoint_dirs import finalised_step_dirs
from spillway.recipes.train.checkpoint_restore import check_meta_names_its_step
from spillway.recipes.train.checkpoint_items import CHECKPOINTS_DIRNAME
from spillway.recipes.train.errors import RunError
from spillway.recipes.train.metrics import NonFiniteLossError

HISTORY_FILENAME = "history.jsonl"

# The fields the learning-rate schedule is made of (recipes/optim/schedule.py; its length is train.steps).
_SCHEDULE_FIELDS = ("optimizer.learning_rate", "optimizer.warmup_steps", "optimizer.min_lr_ratio", "train.steps")

MUST_MATCH = "must match"
MAY_CHANGE = "may change"

# dotted path prefix -> rule; the longest matching prefix decides
RESUME_RULES: dict[str, str] = {
    "name": MAY_CHANGE,
    "description": MAY_CHANGE,
    "sources": MAY_CHANGE,
    "family": MUST_MATCH,
    "model": MUST_MATCH,
    "block": MUST_MATCH,
    "execution": MUST_MATCH,
    "execution.attention_impl": MAY_CHANGE,       # same maths, another kernel
    "execution.flash_block_size": MAY_CHANGE,
    "execution.init_std": MAY_CHANGE,             # used only to initialise, never on resume
    "data": MUST_MATCH,
    "data.cache_dir": MAY_CHANGE,                 # where tokenized data is cached, not what it is
    "data.num_proc": MAY_CHANGE,
    "data.tokenizer_origin": MAY_CHANGE,          # only named in a message when the tokenizer file is missing
    "optimizer": MAY_CHANGE,
    "optimizer.master_weights": MUST_MATCH,       # decides the optimizer state's tree
    "offload": MAY_CHANGE,
    "mesh": MAY_CHANGE,
    "checkpoint": MAY_CHANGE,
    "train": MAY_CHANGE,
    "train.seed": MUST_MATCH,                     # the data order
    "train.global_batch": MUST_MATCH,             # the loader position counts global batches
    "aux_loss": MAY_CHANGE,                       # loss coefficients, like the learning rate
}


class RecipeMismatchError(RunError):
    """The recipe a run resumes with changes a field that defines the run."""


def resume_rule(path: str) -> str:
    """MUST_MATCH or MAY_CHANGE for a dotted field path; unknown fields must match."""
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        rule = RESUME_RULES.get(".".join(parts[:end]))
        if rule is not None:
            return rule
    return MUST_MATCH


def _same_tokenizer_file(before: Any, after: Any, new: dict) -> bool:
    """Two tokenizer paths name the same tokenizer if both files hold the same bytes (a run directory moved
    or reached by another path keeps its tokenizer.model). Where the saved one is gone (a fine-tune's base
    moved, named by its new place), the run's own copy of it stands in: the tokenizer a resumed run reads."""
    from spillway.data import tokenizer_file_in

    if not (isinstance(before, str) and isinstance(after, str)):
        return False

    def file_of(path: str | os.PathLike) -> Path:   # a folder names the tokenizer file it holds
        given = Path(path).expanduser()
        return (tokenizer_file_in(given) or given) if given.is_dir() else given

    saved = file_of(before)
    if not saved.exists():
        saved = file_of(Recipe.from_dict(new).run_dir)
    try:
        return saved.read_bytes() == file_of(after).read_bytes()
    except OSError:
        return False


def _normalised_mixture(text: str) -> list[tuple[str, str, float]]:
    """(name, source, share of the weight) of each source of a data.mixture text, in its order."""
    from spillway.data import parse_mixture

    components = parse_mixture(text)
    total = sum(c.weight for c in components)
    return [(c.name, c.source, c.weight / total) for c in components]


def _same_mixture(before: Any, after: Any, _new: dict) -> bool:
    """Two data.mixture texts name the same mixture if they parse to the same sources, names and order, with
    weights equal once normalised (a space added, 7:3 for 0.7:0.3): the loader draws the same batches. The
    order stays part of it (the loader breaks ties between sources in that order)."""
    try:
        return (isinstance(before, str) and isinstance(after, str)
                and _normalised_mixture(before) == _normalised_mixture(after))
    except ValueError:
        return False


def _same_corpus_moved(before: Any, after: Any, new: dict) -> bool:
    """A data.source (or a mixture's sources) named at another place holds the same corpus where the run's record
    of it (corpus.json) matches the files there file for file: the project moved with its data."""
    from spillway.recipes.train.corpus_record import corpus_moved_with_the_run

    try:
        return isinstance(before, str) and isinstance(after, str) and corpus_moved_with_the_run(Recipe.from_dict(new))
    except (ValueError, TypeError):
        return False


def _same_mixture_moved(before: Any, after: Any, new: dict) -> bool:
    """A mixture of the same names and weights, in the same order, whose sources moved with the project."""
    def weighted(text):
        return [(name, share) for name, _, share in _normalised_mixture(text)]
    try:
        return (isinstance(before, str) and isinstance(after, str) and weighted(before) == weighted(after)
                and _same_corpus_moved(before, after, new))
    except ValueError:
        return False


def _same_lora_targets(before: Any, after: Any, new: dict) -> bool:
    """Two lora.targets name the same adapters where they resolve to the same projections of the run's model:
    another order, a module's whole name for its last part, or GPT-2's c_attn for the default (q_proj, v_proj)
    that PEFT's rule turns into it (recipes/lora_targets.py)."""
    from spillway.layers.errors import ConfigError

    if not (isinstance(before, list) and isinstance(after, list)):
        return False
    try:
        recipe = Recipe.from_dict(new)
        if not recipe.lora.enabled:
            return True   # no adapters either way (a change of lora.rank is refused on its own)
        adapting = lambda targets: dataclasses.replace(  # noqa: E731
            recipe, lora=dataclasses.replace(recipe.lora, targets=tuple(targets))).lora_spec()
        return adapting(before) == adapting(after)
    except (ConfigError, ValueError, TypeError):   # a saved target this model lacks: not the same adapters
        return False


def _lora_off(before: Any, after: Any, new: dict) -> bool:
    """lora.alpha and lora.dropout change nothing with lora.rank 0 (a change of the rank is refused on its own)."""
    return not ((new.get("lora") or {}).get("rank") or 0)


# fields whose saved and new values may differ as text and still mean the same thing
_EQUIVALENT = {"data.tokenizer": _same_tokenizer_file, "data.source": _same_corpus_moved,
               "data.mixture": lambda *args: _same_mixture(*args) or _same_mixture_moved(*args),
               "lora.targets": _same_lora_targets, "lora.alpha": _lora_off, "lora.dropout": _lora_off}


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"model.d_model": 32, ...}: nested dicts flattened; lists and scalars are leaves."""
    if isinstance(tree, dict) and tree:
        flat = {}
        for key, value in tree.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: tree}


def _as_json_values(recipe_dict: dict) -> dict:
    # tuples and lists, ints and floats compare as they are saved
    return json.loads(json.dumps(recipe_dict))


def compare_recipes(saved: dict, new: dict, *, where: str) -> dict[str, list]:
    """Fields that differ between the saved recipe and the new one, as {path: [saved, new]}.

    Both are `Recipe.to_dict()` forms. Raises RecipeMismatchError at the first
    field (in recipe order) that must match; `where` (the step folder) leads the
    message.
    """
    _check_init_from_not_added(saved, new, where)
    saved_flat = _flatten(_as_json_values(saved))
    new_flat = _flatten(_as_json_values(new))
    missing = object()
    changed: dict[str, list] = {}
    refused: list[str] = []
    for path in list(new_flat) + [p for p in saved_flat if p not in new_flat]:
        before, after = saved_flat.get(path, missing), new_flat.get(path, missing)
        if before == after:
            continue
        if resume_rule(path) == MUST_MATCH and not _EQUIVALENT.get(path, lambda *_: False)(before, after, new):
            refused.append(path)
            continue
        changed[path] = [None if before is missing else before, None if after is missing else after]
    if refused:
        first = refused[0]
        show = lambda v: "(absent)" if v is missing else json.dumps(v)
        more = f" (and {len(refused) - 1} more: {', '.join(refused[1:4])}{', ...' if len(refused) > 4 else ''})" \
            if len(refused) > 1 else ""
        raise RecipeMismatchError(
            f"{where}: cannot resume: {first} was {show(saved_flat.get(first, missing))} in the saved run and is "
            f"{show(new_flat.get(first, missing))} now{more}. A resumed run keeps its model, data, tokenizer, data "
            f"order (train.seed), global batch and optimizer state layout; to change them, train into another "
            f"checkpoint.dir ({_fine_tune_from_it(saved)}).")
    return changed


def _check_init_from_not_added(saved: dict, new: dict, where: str) -> None:
    """checkpoint.init_from named on a run that started without one: its steps are resumed and init_from never read.
    It was refused as a change of data.tokenizer (the fine-tune's tokenizer copy), which the user had not set."""
    named = (new.get("checkpoint") or {}).get("init_from")
    if named and not (saved.get("checkpoint") or {}).get("init_from"):
        raise RecipeMismatchError(
            f"{where}: cannot resume: checkpoint.init_from is {named!r}, but this run started without it and a rerun "
            f"resumes its own steps, never reading init_from; leave checkpoint.init_from unset to continue this run, "
            f"or train into another checkpoint.dir to fine-tune from {named}")


def _fine_tune_from_it(saved: dict) -> str:
    """How a new run starts from the saved one: a LoRA run's steps hold its adapters alone (README: LoRA)."""
    if ((saved.get("lora") or {}).get("rank") or 0) > 0:
        return "a LoRA run's steps hold its adapters alone: export it merged, and fine-tune from the export with " \
               "checkpoint.init_from=hf:DIR"
    return "fine-tune from this run with checkpoint.init_from"


def learning_rate_change(recipe: Recipe, changed: dict[str, list], step: int) -> str:
    """'; learning rate at step N: BEFORE -> AFTER (...)' where the settings changed since the saved step move the
    schedule at the step the run resumes from; "" where they leave it as it was, but for rounding. The schedule
    runs over train.steps, so raising it on a finished run stretches the cosine decay, and the learning rate
    jumps back up: "train.steps: 20 -> 40" alone did not say so."""
    if not any(field in changed for field in _SCHEDULE_FIELDS):
        return ""
    saved_optimizer = dataclasses.replace(recipe.optimizer, **{field.removeprefix("optimizer."): changed[field][0]
                                                               for field in _SCHEDULE_FIELDS if field in changed
                                                               and field.startswith("optimizer.")})
    saved_train = dataclasses.replace(recipe.train, steps=changed.get("train.steps", [recipe.train.steps])[0])
    saved = dataclasses.replace(recipe, optimizer=saved_optimizer, train=saved_train)
    before = float(make_schedule(saved.optimizer, saved.schedule_steps)(step))
    after = float(make_schedule(recipe.optimizer, recipe.schedule_steps)(step))
    if math.isclose(before, after, rel_tol=1e-3):
        return ""
    return (f"; learning rate at step {step}: {before:.3g} -> {after:.3g} (warmup, then cosine decay to "
            f"the end of train.steps)")


def record_history(run_dir: str | os.PathLike, event: str, *, step: int, changed: dict | None = None,
                   **details) -> dict:
    """Appends one row to `<run>/history.jsonl`: what this invocation of the run did, and what it changed."""
    row = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "event": event,
           "step": step}
    if changed:
        row["changed"] = changed
    row.update({k: v for k, v in details.items() if v})
    with open(Path(run_dir) / HISTORY_FILENAME, "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def read_history(run_dir: str | os.PathLike) -> list[dict]:
    path = Path(run_dir) / HISTORY_FILENAME
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- which step to resume from ------------------------------------------------------------------------


def saved_recipe_changes(checkpointer: RunCheckpointer, step: int, recipe: Recipe) -> dict[str, list]:
    """compare_recipes against the recipe saved with `step` (reads one small file, no arrays)."""
    where = checkpointer.step_dir(step)
    text = checkpointer.read_recipe_json(step)
    try:
        saved_tree = json.loads(text)
    except json.JSONDecodeError as e:
        raise CorruptCheckpointError(f"{where}: the saved recipe is not JSON, the checkpoint is corrupt: {e}") from e
    from spillway.recipes.blocks import ModuleNotHere, where_the_block_is_needed

    try:
        saved = Recipe.from_dict(saved_tree).to_dict()
    except ModuleNotHere as e:
        raise RecipeMismatchError(where_the_block_is_needed(where, e)) from None
    except (ValueError, TypeError) as e:
        raise RecipeMismatchError(f"{where}: the saved recipe cannot be read by this version of spillway "
                                  f"({e}); resume it with the version that wrote it") from e
    return compare_recipes(saved, recipe.to_dict(), where=str(where))


def resumes_from_own_step(recipe: Recipe) -> bool:
    """Whether the run resumes from a step of its own, which holds the whole model: a fine-tune's source is then
    not read (its tokenizer was copied into the run), so it may be gone. A LoRA run reads its base at every start."""
    if recipe.lora.enabled or not recipe.train.resume:
        return False
    checkpoints = Path(recipe.run_dir) / CHECKPOINTS_DIRNAME
    return checkpoints.is_dir() and bool(finalised_step_dirs(checkpoints))


def steps_to_try(checkpointer: RunCheckpointer, recipe: Recipe) -> list[int]:
    """The steps a resume will try, newest first ([] for a fresh run), checked before any data is prepared:
    a fresh run into a directory that holds steps, a `train.resume_step` that is not there, or a recipe
    that differs from the newest step's in a field that must match are errors now."""
    steps = checkpointer.all_steps()
    cfg = recipe.train
    if not cfg.resume:
        if steps:
            raise RunError(f"{checkpointer.directory}: train.resume is false, but this directory holds steps "
                           f"{steps} of an earlier run; train into another checkpoint.dir, or delete them to "
                           f"start over here")
        return []
    if cfg.resume_step is not None:
        if cfg.resume_step not in steps:
            raise CheckpointError(f"{checkpointer.directory}: train.resume_step={cfg.resume_step}: no checkpoint "
                                  f"for that step (steps present: {steps or 'none'})")
        candidates = [cfg.resume_step]
    else:
        candidates = steps[::-1]
    if candidates:
        try:
            saved_recipe_changes(checkpointer, candidates[0], recipe)
        except CorruptCheckpointError:
            pass  # restore_for_resume reports it and falls back
    return candidates


@dataclasses.dataclass
class Resumed:
    """A restored step and what happened on the way to it."""

    step: int
    params: Any
    opt_state: Any
    loader_state: dict
    meta: dict
    changed: dict[str, list]                     # recipe fields changed since the step was saved
    set_aside: list[str]                         # step folders renamed: "<step>.<reason>"


def restore_for_resume(checkpointer: RunCheckpointer, recipe: Recipe, candidates: list[int], *, abstract_params,
                       abstract_opt_state, weights_problem: Callable[[dict], str | None], say=print) -> Resumed:
    """Restores the first intact candidate whose weights are sound (`weights_problem` returns None).

    Corrupt or diverged steps newer than it are set aside with a warning; with
    `train.resume_step`, the only candidate must be sound and every newer step
    is set aside as abandoned. Raises CheckpointError when no candidate is usable.
    """
    explicit = recipe.train.resume_step is not None
    rejected: list[tuple[int, str, str]] = []    # (step, reason for the folder name, why)
    for step in candidates:
        where = checkpointer.step_dir(step)
        try:
            changed = saved_recipe_changes(checkpointer, step, recipe)
            restored = checkpointer.restore(step, abstract_params=abstract_params,
                                            abstract_opt_state=abstract_opt_state)
            check_meta_names_its_step(where, step, restored["meta"])
            damage = None
        except CorruptCheckpointError as e:
            damage = str(e)
        # a file damaged under one host's reads fails only there: all processes must take the same step
        if not distributed.all_processes_ok(damage is None):
            if explicit:
                raise CorruptCheckpointError(damage or f"{where}: corrupt (another process could not read it)")
            say(f"warning: step {step} is corrupt, trying an older step: "
                f"{damage or 'another process could not read it'}")
            rejected.append((step, "corrupt", damage or "unreadable on another process"))
            continue
        try:
            problem = weights_problem(restored)   # reads the loader state first: a damaged one is a damaged step
        except DamagedLoaderState as e:
            if explicit:
                raise CorruptCheckpointError(f"{where}: {e}") from None
            say(f"warning: step {step} is corrupt, trying an older step: {where}: {e}")
            rejected.append((step, "corrupt", str(e)))
            continue
        if problem is not None:
            if explicit:
                raise NonFiniteLossError(f"{where}: the weights saved at step {step} are diverged ({problem}); "
                                         f"resume from an earlier step with train.resume_step "
                                         f"(steps present: {checkpointer.all_steps()})")
            say(f"warning: the weights of step {step} ({where}) are diverged ({problem}); trying an older step")
            rejected.append((step, "diverged", problem))
            continue
        break
    else:
        reasons = "; ".join(f"step {s}: {why}" for s, _, why in rejected)
        raise CheckpointError(f"{checkpointer.directory}: no intact checkpoint to resume from ({reasons}); "
                              f"move these steps away or train into another checkpoint.dir to start over")
    set_aside = [checkpointer.set_aside(s, reason).name for s, reason, _ in rejected]
    newer = [s for s in checkpointer.all_steps() if s > step]
    set_aside += [checkpointer.set_aside(s, "abandoned").name for s in newer]
    if set_aside:
        say(f"set aside (renamed, not deleted) in {checkpointer.directory}: {', '.join(set_aside)}")
    return Resumed(step, restored["params"], restored["opt_state"], restored["loader_state"], restored["meta"],
                   changed, set_aside)
