"""A LoRA run's state: the adapters train, the base weights are frozen, checkpoints hold the adapters.

The model carries its adapters as `nnx.LoRAParam`s beside the base weights
(layers/lora.py); the parameter tree the loop and the step pass around is the
whole model, so the step's signature, shardings and donation are those of any
run. What differs:

* the train step (recipes/train/lora_step.py `make_train_step`) splits the tree into adapters and base,
  differentiates the loss with respect to the adapters only (the base enters
  as a non-differentiated input: no weight gradient is computed for it, host
  resident or not), updates the adapters and returns the base unchanged;
* the optimizer (lora_step.py `AdapterOptimizer`) holds state for the adapters only: it
  takes whole trees where the loop and the planner hand them over and passes
  the adapter part to an `Optimizer` built over it;
* checkpoints (`checkpointed`, `with_restored`) hold the adapters; the base is
  the run's `checkpoint.init_from`, which the recipe saved beside every step
  names, pinned to one step folder when the run starts (`pin_base`), so a
  source run that trains on cannot change the base under the adapters, with
  the digest of its files (recipes/train/base_digest.py), so that another
  model saved at that path is refused rather than read;
* reading a run back (`restore_run_params`: generate, export) loads the base
  from that pointer and the adapters from the step.

LoRA dropout draws its mask from the run's seed and the optimizer's step
count (and the micro-batch), so a resumed run draws what the uninterrupted
run would have.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax

from spillway.recipes.config import Recipe
from spillway.recipes.optim import param_placement as placement
from spillway.recipes.train.lora_step import adapters_of, join, split


def trained_summary(recipe: Recipe) -> str:
    """What a LoRA run trains, for its header: "LoRA rank 8 on q_proj, v_proj: 0.07M adapter parameters
    trained (1.2% of the model), the base frozen"; "" for any other run. From the abstract model (no array made)."""
    if not recipe.lora.enabled:
        return ""
    from spillway.recipes.lora_targets import hf_modules
    from spillway.recipes.train.step import abstract_model

    _, abstract_state = abstract_model(recipe)
    count = sum(leaf.size for leaf in jax.tree.leaves(adapters_of(abstract_state)))
    share = 100 * count / max(1, recipe.num_params())
    # The projections adapted, as resolved (the family's PEFT default where lora.targets was left at q_proj,v_proj).
    modules = sorted({module.rsplit(".", 1)[-1] for module in hf_modules(recipe.model, recipe.lora_spec())})
    return (f"LoRA rank {recipe.lora.rank} on {', '.join(modules)}: {count / 1e6:.2f}M adapter "
            f"parameters trained ({share:.2g}% of the model), the base frozen")


# --- checkpoints: the adapters, and the base they adapt ------------------------------------------


def checkpointed(recipe: Recipe, params):
    """What a checkpoint holds of the parameters: a LoRA run's adapters, any other run's whole tree. Split
    weights (offload.params=host:N) stay ResidentSplits, never joined: the save writes their two parts into
    one stored array a piece at a time, and a restore target of that form reads each part's rows straight
    into it (recipes/train/row_pieces.py), so the step restores under any split, or none."""
    return adapters_of(params) if recipe.lora.enabled else params


def with_restored(recipe: Recipe, params, restored):
    """The whole tree after a restore of `checkpointed` parameters: `params`' base with the restored
    adapters for a LoRA run; the restored tree itself for any other (restored in `params`' form; a whole
    leaf where `params` holds a split, e.g. from a Hugging Face load, is cut as `params` are)."""
    if not recipe.lora.enabled:
        return placement.params_from_saved(restored, params)
    return join(restored, split(params)[1])


