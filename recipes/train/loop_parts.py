"""The parts of the train loop that run after a step, each deciding itself when it runs.

    LossWatch    every step: the previous step's loss is finite (read one step late, so dispatch stays async)
    Progress     every train.log_every steps and the last: the metrics row and the progress bar
    Validation   every train.eval_every steps and the last: the validation loss (per source of a mixture)
    Stopping     a signal (SIGTERM, Ctrl-C; every process agrees) or `stop_after` steps of this invocation
    Saving       every checkpoint.every_steps steps, the last step, a step the run stops at: the one place
                 the save is decided; the weights are checked first (divergence.py) and never saved diverged
    Profile      train.profile_steps: a jax.profiler trace of those steps

recipes/train/loop.py calls them in that order after every step.
"""

from __future__ import annotations

import time

import jax

from spillway.models.flops import model_flops_per_token
from spillway.recipes.train import aux_terms, lora_state
from spillway.recipes.train.metrics import NonFiniteLossError, check_finite, device_memory_in_use, peak_flops_per_device
from spillway.recipes.train.preemption import signal_name
from spillway.recipes.train.run_state import RunState


def resume_hint(checkpointer) -> str:
    """Where a diverged run can resume from: only steps that were checked before they were saved."""
    steps = checkpointer.all_steps()
    if not steps:
        return "no checkpoint was saved before it diverged, so a rerun starts over (lower the learning rate first)"
    older = f"; an earlier one with --set train.resume_step=N (steps: {steps})" if len(steps) > 1 else ""
    return (f"step {steps[-1]} is intact ({checkpointer.step_dir(steps[-1])}): a rerun with a lower "
            f"optimizer.learning_rate resumes from it{older}")


class LossWatch:
    """NonFiniteLossError once a step's loss is NaN or infinite: each step's loss is read a step later."""

    def __init__(self, checkpointer):
        self._checkpointer = checkpointer
        self._previous = None   # (step, metrics on device) of the step before

    def after_step(self, step: int, metrics: dict) -> None:
        if self._previous is not None:
            check_finite(self._previous[0], float(self._previous[1]["loss"]), resume_hint(self._checkpointer))
        self._previous = (step, metrics)


class Progress:
    """The metrics row of a logged step (RunLogger: metrics.jsonl, TensorBoard) and the progress bar."""

    def __init__(self, recipe, feed, logger, bar, checkpointer, *, main: bool):
        cfg = recipe.train
        self._recipe, self._feed, self._logger, self._bar = recipe, feed, logger, bar
        self._checkpointer, self._main = checkpointer, main
        self.tokens_per_step = cfg.global_batch * feed.data.seq_len
        self._flops_per_step = model_flops_per_token(recipe.decoder_spec(), feed.data.seq_len) * self.tokens_per_step
        self.peak_flops, self.peak_source = peak_flops_per_device()
        self._warned_unbalanced = self._warned_zero_gradient = False
        self.restart_window()

    def restart_window(self) -> None:
        """The step time is measured from here (a validation pass is not a step's time)."""
        self._window_start, self._window_steps = time.perf_counter(), 0

    def due(self, step: int) -> bool:
        return step % self._recipe.train.log_every == 0 or step == self._recipe.train.steps

    def after_step(self, step: int, metrics: dict) -> None:
        self._window_steps += 1
        if not self.due(step):
            return
        loss = float(metrics["loss"])
        check_finite(step, loss, resume_hint(self._checkpointer))
        row = self._row(loss, metrics)
        self._warn_if_unbalanced(row)
        self._warn_if_nothing_trains(step, row)
        self._logger.log(step, row)
        self._bar.set_postfix({"loss": f"{loss:.3f}", **aux_terms.progress(row),
                               "tok/s": f"{row['tokens_per_s']:.0f}", "mfu": f"{row['mfu']:.1%}",
                               "step": f"{row['step_time_s'] * 1e3:.0f}ms",
                               **({"mem": f"{row['memory_gib']:.1f}G"} if "memory_gib" in row else {})})
        self.restart_window()

    def _row(self, loss: float, metrics: dict) -> dict:
        step_time = (time.perf_counter() - self._window_start) / self._window_steps
        row = {"loss": loss, "grad_norm": float(metrics["grad_norm"]), "learning_rate": float(metrics["learning_rate"]),
               "tokens_per_s": self.tokens_per_step / step_time, "step_time_s": step_time,
               "mfu": self._flops_per_step / step_time / (self.peak_flops * jax.device_count())}
        memory = device_memory_in_use()
        if memory is not None:
            row["memory_gib"] = memory / 2**30
        data = self._feed.data
        if data.is_mixture:   # tokens trained on so far from each source (all processes)
            row.update({f"tokens/{name}": taken * data.seq_len
                        for name, taken in self._feed.loader.state()["taken"].items()})
        row.update(aux_terms.logged(metrics.get(aux_terms.AUX_METRICS, {})))
        return row

    def _warn_if_nothing_trains(self, step: int, row: dict) -> None:
        """Once, at a logged step whose gradient is exactly zero: no trained weight reaches the loss (LoRA
        targets a user's block never calls; a new user's run showed grad_norm 0.0 and an MFU of 97% without a
        word, XLA having dropped the backward pass)."""
        if self._warned_zero_gradient or row["grad_norm"] != 0.0:
            return
        self._warned_zero_gradient = True
        if self._main:
            targets = (f" (lora.targets {list(self._recipe.lora.targets)}: are they weights the blocks' forward "
                       f"uses?)" if self._recipe.lora.enabled else "")
            self._bar.write(f"warning: step {step}'s gradient is exactly zero: no trained weight reaches the loss, "
                            f"so nothing trains{targets}")

    def _warn_if_unbalanced(self, row: dict) -> None:
        if self._warned_unbalanced or not aux_terms.router_keys(row) or self._recipe.aux_loss.load_balancing:
            return
        self._warned_unbalanced = True
        if self._main:
            self._bar.write("warning: the model routes tokens to experts and aux_loss.load_balancing is 0: nothing "
                            "keeps the experts' load balanced (Mixtral trains with 0.02, Qwen3-MoE with 0.001)")


