"""Reading one step folder: the saved trees checked against the restore targets (keys and shapes, from the
checkpoint's own metadata, before any array is read), the items restored (every array a piece at a time,
recipes/train/checkpoint_read.py), and the readers a fine-tune uses (`restore_params_only`, `read_recipe_json`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from spillway.recipes.train.checkpoint_dirs import _STEP_NAMES, _absolute, _finalised_steps, resolve_step_dir
from spillway.recipes.train.checkpoint_io import PieceWiseRestore
from spillway.recipes.train.row_pieces import from_pieces, restore_target
from spillway.recipes.train.stray_callbacks import quiet_failed_reads
from spillway.recipes.train.checkpoint_items import (META, PARAMS, RECIPE, RECIPE_FILENAME, CheckpointError,
                                                     CheckpointMismatchError, CorruptCheckpointError, _cause,
                                                     _item_handlers)

_MAX_LISTED_DIFFERENCES = 20  # a wholly different model would otherwise print every key


# -- comparing a checkpoint's tree with the restore target -----------------------------------


def _key_str(entry) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _flat_by_path(tree) -> dict[str, Any]:
    """{'layers/0/kernel': leaf}. Orbax's metadata stores every node as a dict with string keys,
    the live tree has dataclass attributes, list indices and nnx.State keys: joining the keys as
    strings makes the two comparable."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join(_key_str(k) for k in path): leaf for path, leaf in leaves}


def _as_restore_target(tree, what: str):
    """ShapeDtypeStructs with shardings; live arrays are accepted and described by their sharding. A
    LayerHalves or ResidentSplit (of either) becomes a RowPieces of its parts: the saved leaf is read
    straight into them (checkpoint_read.py)."""

    def one(path, leaf):
        if isinstance(leaf, jax.Array):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
        if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is not None:
            return leaf
        raise CheckpointError(
            f"{what}: leaf {'/'.join(_key_str(k) for k in path)!r} is {leaf!r}; restoring needs a "
            f"jax.ShapeDtypeStruct with a sharding (or a jax.Array) for every leaf, so that arrays "
            f"land on the mesh and memory kind you want")

    return restore_target(tree, one)


def _describe_differences(saved: Mapping[str, Any], target: Mapping[str, Any]) -> list[str]:
    lines = []
    for key in sorted(saved.keys() & target.keys()):
        saved_shape, target_shape = tuple(saved[key].shape), tuple(target[key].shape)
        if saved_shape != target_shape:
            lines.append(f"shape differs at {key!r}: checkpoint {saved_shape}, target {target_shape}")
    for key in sorted(target.keys() - saved.keys()):
        lines.append(f"missing from the checkpoint: {key!r} (target shape {tuple(target[key].shape)})")
    for key in sorted(saved.keys() - target.keys()):
        lines.append(f"only in the checkpoint: {key!r} (checkpoint shape {tuple(saved[key].shape)})")
    return lines


def _check_compatible(item_dir: epath.Path, saved_metadata, abstract_tree) -> None:
    saved_tree = getattr(saved_metadata, "tree", saved_metadata)  # TreeMetadata wraps the tree
    differences = _describe_differences(_flat_by_path(saved_tree), _flat_by_path(abstract_tree))
    if differences:
        shown = differences[:_MAX_LISTED_DIFFERENCES]
        if len(differences) > len(shown):
            shown.append(f"... and {len(differences) - len(shown)} more")
        raise CheckpointMismatchError(f"{item_dir}: checkpoint does not match the restore target "
                                      f"({len(differences)} difference(s)): " + "; ".join(shown))


# -- reading one step folder ------------------------------------------------------------------