def pin_base(recipe: Recipe) -> Recipe:
    """A LoRA run's init_from resolved to the step folder it names (a run directory's newest step now),
    so the pointer every checkpoint saves keeps naming the same weights (`hf:` folders are kept), and the
    digest of those weights' files as they are now (recipes/train/base_digest.py), which every later read of
    the base compares."""
    init_from = recipe.checkpoint.init_from
    if not recipe.lora.enabled or not init_from:
        return recipe
    from spillway.recipes.train.base_digest import base_digest
    from spillway.recipes.train.init_weights import HF_PREFIX, hf_checkpoint_dir

    folder = hf_checkpoint_dir(init_from)
    if folder is None:
        from spillway.recipes.train.checkpoint import resolve_step_dir
        folder = resolve_step_dir(init_from)
        init_from = str(folder)
    else:   # a relative hf: path, which generate and export read from other directories too
        folder = folder.absolute()
        init_from = HF_PREFIX + str(folder)
    digest = base_digest(folder) if folder.exists() else None   # a missing base is named by the preflight
    return dataclasses.replace(recipe, checkpoint=dataclasses.replace(
        recipe.checkpoint, init_from=init_from, init_from_digest=digest,
        init_from_relative=_seen_from(recipe.run_dir, folder)))


def _seen_from(run_dir, base) -> str:
    """`base`'s path relative to `run_dir` (`checkpoint.init_from_relative`), between real paths: a project
    folder reached through a symlink names its run by the link and its base resolved."""
    return os.path.relpath(Path(base).resolve(), Path(run_dir).resolve())


def _place_from(run_dir, relative: str) -> Path:
    """The folder at `relative` (a `_seen_from` path) from `run_dir` as it is now."""
    return Path(os.path.normpath(Path(run_dir).resolve() / relative))


def base_where_the_run_went(recipe: Recipe, step_dir) -> Recipe:
    """The recipe of a LoRA run's saved step, its base named where it is now when the project tree moved: the
    pinned absolute path gone, the base found at the place it had relative to the run folder
    (`checkpoint.init_from_relative`) holding the same files (its digest). Otherwise `recipe` as it is (a
    missing base is named by the read)."""
    from spillway.recipes.train.init_weights import HF_PREFIX

    pointer = recipe.checkpoint
    found = _at_its_relative_place(recipe, step_dir)
    if found is None or _base_exists(pointer.init_from):
        return recipe
    from spillway.recipes.train.base_digest import holds_digest

    if not holds_digest(found, pointer.init_from_digest):   # other weights there: the read names it
        return recipe
    prefix = HF_PREFIX if pointer.init_from.startswith(HF_PREFIX) else ""
    return dataclasses.replace(recipe, checkpoint=dataclasses.replace(pointer, init_from=prefix + str(found)))


def _at_its_relative_place(recipe: Recipe, step_dir) -> Path | None:
    """What is at the place a LoRA run's base had relative to its run folder (`checkpoint.init_from_relative`),
    seen from the run folder of `step_dir` now, if anything is; None too for a run without that record."""
    from spillway.recipes.train.checkpoint import run_dir_of

    pointer = recipe.checkpoint
    if (not recipe.lora.enabled or not pointer.init_from or not pointer.init_from_relative
            or pointer.init_from_digest is None):
        return None
    run_dir = run_dir_of(Path(step_dir))
    if run_dir is None:
        return None
    found = _place_from(run_dir, pointer.init_from_relative)
    return found if found.exists() else None