class Validation:
    """`val_loss` every train.eval_every steps and at the last; for a mixture also `val_loss/<source>`, and
    `val_loss` is their weighted average (recipes/train/data_pipeline.py)."""

    def __init__(self, recipe, feed, logger, write):
        self._cfg = recipe.train
        self._feed, self._logger, self._write = feed, logger, write

    def due(self, step: int) -> bool:
        return bool(self._cfg.eval_every) and (step % self._cfg.eval_every == 0 or step == self._cfg.steps)

    def after_step(self, state: RunState, metrics: dict) -> bool:
        """Whether it ran (it settles the state first)."""
        if not self.due(state.step):
            return False
        state.settle()
        values = self.losses(state)
        self._logger.log(state.step, values)
        per_source = "".join(f", {key.removeprefix('val_loss/')} {value:.4f}"
                             for key, value in values.items() if key != "val_loss")
        self._write(f"step {state.step}: train loss {float(metrics['loss']):.4f}, validation loss "
                    f"{values['val_loss']:.4f}{per_source}")
        return True

    def losses(self, state: RunState) -> dict[str, float]:
        data = self._feed.data
        per_source = {name: self._loss(state, rows) for name, rows in data.validation_sets().items()}
        if not data.is_mixture:
            return {"val_loss": per_source[next(iter(per_source))]}
        mixed = sum(data.weights[name] * loss for name, loss in per_source.items())
        return {"val_loss": mixed, **{f"val_loss/{name}": loss for name, loss in per_source.items()}}

    def _loss(self, state: RunState, val_rows) -> float:
        from spillway.data import eval_batches
        batches = eval_batches(val_rows, global_batch_size=self._cfg.global_batch,
                               process_index=jax.process_index(), process_count=jax.process_count())
        sums = [state.programs.eval_loss(state.params, self._feed.placed(local))
                for _, local in zip(range(self._cfg.eval_batches), batches)]
        return token_mean([(float(total), float(count)) for total, count in sums])


def token_mean(sums: list[tuple[float, float]]) -> float:
    """The mean over every target token of (summed loss, target count) pairs: batches weigh by their targets
    (a batch with none weighs nothing); NaN when no batch has a target."""
    count = sum(count for _, count in sums)
    return sum(total for total, _ in sums) / count if count > 0 else float("nan")


