"""What a person watching a run sees and keeps: progress, JSON-lines metrics, TensorBoard, loss and expert-load plots.

`RunLogger` writes every logged step as one JSON line (metrics.jsonl) and as
TensorBoard scalars (tb/), and draws loss.png at the end, and expert_load.png
for a model with MoE layers (recipes/train/aux_terms.py names their metrics). Only process 0
writes; other processes log nothing.

A run that resumes from step K (after a kill, possibly during a save, so K can
be older than the last step logged) first drops the rows after K from
metrics.jsonl and asks TensorBoard to purge its events after K: the steps it
trains again replace those rows instead of repeating them. A run that starts with
no step of its own (a retry after an attempt killed before its first save)
removes the earlier attempts' event files from tb/ instead: TensorBoard's data
server purges a tag only where that tag is logged again, so their validation
points at steps the retry never validates at stayed on its curve. `read_metrics`
reads files written before that rule (rows repeated after a restart) the same
way: a step going backwards starts a new segment that replaces what came
after it. A value that is not finite (a diverged loss, the MFU of a GPU
without a known peak) is written as JSON's null, since NaN and Infinity are
not JSON and strict readers (jq, JavaScript, most non-Python loaders) refuse the
whole line; `read_metrics` reads a null back as NaN. MFU is model FLOPs per second over the
device's peak: the target's published bf16 peak on GPUs (recipes/targets.py), and on a CPU the
measured rate of a large float32 matmul (so the figure means "fraction of what
this machine's matmul can do").
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from spillway.recipes.targets import target_for_device_kind   # the planner's GPU facts, one table
from spillway.recipes.train import aux_terms
from spillway.recipes.train.errors import RunError

METRICS_FILENAME = "metrics.jsonl"   # in the run directory: one JSON line per logged step
TENSORBOARD_FLUSH_S = 1   # how long a TensorBoard event waits in memory before it is written


def measure_cpu_matmul_flops(size: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a float32 size^3 matmul on the default device (best of `repeats`)."""
    a = jnp.ones((size, size), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def peak_flops_per_device() -> tuple[float, str]:
    device = jax.local_devices()[0]
    if device.platform == "gpu":
        target = target_for_device_kind(device.device_kind)
        if target is None:
            return float("nan"), f"unknown GPU {device.device_kind}"
        return target.peak_bf16_flops, f"{device.device_kind} bf16 peak"
    return measure_cpu_matmul_flops(), "measured CPU f32 matmul"


def device_memory_in_use() -> int | None:
    """Bytes in use on this process's first device, where the backend reports it (GPUs do; CPUs may not)."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except (AttributeError, jax.errors.JaxRuntimeError):
        stats = None
    if not stats:
        return None
    return stats.get("bytes_in_use")


class NonFiniteLossError(RunError):
    """The run diverged; the message says which checkpoint (if any) is intact to resume from."""


def check_finite(step: int, loss: float, resume_hint: str = "the last checkpoint is kept") -> None:
    """Stops the run if the loss of `step` is NaN or infinite; `resume_hint` says where to resume."""
    if not math.isfinite(loss):
        raise NonFiniteLossError(
            f"loss is {loss} at step {step}: stopping. Try a lower optimizer.learning_rate, a smaller "
            f"optimizer.clip_norm, or check the data; {resume_hint}")


def _each_value(value, change):
    """`value` with `change` applied to every value inside its lists and dicts (a row, an expert-load list)."""
    if isinstance(value, list):
        return [_each_value(v, change) for v in value]
    if isinstance(value, dict):
        return {k: _each_value(v, change) for k, v in value.items()}
    return change(value)


def _metrics_line(row: dict) -> str:
    """A row as one strict JSON line: a float that is not finite as null."""
    strict = _each_value(row, lambda v: None if isinstance(v, float) and not math.isfinite(v) else v)
    return json.dumps(strict, allow_nan=False) + "\n"


def _nulls_as_nan(row: dict) -> dict:
    """A row read back: the only nulls metrics.jsonl holds are values that were not finite."""
    return _each_value(row, lambda v: math.nan if v is None else v)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The rows of a metrics.jsonl, restarts resolved: a row whose step is lower than the row before it
    (a run resumed from an earlier step) drops the earlier rows at that step and after. A null (a value
    that was not finite) reads as NaN; files written before that rule hold NaN itself, which reads the same."""
    rows: list[dict] = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill mid-write
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            continue
        row = _nulls_as_nan(row)
        if rows and row["step"] < rows[-1]["step"]:
            rows = [r for r in rows if r["step"] < row["step"]]
        rows.append(row)
    return rows


class RunLogger:
    """metrics.jsonl and TensorBoard events of a run that starts (or resumes) at `start_step`.

    Rows already logged after `start_step` belong to steps this run will train
    again: they are dropped (metrics.jsonl is rewritten atomically, TensorBoard
    purges its events from `start_step + 1` on) when the first of those steps
    is logged, not before: a run that stops before training one (a refusal, a
    crash at start-up) leaves the file as it found it.
    """

    def __init__(self, run_dir: str | os.PathLike, *, start_step: int, enabled: bool = True,
                 tensorboard: bool = True):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.history: list[dict] = []
        self._jsonl = None
        self._tb = None
        self._start_step, self._tensorboard = start_step, tensorboard
        if enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)

    def _open(self) -> None:
        """At the first row: the rows after the start step dropped, the files opened for appending."""
        self._drop_rows_after(self._start_step)
        self._jsonl = open(self.metrics_path, "a", buffering=1)
        if self._tensorboard:
            from tensorboardX import SummaryWriter
            if self._start_step == 0:   # every event there is of an attempt this run replaces (module docstring)
                for events in (self.run_dir / "tb").glob("events.out.tfevents.*"):
                    events.unlink(missing_ok=True)
            # flushed every second, not tensorboardX's two minutes: a run killed (the OOM killer) lost the events
            # its writer still held, of steps already saved, which the resumed run never logs again
            self._tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=self._start_step + 1,
                                     flush_secs=TENSORBOARD_FLUSH_S)

    @property
    def wrote_rows(self) -> bool:
        """Whether this run logged a row (the file is made with the first)."""
        return self._jsonl is not None

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / METRICS_FILENAME

    def _drop_rows_after(self, step: int) -> None:
        if not self.metrics_path.exists():
            return
        kept = [row for row in read_metrics(self.metrics_path) if row["step"] <= step]
        tmp = self.metrics_path.with_name(self.metrics_path.name + ".tmp")
        tmp.write_text("".join(_metrics_line(row) for row in kept))
        os.replace(tmp, self.metrics_path)  # a kill here leaves the old file or the new one, never half of it

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: (float(v) if isinstance(v, (int, float, np.number)) else v)
                                for k, v in metrics.items()}}
        self.history.append(row)
        if not self.enabled:
            return
        if self._jsonl is None:
            self._open()
        try:
            self._jsonl.write(_metrics_line(row))
        except OSError as error:   # a full disk: the file's own write names no file; the saved steps are intact
            raise OSError(error.errno, error.strerror, str(self.metrics_path)) from None
        if self._tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, float) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)

    def plot_loss(self, path: str | os.PathLike | None = None) -> Path | None:
        """Train (and validation) loss against step, as a PNG. Reads the whole metrics.jsonl (resumed runs too).

        None, drawing nothing, when there is no loss to draw: no row logged yet (a run stopped before its first
        log interval), or metrics.jsonl deleted while the run wrote it (the run itself is saved either way)."""
        if not self.enabled or not self.metrics_path.is_file():
            return None
        rows = read_metrics(self.metrics_path)
        curves = {label: sorted({r["step"]: r[key] for r in rows if key in r}.items())
                  for key, label in (("loss", "train"), ("val_loss", "validation"))}
        if not any(curves.values()):
            return None
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = Path(path or self.run_dir / "loss.png")
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, points in curves.items():
            if points:
                ax.plot(*zip(*points), label=label, marker="o" if label == "validation" else None)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(self.run_dir.name)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def plot_expert_load(self, path: str | os.PathLike | None = None) -> Path | None:
        """Each MoE router's per-expert load over training, as a PNG (expert_load.png); None when no row
        has one (a dense model, or nothing logged yet).

        Per router key (recipes/train/aux_terms.py): a map of each expert's share of the top-k choices
        (averaged over the layers) times the expert count, step against expert, where 1 is its fair
        share; below it the largest share of any expert in any layer (KEY/load_max), against 1."""
        if not self.enabled or not self.metrics_path.is_file():
            return None
        rows = read_metrics(self.metrics_path)
        suffix = f"/{aux_terms.LOAD}"
        keys = sorted({name[:-len(suffix)] for r in rows for name, v in r.items()
                       if name.endswith(suffix) and isinstance(v, list)})
        if not keys:
            return None
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = Path(path or self.run_dir / "expert_load.png")
        fig, axes = plt.subplots(2 * len(keys), 1, figsize=(7, 4.5 * len(keys)), squeeze=False,
                                 gridspec_kw={"height_ratios": [3, 1] * len(keys)}, sharex=True)
        for i, key in enumerate(keys):
            by_step = {r["step"]: r for r in rows if isinstance(r.get(key + suffix), list)}
            steps = sorted(by_step)
            load_se = np.asarray([by_step[s][key + suffix] for s in steps]) * len(by_step[steps[0]][key + suffix])
            top, bottom = axes[2 * i, 0], axes[2 * i + 1, 0]
            image = top.imshow(load_se.T, aspect="auto", origin="lower", cmap="coolwarm", vmin=0.0,
                               vmax=max(2.0, float(load_se.max())), interpolation="nearest",
                               extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, load_se.shape[1] - 0.5))
            fig.colorbar(image, ax=top, label="share x experts (1 = fair)")
            top.set_ylabel("expert")
            top.set_title(f"{self.run_dir.name}: {key} expert load (mean over layers)")
            worst = [(s, by_step[s][f"{key}/{aux_terms.LOAD_MAX}"]) for s in steps
                     if f"{key}/{aux_terms.LOAD_MAX}" in by_step[s]]
            if worst:
                bottom.plot(*zip(*worst), label="largest in any layer")
            bottom.axhline(1.0, color="gray", linestyle="--", linewidth=0.8, label="balanced")
            bottom.set_ylabel("max share x E")
            bottom.grid(alpha=0.3)
            bottom.legend(fontsize="small")
        axes[-1, 0].set_xlabel("step")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