def keep_started_base(recipe: Recipe, named: str | None, saved_recipe_json: str) -> Recipe:
    """A resume of a LoRA run whose command names its base by the base run's folder (`checkpoint.init_from=
    runs/base`, the command that started it) stands on the step that folder's newest was when the run started,
    which its saved steps name (`runs/base/checkpoints/30`), not on the base run's newest now: the same command
    resumes, however far the base run trained since. A base named by its step folder, or an hf: folder, is
    kept as named (check_same_base compares it)."""
    import json

    from spillway.recipes.train.checkpoint_dirs import checkpoint_dir_of

    saved_checkpoint = json.loads(saved_recipe_json).get("checkpoint") or {}
    saved, relative = saved_checkpoint.get("init_from"), saved_checkpoint.get("init_from_relative")
    pinned = recipe.checkpoint.init_from
    if (not recipe.lora.enabled or not named or not saved or saved == pinned or named.startswith("hf:")
            or Path(named).expanduser().absolute() == Path(pinned)):   # named a step folder itself
        return recipe
    if not Path(saved).exists() and isinstance(relative, str):   # the project moved: that step at its new place
        moved = _place_from(recipe.run_dir, relative)
        saved = str(moved) if moved.exists() else saved
    if Path(saved).parent.resolve() != Path(checkpoint_dir_of(named)).resolve():   # a step of another run:
        return recipe                                                              # check_same_base says so
    from spillway.recipes.train.base_digest import base_digest

    digest = base_digest(Path(saved)) if Path(saved).exists() else None   # a missing base: the load names it
    return dataclasses.replace(recipe, checkpoint=dataclasses.replace(
        recipe.checkpoint, init_from=saved, init_from_digest=digest,
        init_from_relative=_seen_from(recipe.run_dir, saved)))


def initial_adapters(recipe: Recipe, param_shardings):
    """A fresh LoRA run's adapters, initialised as the whole model would initialise them, alone: the program
    returns only the adapters, so XLA drops the base's initialisation and the base is never made before
    `load_base` reads it (the weights are not held twice)."""
    from flax import nnx

    from spillway.recipes.train.step import model_maker

    make = model_maker(recipe, recipe.train.seed, placement.whole_shardings(param_shardings))
    return jax.jit(lambda: adapters_of(nnx.split(make())[1]), out_shardings=adapters_of(param_shardings))()


def load_base(recipe: Recipe, params, param_shardings, say=print, *, resuming: bool = False):
    """`params` with the base weights of `checkpoint.init_from` (the adapters as they are): a LoRA run
    reads its base this way at every start, a resume too (`resuming`), since checkpoints hold only the
    adapters."""
    from spillway.recipes.train.init_weights import load_init_weights

    adapters, base = split(params)
    _, base_shardings = split(param_shardings)
    abstract_base = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), base, base_shardings)
    loaded = load_init_weights(recipe, abstract_base, say, resuming=resuming)
    return join(adapters, loaded)


def restore_run_params(step_dir, recipe: Recipe, abstract_params, with_base: bool = True):
    """The whole parameter tree of a saved step, into `abstract_params`' shardings: for a LoRA run the
    base from its pointer and the adapters from the step (generate, export). `with_base=False`: a LoRA run's
    base stays abstract (shapes only, never read): an adapter export needs the adapters alone, and works where
    the base is gone."""
    from spillway.recipes.train.checkpoint import restore_params_only

    if not recipe.lora.enabled:
        return restore_params_only(step_dir, abstract_params)[0]
    abstract_adapters, abstract_base = split(abstract_params)
    adapters = restore_params_only(step_dir, abstract_adapters)[0]
    base = _load_base_weights(recipe, abstract_base, step_dir) if with_base else abstract_base
    return join(adapters, base)


def _load_base_weights(recipe: Recipe, abstract_base, step_dir):
    from spillway.recipes.train.init_weights import load_init_weights

    init_from = recipe.checkpoint.init_from
    if init_from and not _base_folder(init_from).exists():
        from spillway.recipes.train.checkpoint import CheckpointError
        elsewhere = _at_its_relative_place(recipe, step_dir)
        if elsewhere is not None:   # (base_where_the_run_went took it if its files were the base's)
            raise _other_base(f"{init_from} is gone, and {elsewhere} (at its place relative to the run folder)")
        raise CheckpointError(f"the LoRA run's base checkpoint.init_from={init_from} does not exist any more: "
                              f"its adapters need it. Put it back; or, where it moved, train the run on a step "
                              f"naming its new place (--set checkpoint.init_from=... --set train.steps=<one more>: "
                              f"the same files are accepted, and later steps name it); `spillway export --adapter` "
                              f"needs no base")
    check_base_unchanged(recipe)
    return load_init_weights(recipe, abstract_base, say=lambda *_: None)