class Stopping:
    """Whether the run stops after this step: a stop signal (every process gets the same answer at the same
    step, preemption.GroupStop) or `stop_after` steps of this invocation (a time-limited job)."""

    def __init__(self, group_stop, *, stop_after: int | None, first_step: int, last_step: int):
        self._group_stop = group_stop
        self._stop_after, self._first_step, self._last_step = stop_after, first_step, last_step
        self.status = 0
        self.leave_early = False

    def after_step(self, step: int) -> None:
        self.status = self._group_stop.poll()
        self.leave_early = (self._stop_after is not None and step - self._first_step >= self._stop_after
                            and step < self._last_step)

    def after_save(self, step: int) -> None:
        """A signal that came during the save of `step` stops the run there (the save holds it), rather than
        after one more step and another save; not at the last step, which the run finishes as it is."""
        if not self.requested and step < self._last_step:
            self.status = self._group_stop.poll_now()

    @property
    def requested(self) -> bool:
        return bool(self.status) or self.leave_early

    def leave(self, step: int, checkpointer, write) -> bool:
        """True to leave the loop now (stop_after: `left_early_line` says so once the progress bar is closed,
        else it was glued to the bar's last line in a log); raises SystemExit on a signal, once its save is
        written."""
        if self.leave_early:
            return True
        if self.status:
            checkpointer.wait()
            write(f"{signal_name(self.status)}: saved step {step} ({checkpointer.step_dir(step)}), stopping")
            raise SystemExit(self.status)
        return False

    def left_early_line(self, step: int) -> str | None:
        """What a run that left early (stop_after) says once its bar is closed; None for one that did not."""
        if not self.leave_early:
            return None
        return (f"stopping after {self._stop_after} steps at step {step} of {self._last_step} (checkpoint saved; "
                f"the same command resumes from it)")


class Saving:
    """When a step is saved, and its save: every checkpoint.every_steps steps, the last step (whatever the
    period) and a step the run stops at. The weights are checked against the next batch first
    (divergence.py), drawn here and kept for the next step; the loader state saved is the one before it,
    so a resumed run draws that batch again."""

    def __init__(self, recipe, checkpointer, feed, lock, say, tokens_per_step: int):
        self._recipe, self._checkpointer, self._feed, self._lock = recipe, checkpointer, feed, lock
        self._say, self._tokens_per_step = say, tokens_per_step

    def due(self, step: int, *, stopping: bool) -> bool:
        return step % self._recipe.checkpoint.every_steps == 0 or step == self._recipe.train.steps or stopping

    def after_step(self, state: RunState, metrics: dict, *, stopping: bool) -> bool:
        """Saves the step if one is due; whether it did."""
        if not self.due(state.step, stopping=stopping):
            return False
        state.settle()
        self.save(state, metrics)
        return True

    def save(self, state: RunState, metrics: dict | None) -> None:
        """Saves `state` unless its weights are diverged: then NonFiniteLossError, nothing saved."""
        self._lock.check(self._say)  # another run got into the directory: stop before writing over its own
        loader_state = self._feed.state()
        problem = state.programs.check_weights(state.params, self._feed.peek(), metrics).problem()
        if problem is not None:
            raise NonFiniteLossError(f"the weights after step {state.step} are diverged ({problem}): not saved, "
                                     f"stopping; {resume_hint(self._checkpointer)}")
        meta = {"step": state.step, "seed": self._recipe.train.seed,
                "tokens_seen": state.step * self._tokens_per_step}
        # force: decided here (`due`), not by the checkpointer's own period; a LoRA run saves its adapters.
        # The state as it lies (LayerHalves too): the checkpointer writes it in saved form (checkpoint_io.py).
        self._checkpointer.save(state.step, params=lora_state.checkpointed(self._recipe, state.params),
                                opt_state=state.opt_state, loader_state=loader_state,
                                meta=meta, recipe_json=self._recipe.to_json(), force=True)


class Profile:
    """A jax.profiler trace of steps START..STOP (train.profile_steps) into RUN_DIR/profile, on process 0."""

    def __init__(self, recipe, run_dir, *, main: bool, say):
        self._range = recipe.train.profile_range() if main else None
        self._dir, self._say = run_dir / "profile", say

    def before_step(self, step: int) -> None:
        if self._range and step == self._range[0]:
            jax.profiler.start_trace(str(self._dir))

    def after_step(self, state: RunState) -> None:
        if self._range and state.step == self._range[1]:
            jax.block_until_ready(state.params)
            jax.profiler.stop_trace()
            self._say(f"profile of steps {self._range[0]}..{self._range[1]} written to {self._dir}")
