"""Run directories and step folders: where a run's checkpoints are, which steps are finalised, and the checks
that a directory can be written (recipes/train/checkpoint.py says how a step folder is laid out)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from etils import epath

from spillway.recipes.train.checkpoint_items import (CHECKPOINTS_DIRNAME, META, OPT_STATE, PARAMS, CheckpointError,
                                                     _cause)

# -- run directory and step folders ---------------------------------------------------------

_STEP_NAMES = ocp.step.standard_name_format()  # "<step>", no prefix: what `ls` shows is the step


def _absolute(path: str | os.PathLike) -> epath.Path:
    # orbax's background writer rejects relative paths, and only says so from its thread; `~` as everywhere
    # else a path is read (`--set checkpoint.init_from=~/run` reaches here unexpanded by the shell)
    return epath.Path(os.path.abspath(os.path.expanduser(os.fspath(path))))


def _finalised_steps(run_dir: epath.Path) -> list[int]:
    """Steps whose save completed; `<step>.orbax-checkpoint-tmp` folders are not listed, nor a numbered folder
    holding none of a step's items (made by hand, or emptied): it is no step to read."""
    return sorted(m.step for m in _STEP_NAMES.find_all(run_dir) if _is_step_dir(m.path))


def _is_step_dir(path: epath.Path) -> bool:
    # a checkpoint directory holds numbered folders; a step folder holds the items
    return any((path / name).is_dir() for name in (PARAMS, OPT_STATE, META))


def check_not_inside_a_runs_steps(run_dir: str | os.PathLike) -> None:
    """CheckpointError where `run_dir` is (or is inside) a run's checkpoints folder or one of its step folders:
    a run trained there wrote its own checkpoints/, metrics and lock among that run's steps (or into a
    finished step), and `spillway generate <run>/checkpoints` then read the intruder's steps."""
    path = _absolute(run_dir)
    for folder in (path, *path.parents):
        step = _is_step_dir(folder)
        if step or (folder.name == CHECKPOINTS_DIRNAME and _finalised_steps(folder)):
            what = "a step folder" if step else "the checkpoints folder"
            run = (run_dir_of(folder) or folder.parent) if step else folder.parent
            raise CheckpointError(f"checkpoint.dir={path} is {'inside ' if folder != path else ''}{what} of the "
                                  f"run in {run}: a run writes into a folder of its own; to continue that run, "
                                  f"name it (checkpoint.dir={run}), to fine-tune from it, set "
                                  f"checkpoint.init_from={folder} and checkpoint.dir to a new folder")


def steps_beside(missing: str | os.PathLike) -> str:
    """"; the steps in DIR: 2, 4 (...)" where `missing` (a path that does not exist) names a step of a checkpoints
    folder that has others (`RUN/checkpoints/7`, or `RUN/7`); "" otherwise. A step removed by the run's retention
    (checkpoint.keep) is the usual cause: the user needs the steps that are there."""
    path = _absolute(missing)
    if path.name == CHECKPOINTS_DIRNAME or not path.parent.is_dir():   # `RUN/checkpoints` of a run that wrote none
        return ""
    folder = checkpoint_dir_of(path.parent)   # `RUN/7` for `RUN/checkpoints/7` too
    if not (steps := _finalised_steps(folder)):
        return ""
    # a step set aside at a resume (recipes/train/checkpoint.py set_aside) is there, renamed: not the retention's
    aside = sorted(p.name for p in folder.iterdir() if p.name.startswith(f"{path.name}.") and p.is_dir())
    why = (f"{', '.join(aside)} is that step, set aside by a resume (renamed, not deleted)" if aside
           else "a run keeps its checkpoint.keep newest steps")
    return (f"; the steps in {folder}: {', '.join(map(str, steps))} (name one, or the run directory for the "
            f"newest; {why})")


def checkpoint_dir_of(path: str | os.PathLike) -> epath.Path:
    """The folder holding the step folders, given it or the run directory above it (`<run>/checkpoints`)."""
    path = _absolute(path)
    if not _is_step_dir(path) and (path / CHECKPOINTS_DIRNAME).is_dir():
        return path / CHECKPOINTS_DIRNAME
    return path


def without_hf_prefix(path: str) -> str:
    """`path` as a folder: train's `hf:` spelling (checkpoint.init_from=hf:DIR) dropped where DIR exists and
    `hf:DIR` itself does not, so that `generate` and `export` find a run or a Hugging Face folder named so (they
    said "hf:DIR does not exist" of a DIR that is there)."""
    if path.startswith("hf:") and not Path(path).exists() and Path(path[3:]).expanduser().exists():
        return path[3:]
    return path


def resolve_step_dir(path: str | os.PathLike) -> epath.Path:
    """A step folder, given a step folder, a checkpoint directory or a run directory (newest step)."""
    path = _absolute(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory{steps_beside(path)}")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (expected a run directory, its checkpoints "
                              f"directory or a step folder)")
    if ocp.step.is_path_temporary(path):
        raise CheckpointError(f"{path}: an unfinished save (orbax tmp folder), not a checkpoint; "
                              f"use a finalised step folder or the run directory")
    if _is_step_dir(path):
        if not ocp.step.is_checkpoint_finalized(path):
            raise CheckpointError(f"{path}: this step's save never finished")
        return path
    directory = checkpoint_dir_of(path)
    steps = _finalised_steps(directory)
    if not steps:
        raise CheckpointError(f"{path}: no checkpoint found (no finalised step folder in "
                              f"{'this directory' if directory == path else directory}){_what_else(path)}")
    return directory / _STEP_NAMES.build_name(steps[-1])


def _what_else(path: epath.Path) -> str:
    """What a folder with no step is, where it is a Hugging Face folder (export, download) or a PEFT adapter."""
    from spillway.models.hf import PEFT_ADAPTER_CONFIG, is_hf_checkpoint_folder, peft_adapter_base

    if (base := peft_adapter_base(path)) is not None:
        return (f"; it holds a PEFT adapter ({PEFT_ADAPTER_CONFIG}) of {base}, which spillway does not read: name "
                f"the run it was exported from, or merge it into its base with peft and fine-tune from that "
                f"(checkpoint.init_from=hf:FOLDER)")
    if is_hf_checkpoint_folder(path):
        return f"; it is a Hugging Face checkpoint: fine-tune from it with checkpoint.init_from=hf:{path}"
    return ""


def finalised_step_dirs(directory: str | os.PathLike) -> list[epath.Path]:
    """The finalised step folders of a checkpoints directory, oldest first."""
    directory = _absolute(directory)
    return [directory / _STEP_NAMES.build_name(step) for step in _finalised_steps(directory)]


def run_dir_of(step_dir: epath.Path) -> epath.Path | None:
    """The training run a step folder belongs to (`<run>/checkpoints/<step>`), or None if it is not in one."""
    if step_dir.parent.name == CHECKPOINTS_DIRNAME:
        return step_dir.parent.parent
    return None


def _check_writable(directory: epath.Path) -> None:
    """Creates `directory` and writes a probe file there: an unwritable place fails now, in one line."""
    probe = directory / f".spillway-write-test-{socket.gethostname()}-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"spillway checks that checkpoints can be written here\n")
        probe.unlink()
    except Exception as e:  # OSError locally; other types from remote filesystems
        raise CheckpointError(f"{directory}: cannot write checkpoints here: {_cause(e)}") from e


def _sync_processes(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)