def _restore_step_dir(step_dir: epath.Path, abstract_trees: Mapping[str, Any],
                      extra_items: Mapping[str, ocp.args.CheckpointArgs]) -> dict[str, Any]:
    """Restores the array items in `abstract_trees` (after checking them against the saved
    metadata) and the `extra_items` (JSON, text) from one finalised step folder."""
    handlers = _item_handlers()
    wanted = list(abstract_trees) + list(extra_items)
    for name in wanted:
        if not (step_dir / name).is_dir():
            raise CorruptCheckpointError(f"{step_dir}: item {name!r} is missing from this checkpoint "
                                         f"(corrupt, or not written by spillway.recipes.train.checkpoint)")
    for name, tree in abstract_trees.items():
        try:
            with quiet_failed_reads():
                saved_metadata = handlers[name].metadata(step_dir / name)
        except Exception as e:  # unreadable or garbage _METADATA
            raise CorruptCheckpointError(f"{step_dir / name}: cannot read the checkpoint's metadata, the "
                                         f"checkpoint is corrupt: {_cause(e)}") from e
        _check_compatible(step_dir / name, saved_metadata, tree)

    restore_args = {name: PieceWiseRestore(tree) for name, tree in abstract_trees.items()}
    restore_args.update(extra_items)
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler(**{n: handlers[n] for n in wanted}))
    try:
        with quiet_failed_reads():
            restored = checkpointer.restore(step_dir, args=ocp.args.Composite(**restore_args))
    except Exception as e:  # missing or truncated array files, garbage JSON, ...
        # shapes and keys were checked above, so what is left is almost always damage on disk
        raise CorruptCheckpointError(f"{step_dir}: restoring failed, the checkpoint is corrupt or unreadable "
                                     f"(or a target sharding cannot hold its array): {_cause(e)}") from e
    finally:
        checkpointer.close()
    return {name: restored[name] for name in wanted}


# -- fine-tuning entry points -----------------------------------------------------------------------


def _with_older_steps_hint(error: CorruptCheckpointError, given: epath.Path, step_dir: epath.Path):
    """A corrupt newest step, reached through a run or checkpoint directory: name the older steps to use."""
    if given == step_dir:
        return error
    older = [s for s in _finalised_steps(step_dir.parent) if s < int(step_dir.name)]
    if not older:
        return CorruptCheckpointError(f"{error} (no older step to fall back to)")
    return CorruptCheckpointError(f"{error} (older steps {older}: pass one of their folders, e.g. "
                                  f"{step_dir.parent / _STEP_NAMES.build_name(older[-1])})")


def check_meta_names_its_step(where, step: int, meta) -> None:
    """CorruptCheckpointError where the step's meta record does not name the step of its folder (steps swapped
    or copied by hand under another number): resumed, it trained from that step's weights on another step's
    schedule and data position; sampled or exported, it passed another step's weights off as this one's."""
    saved = meta.get("step") if isinstance(meta, dict) else None
    if saved != step or isinstance(saved, bool):
        raise CorruptCheckpointError(f"{where}: its meta record says step {saved!r}, its folder step {step}: "
                                     f"the record is damaged (or the folder holds another step's checkpoint)")


def restore_params_only(path: str | os.PathLike, abstract_params) -> tuple[Any, dict]:
    """Loads the parameters (and the meta dict) of a checkpoint, for a fine-tune.

    `path` is a run directory, its checkpoints directory (the newest step is used) or one step
    folder. The optimizer state is not read. Arrays land in the shardings of `abstract_params`,
    on any mesh, and in its form: a ResidentSplit target (split weights) comes back as one, each part's
    rows read straight into it.
    """
    step_dir = resolve_step_dir(path)
    try:
        items = _restore_step_dir(step_dir, {PARAMS: _as_restore_target(abstract_params, "abstract_params")},
                                  {META: ocp.args.JsonRestore()})
        check_meta_names_its_step(step_dir, int(step_dir.name), items[META])
    except CorruptCheckpointError as e:
        raise _with_older_steps_hint(e, _absolute(path), step_dir) from e
    return from_pieces(abstract_params, items[PARAMS]), items[META]


def read_recipe_json(path: str | os.PathLike) -> str:
    """The recipe saved beside a step, verbatim. `path`: a step folder, a checkpoints directory or a run
    directory (newest step)."""
    step_dir = resolve_step_dir(path)
    recipe_file = step_dir / RECIPE / RECIPE_FILENAME
    try:
        return recipe_file.read_text()
    except OSError as e:
        error = CorruptCheckpointError(f"{recipe_file}: cannot read the saved recipe: {_cause(e)}")
        raise _with_older_steps_hint(error, _absolute(path), step_dir) from e
