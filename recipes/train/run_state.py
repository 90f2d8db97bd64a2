"""What the train loop carries from step to step, and the device programs it runs.

`StepPrograms` is every program the loop runs on device: the train step (one
signature whether the update is deferred or not, recipes/train/step.py
TrainSetup), the flush of a deferred update, the validation loss and the
divergence check of a save. `step_programs` builds the real ones from a
TrainSetup; a test may hand the loop stand-ins of the same signatures
(tests/recipes/train/test_loop.py), so that the host-side policy (resume,
saving, stopping) runs without compiling a step.

`RunState` is the step reached and the state at that step: params, optimizer
state, and the update still pending with offload.update=next_forward (its
gradients in host memory or HBM, as offload.pending_gradients places them);
`settle` applies that update before anything reads the params or state
(validation, a save, the end), so no checkpoint holds pending gradients and a
resume starts with nothing pending, wherever they wait.

`initial_state` is the state built or restored: a fresh start (or a
fine-tune's loaded weights), or a resume from the newest checkpoint that is
intact and not diverged (recipes/train/resume.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from spillway.recipes.train.batch import Batch, BatchFeed
from spillway.recipes.train.divergence import make_weights_check
from spillway.recipes.train.step import TrainSetup, abstract_with_shardings, is_abstract, make_eval_step


@dataclasses.dataclass(frozen=True)
class StepPrograms:
    """The device programs of a run, by what they take and give."""

    train_step: Callable     # (params, opt_state, pending, Batch) -> (params, opt_state, pending, metrics)
    flush: Callable          # (params, opt_state, pending) -> the same, with nothing left pending
    eval_loss: Callable      # (params, Batch) -> (summed loss of its target tokens, their count), scalar arrays
    check_weights: Callable  # (params, next Batch, step metrics or None) -> divergence.WeightsReport


def step_programs(s: TrainSetup) -> StepPrograms:
    """The programs of `s`: its jitted step and flush, a jitted validation loss, the divergence check."""
    cfg = s.recipe.train
    eval_loss = jax.jit(make_eval_step(s.graphdef, s.mesh), in_shardings=(s.param_shardings, s.batch_sharding))
    check = make_weights_check(s.graphdef, s.mesh, loss_chunk=cfg.loss_chunk, grad_accum=cfg.grad_accum,
                               param_shardings=s.param_shardings, batch_sharding=s.batch_sharding)
    return StepPrograms(s.train_step, s.flush, eval_loss, check)


@dataclasses.dataclass
class RunState:
    """The step reached and the state after it."""

    step: int
    params: object
    opt_state: object
    pending: object          # the deferred update (TrainSetup.nothing_pending), None when nothing defers
    programs: StepPrograms
    settled: bool = True     # nothing pending since the last flush

    def advance(self, batch: Batch) -> dict:
        """One train step on `batch`; returns its metrics (on device)."""
        self.params, self.opt_state, self.pending, metrics = self.programs.train_step(
            self.params, self.opt_state, self.pending, batch)
        self.step += 1
        self.settled = False
        return metrics

    def settle(self) -> None:
        """Applies the update still pending, if any: before validation, a save or the end reads the state."""
        if not self.settled:
            self.params, self.opt_state, self.pending = self.programs.flush(self.params, self.opt_state,
                                                                            self.pending)
            self.settled = True


def weights_from_elsewhere(recipe, candidates: list[int]) -> bool:
    """Whether a run's first weights are all read (a resume, a fine-tune, a LoRA run's base and adapters'
    own initialisation): its setup then initialises none (step.setup(initialise=False))."""
    return bool(candidates) or bool(recipe.checkpoint.init_from) or recipe.lora.enabled


def initial_state(s: TrainSetup, programs: StepPrograms, feed: BatchFeed, checkpointer, candidates: list[int], *,
                  run_dir, main: bool, say) -> RunState:
    """The state the run starts from: restored from the first of `candidates` that is intact and whose
    weights are not diverged (the feed is put back to that step's position), or built: the setup's
    weights, or the weights a fine-tune starts from (checkpoint.init_from); `s.params` are only targets
    (ShapeDtypeStructs) when the run restores or loads its weights (`weights_from_elsewhere`). A LoRA run
    reads its frozen base from checkpoint.init_from at every start, a resume too: its checkpoints hold only
    the adapters (recipes/train/lora_state.py)."""
    from spillway.recipes.train import lora_state
    from spillway.recipes.train.init_weights import load_init_weights
    from spillway.recipes.train.resume import learning_rate_change, record_history, restore_for_resume

    recipe = s.recipe
    # A run whose weights come from elsewhere builds none (loop.py: setup(initialise=False)): its params are
    # targets, which the load or the restore fills where each lives, never beside initialised weights.
    params = s.params
    if recipe.lora.enabled:
        if not candidates and is_abstract(params):   # fresh adapters, made alone; the base is loaded next
            params = lora_state.join(lora_state.initial_adapters(recipe, s.param_shardings),
                                     lora_state.split(params)[1])
        # Checkpoints hold only the adapters: the frozen base is read from init_from at every start.
        params = lora_state.load_base(recipe, params, s.param_shardings, say, resuming=bool(candidates))
    elif not candidates and recipe.checkpoint.init_from:
        # Before the optimizer state: its fp32 master copies of low-precision weights are made from these.
        placed = abstract_with_shardings(params, s.param_shardings)   # split weights: read into their parts
        params = lora_state.with_restored(recipe, placed, load_init_weights(recipe, lora_state.checkpointed(
            recipe, placed), say))
    if not candidates:
        if main and recipe.checkpoint.init_from:
            record_history(run_dir, "fine-tune", step=0, init_from=str(recipe.checkpoint.init_from))
        elif main:
            record_history(run_dir, "start", step=0)
        opt_state = jax.jit(s.optimizer.init, out_shardings=s.opt_state_shardings)(params)
        return RunState(0, params, opt_state, s.nothing_pending(params), programs)

    def weights_problem(restored: dict) -> str | None:
        # the weights against the batch the resumed run trains on first; the feed is put back after
        feed.restore(restored["loader_state"])
        whole = lora_state.with_restored(recipe, params, restored["params"])
        problem = programs.check_weights(whole, feed.peek()).problem()
        feed.restore(restored["loader_state"])
        return problem

    # A resumed run's state and weights come from the checkpoint, never made first: that would be a second
    # whole copy in (pinned host) memory while the restore writes the first (benchmarks/host_memory_phases.py,
    # tests/recipes/train/test_resume_host_peak.py).
    resumed = restore_for_resume(
        checkpointer, recipe, candidates,
        abstract_params=lora_state.checkpointed(recipe, abstract_with_shardings(params, s.param_shardings)),
        # the state's own form (LayerHalves, ResidentSplit): each saved leaf is read straight into its parts
        abstract_opt_state=s.optimizer.abstract_state(params, s.param_shardings),
        weights_problem=weights_problem, say=say)
    step = int(resumed.meta["step"])
    params = lora_state.with_restored(recipe, params, resumed.params)   # a LoRA run: the base loaded above
    opt_state = resumed.opt_state
    feed.restore(resumed.loader_state)
    changes = "".join(f"; {field}: {before} -> {after}" for field, (before, after) in resumed.changed.items())
    changes += learning_rate_change(recipe, resumed.changed, step)   # a longer train.steps moves it
    say(f"resumed from {checkpointer.step_dir(resumed.step)} at step {step}{changes}")
    if main:
        record_history(run_dir, "resume", step=step, changed=resumed.changed, set_aside=resumed.set_aside)
    return RunState(step, params, opt_state, s.nothing_pending(params), programs)
