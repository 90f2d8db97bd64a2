"""Steps of a run that a LoRA run stands on: recorded in the base run's folder, kept by its retention.

A LoRA run's checkpoints hold its adapters only; its base is a step folder of
another run (`runs/base/checkpoints/30`, pinned when the LoRA run starts:
lora_state.pin_base). That run may train on, and its retention
(`checkpoint.keep`) would delete step 30, leaving adapters that nothing can
resume, sample or export. So the LoRA run records the step it stands on in the
base run's folder:

    runs/base/pinned_by/<digest of the LoRA run's path>.json
        {"step": 30, "run": "/abs/runs/lora", "relative": "../lora", "run_id": "<the LoRA run's id>"}

and the base run's checkpointer keeps every step a record names, beside its
newest `checkpoint.keep` (`PinnedSteps`, an orbax preservation policy, read at
each save, so a record written while the base run trains counts from its next
save). A record whose LoRA run folder is gone (deleted by its user) pins
nothing; the step is then deleted at the base run's next save as any other.
The LoRA run is looked for at its absolute path, at its path relative to
the base run (`relative`: a project folder moved whole), and by its id
(recipes/train/run_identity.py) among the folders beside either (a LoRA run
renamed), so a run moved or renamed keeps its pin.
A base folder the LoRA run cannot write (read-only, another user's) gets a
warning, not a refusal: nothing there deletes steps unless it trains.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

PINS_DIRNAME = "pinned_by"


def _record_path(base_run_dir: Path, by_run_dir: Path) -> Path:
    digest = hashlib.sha256(str(by_run_dir).encode()).hexdigest()[:16]
    return base_run_dir / PINS_DIRNAME / f"{digest}.json"


def record_pin(step_dir, by_run_dir, say=print) -> None:
    """Records in the base run's folder that the run at `by_run_dir` stands on `step_dir` (a step folder of a
    run, `<run>/checkpoints/<step>`; any other base, an hf: folder or a loose step folder, is not a run that
    deletes steps: nothing is recorded)."""
    from spillway.recipes.train.checkpoint_dirs import run_dir_of

    step_dir, by_run_dir = Path(step_dir).absolute(), Path(by_run_dir).absolute()
    base_run_dir = run_dir_of(step_dir)
    if base_run_dir is None or not step_dir.name.isdigit():
        return
    from spillway.recipes.train.run_identity import run_identity

    record = _record_path(base_run_dir, by_run_dir)
    text = json.dumps({"step": int(step_dir.name), "run": str(by_run_dir),
                       "relative": os.path.relpath(by_run_dir.resolve(), base_run_dir.resolve()),
                       "run_id": run_identity(by_run_dir)}) + "\n"
    try:
        if record.is_file() and record.read_text() == text:
            return
        record.parent.mkdir(exist_ok=True)
        partial = record.with_name(f".{record.name}.{os.getpid()}.partial")
        partial.write_text(text)
        partial.replace(record)   # a reader never sees half a record
    except OSError as error:
        say(f"warning: cannot record in {record.parent} that this run's adapters stand on {step_dir} "
            f"({error.strerror or error}): should that run train on, its checkpoint.keep may delete the step")


def pinned_steps(checkpoints_dir) -> set[int]:
    """The steps of the run whose checkpoints folder is `checkpoints_dir` that a living run stands on (its
    folder still there); unreadable records are passed over."""
    steps = set()
    folder = Path(checkpoints_dir).parent / PINS_DIRNAME
    for record in folder.glob("*.json") if folder.is_dir() else ():
        try:
            pin = json.loads(record.read_text())
            step, by, relative, run_id = int(pin["step"]), Path(pin["run"]), pin.get("relative"), pin.get("run_id")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        moved = folder.parent.resolve() / relative if isinstance(relative, str) else None
        if _still_there(by, moved, run_id):
            steps.add(step)
    return steps


def _still_there(by: Path, moved: Path | None, run_id) -> bool:
    """Whether the LoRA run of a record is still there (module docstring); records written before `relative`
    and `run_id` are looked for at `by` alone."""
    if by.is_dir() or (moved is not None and moved.is_dir()):
        return True
    if not isinstance(run_id, str):
        return False
    from spillway.recipes.train.run_identity import run_identity

    for parent in {by.parent, *((moved.parent,) if moved is not None else ())}:
        try:
            if any(run_identity(beside) == run_id for beside in parent.iterdir() if beside.is_dir()):
                return True
        except OSError:   # a parent gone too, or unreadable
            continue
    return False


class PinnedSteps:
    """An orbax preservation policy (orbax's PreservationPolicy protocol): keeps the steps `pinned_steps`
    names, read at every save's retention decision."""

    def __init__(self, checkpoints_dir):
        self.checkpoints_dir = Path(checkpoints_dir)

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        pinned = pinned_steps(self.checkpoints_dir)
        return [info.step in pinned for info in checkpoints]