def check_base_unchanged(recipe: Recipe) -> None:
    """CheckpointError when the files at a LoRA run's base are not those its adapters were trained on (another
    model saved at the same path); a run saved before the digest was kept is not checked."""
    expected = recipe.checkpoint.init_from_digest
    if not recipe.lora.enabled or expected is None:
        return
    from spillway.recipes.train.base_digest import holds_digest

    folder = _base_folder(recipe.checkpoint.init_from)
    if folder.exists() and not holds_digest(folder, expected):   # a missing one: the load names it
        raise _other_base(recipe.checkpoint.init_from)


def _base_folder(init_from: str) -> Path:
    """The folder a LoRA run's base is read from: an hf: folder, or a spillway step folder."""
    from spillway.recipes.train.init_weights import hf_checkpoint_dir

    return hf_checkpoint_dir(init_from) or Path(init_from).expanduser()


def _other_base(init_from: str, where: str = ""):
    from spillway.recipes.train.checkpoint import CheckpointError

    return CheckpointError(f"{where}the LoRA run's base checkpoint.init_from={init_from} holds other weights than "
                           f"those its adapters were trained on (its files changed since the run started: another "
                           f"model saved there?); put the original base back, or train new adapters on this one "
                           f"in a new checkpoint.dir")


def _same_base_path(saved, pinned: str) -> bool:
    """Whether a saved step's init_from names the pinned base: the same text, or a relative hf: path (as runs
    started before pin_base made it absolute saved it) naming the same folder from this directory."""
    from spillway.recipes.train.init_weights import hf_checkpoint_dir

    if saved == pinned:
        return True
    try:
        saved_folder = hf_checkpoint_dir(saved) if isinstance(saved, str) else None
        return saved_folder is not None and saved_folder.absolute() == hf_checkpoint_dir(pinned)
    except ValueError:   # an empty hf: path
        return False


def _base_exists(init_from) -> bool:
    try:
        return isinstance(init_from, str) and _base_folder(init_from).exists()
    except ValueError:   # an empty hf: path
        return False


def check_same_base(recipe: Recipe, saved_recipe_json: str, where) -> None:
    """A LoRA run resumes on the base its adapters were trained on: the saved step's checkpoint.init_from
    must be the one this run resolves now, or, where that base is gone, another path holding the same files (a
    base moved; a ConfigError naming both otherwise: adapters on another base are another model, and `checkpoint.*` may
    otherwise change on a resume), holding the same files (its digest, a CheckpointError otherwise). `recipe`
    is pinned (`pin_base`)."""
    import json

    from spillway.layers.errors import ConfigError
    from spillway.recipes.train.base_digest import VERSION, holds_digest

    if not recipe.lora.enabled:
        return
    saved_checkpoint = json.loads(saved_recipe_json).get("checkpoint") or {}
    saved = saved_checkpoint.get("init_from")
    digest, now = saved_checkpoint.get("init_from_digest"), recipe.checkpoint.init_from_digest
    # the base as it is now has the saved digest, taken as that one was (a legacy digest by its own reads)
    same_files = digest is not None and now is not None and (
        digest == now or (not digest.startswith(VERSION) and holds_digest(_base_folder(recipe.checkpoint.init_from),
                                                                         digest)))
    # A base moved (gone from where the run started) and named at its new place: the same files by the digest.
    # Where the old place still holds a base, that one stays the run's: the digest samples files, not every
    # byte, and is no proof that another folder holds the same weights.
    moved = same_files and not _base_exists(saved)
    if not (_same_base_path(saved, recipe.checkpoint.init_from) or moved):
        raise ConfigError(f"{where}: this LoRA run's adapters were trained on checkpoint.init_from={saved}, but "
                          f"the run now names {recipe.checkpoint.init_from}: resume with the same base (or train "
                          f"into a new checkpoint.dir)")
    # the pinned recipe's digest is the base's files as they are now, read once at this start
    if digest is not None and now is not None and not same_files:   # None: saved before digests, or base missing
        raise _other_base(recipe.checkpoint.init_from, f"{where}: ")
