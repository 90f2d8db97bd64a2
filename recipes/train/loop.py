"""The train loop: data, the sharded step, progress, validation, checkpoints, a sample at the end.

    run lock (run_lock.py) -> checkpoint directory writable? -> which step to
    resume from, and may this recipe resume it? (resume.py) -> data
    (tokenizer, packed rows, loader) -> mesh -> model and optimizer state
    created in their shards -> restore (falling back past corrupt or diverged
    steps) or fine-tune weights (finetune.py) -> the jitted step (step.py) ->
    loop (progress, validation, checkpoints, profile) -> a text sample.

Everything a user can get wrong is checked before data is prepared. Inside
the loop, a step is saved only after its weights pass divergence.py's check;
the last step is always saved; SIGTERM and Ctrl-C save at the step boundary
(preemption.py); an async save that fails stops the run at the next step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from spillway.layers.memory import Memory
from spillway.layers.residency import memory_of
from spillway.layers.sharding import make_mesh
from spillway.models.flops import model_flops_per_token
from spillway.recipes.config import DataConfig, Recipe
from spillway.recipes.optim.host_memory import check_host_memory
from spillway.recipes.sampling import generate
from spillway.recipes.train import aux_terms, distributed, gpu_allocators, host_memory
from spillway.recipes.train.divergence import make_weights_check
from spillway.recipes.train.errors import RunError
from spillway.recipes.train.metrics import (NonFiniteLossError, RunLogger, check_finite, device_memory_in_use,
                                            peak_flops_per_device)
from spillway.recipes.train.preemption import GroupStop, StopSignals, signal_name
from spillway.recipes.train.run_lock import RunLock, RunLockedError
from spillway.recipes.train.step import (abstract_setup, abstract_with_shardings, make_eval_step, pinned_host_bytes,
                                         setup)


def _global_batch(local_bt, sharding: NamedSharding):
    """The global batch from this process's rows: a token array, or a TrainBatch (recipes/train/sft_batch.py)."""
    return jax.tree.map(lambda part: jax.make_array_from_process_local_data(sharding, np.asarray(part)), local_bt)


def _parse_profile(spec: str | None) -> tuple[int, int] | None:
    if not spec:
        return None
    start, sep, stop = spec.partition(":")
    if not sep or not start.isdigit() or not stop.isdigit() or int(stop) <= int(start):
        raise ValueError(f"train.profile_steps must be 'START:STOP' with STOP > START, got {spec!r}")
    return int(start), int(stop)


@dataclasses.dataclass
class RunResult:
    run_dir: Path
    final_step: int
    history: list
    sample: str | None
    model: object
    tokenizer: object


@contextlib.contextmanager
def _owned_run_dir(run_dir: Path, main: bool, say):
    """Holds `<run>/run.lock` (process 0 takes it for the group) for as long as the run writes there."""
    lock = RunLock(run_dir)
    error = None
    if main:
        try:
            stale = lock.acquire()
        except RunError as e:
            error = e
        else:
            if stale is not None:
                say(f"took over the run lock {lock.path} from a run that is gone ({stale.describe()})")
            lock.watch()   # a lock file deleted while the run lives is re-created; one replaced stops the run
    if not distributed.all_processes_ok(error is None):
        raise error or RunLockedError(f"{run_dir}: process 0 could not take the run directory (its error says why)")
    try:
        yield lock
    finally:
        lock.release()


def train(recipe: Recipe, *, echo=print, progress: bool = True, stop_after: int | None = None,
          host_ram_gb: float | None = None) -> RunResult:
    """Run (or resume) the recipe. `stop_after`: leave after that many steps of this invocation, with a
    checkpoint, as a time-limited job would; the next call resumes. `host_ram_gb`: the host RAM to check
    the run's host memory peak against (default: the machine's; above it, a warning).

    Failures a user can fix raise RunError subclasses with one-line messages; SIGTERM and Ctrl-C save the
    step in progress and raise SystemExit(143 or 130) (recipes/train/preemption.py).
    """
    from spillway.recipes.train.checkpoint import CHECKPOINTS_DIRNAME, RunCheckpointer

    if host_ram_gb is not None and not host_ram_gb > 0:
        from spillway.layers.errors import ConfigError
        raise ConfigError(f"--host-ram-gb must be positive, got {host_ram_gb}")
    # Before anything starts the GPU backend: the pinned limit from the run's pinned peak (shapes only).
    gpu_allocators.configure(pinned_need_bytes=host_memory.pinned_need_of_recipe(recipe))
    distributed.maybe_initialize()
    main = distributed.is_main_process()
    say = echo if main else (lambda *a, **k: None)
    _parse_profile(recipe.train.profile_steps)  # a bad value fails before anything is written
    from spillway.recipes.train.init_weights import check_hf_tensors, resolve_init_from
    recipe = resolve_init_from(recipe, say)  # an hf: checkpoint must be this model (it brings its tokenizer)
    check_hf_tensors(recipe)  # ... and hold its tensors, named and shaped as the model's: before data is prepared
    from spillway.recipes.train.finetune import check_not_its_own_source
    check_not_its_own_source(recipe)  # init_from == checkpoint.dir: say so, not a tokenizer mismatch later
    from spillway.recipes.train import lora_state
    recipe = lora_state.pin_base(recipe)  # a LoRA run's base: the step folder init_from names now
    from spillway.recipes.train.preflight import check_run_inputs
    check_run_inputs(recipe)  # a missing corpus or tokenizer: one line now, before the run directory is taken
    from spillway.recipes.train.sft_preflight import check_fine_tuning_inputs
    check_fine_tuning_inputs(recipe)  # chat/instruct on a text corpus, document masks cuDNN cannot apply
    from spillway.recipes.train.step import check_attention_backend, check_aux_loss
    check_attention_backend(recipe.execution.attention_impl, jax.default_backend())  # before data is prepared
    check_aux_loss(recipe)  # a coefficient that would weight nothing: before data is prepared
    run_dir = Path(recipe.run_dir)
    with _owned_run_dir(run_dir, main, say) as lock:
        # opening checks that checkpoints can be written there: before any data is prepared
        checkpointer = RunCheckpointer(run_dir / CHECKPOINTS_DIRNAME, keep=recipe.checkpoint.keep,
                                       every_steps=recipe.checkpoint.every_steps,
                                       async_save=recipe.checkpoint.async_save)
        try:
            return _train_owned(recipe, run_dir, checkpointer, main=main, say=say, progress=progress,
                                stop_after=stop_after, lock=lock, host_ram_gb=host_ram_gb)
        except Exception as error:
            from spillway.recipes.train.out_of_memory import is_out_of_memory, out_of_memory_error
            if is_out_of_memory(error):   # the user's settings, not a bug: name them
                raise out_of_memory_error(recipe, error, jax.default_backend()) from error
            raise
        finally:
            checkpointer.close()


def _train_owned(recipe: Recipe, run_dir: Path, checkpointer, *, main: bool, say, progress: bool,
                 stop_after: int | None, lock: RunLock, host_ram_gb: float | None = None) -> RunResult:
    # Imported here, not at module level: the train step (setup, make_train_step) must stay importable
    # where `datasets` or orbax are missing, e.g. by the GPU benchmark and the planner's compile process.
    from tqdm import tqdm

    from spillway.data import eval_batches, load_tokenizer, tokenizer_file_in
    from spillway.recipes.train.corpus_record import check_corpus
    from spillway.recipes.train import lora_state
    from spillway.recipes.train.sft_batch import batch_from_rows
    from spillway.recipes.train.data_pipeline import prepare, save_run_tokenizer, train_loader
    from spillway.recipes.train.finetune import with_source_tokenizer
    from spillway.recipes.train.init_weights import hf_checkpoint_dir, load_init_weights
    from spillway.recipes.train.resume import record_history, restore_for_resume, steps_to_try
    from spillway.recipes.train.tokenization_record import describe_kept_bos, recorded_bos

    cfg = recipe.train
    profile = _parse_profile(cfg.profile_steps)
    if recipe.checkpoint.init_from and hf_checkpoint_dir(recipe.checkpoint.init_from) is None:
        recipe = with_source_tokenizer(recipe, run_dir, resuming=cfg.resume and bool(checkpointer.all_steps()),
                                       say=say)
    candidates = steps_to_try(checkpointer, recipe)  # a recipe that cannot resume fails here, before data
    if candidates:   # a LoRA run's adapters resume only on their own base
        lora_state.check_same_base(recipe, checkpointer.read_recipe_json(candidates[0]),
                                   checkpointer.step_dir(candidates[0]))
    check_corpus(run_dir, recipe, resuming=bool(candidates), say=say)  # an edited corpus fails here too
    mesh = make_mesh(recipe.mesh.data, recipe.mesh.fsdp, recipe.mesh.tensor)
    if memory_of(recipe.offload.optimizer_state) == Memory.HOST:   # a split (host:N) too
        # Before anything is allocated: pinned memory the host cannot give fails here, not mid-init.
        pinned = pinned_host_bytes(recipe, mesh)
        check_host_memory(pinned.total, breakdown=pinned.describe())
    # Before data is prepared: the peak over the run's phases (state creation, step, checkpoint save,
    # restore), the pinned limit, and the save that fits: orbax's whole async one, or in pieces.
    phases = host_memory.check_run(abstract_setup(recipe, mesh, platform=jax.default_backend()),
                                   host_ram_bytes=None if host_ram_gb is None else int(host_ram_gb * 1e9), say=say,
                                   async_save=recipe.checkpoint.async_save)
    checkpointer.save_in_pieces = phases.save_in_pieces
    # A resumed run tokenizes with the tokenizer it trained with, never one retrained (corpus_record.py).
    own_tokenizer = tokenizer_file_in(run_dir) if candidates and not recipe.data.tokenizer else None
    # ... and with or without a BOS before each document, as it started (tokenization_record.py).
    kept_bos = recorded_bos(run_dir) if candidates else None

    say(f"recipe {recipe.name} ({recipe.family}): {recipe.num_params() / 1e6:.2f}M parameters, "
        f"activations: {recipe.offload.activations}, optimizer state: {recipe.offload.optimizer_state}")
    if recipe.data.mixture and recipe.data.source != DataConfig.source:
        say(f"warning: data.mixture is set, so data.source={recipe.data.source} is not read (a mixture replaces "
            f"it; list that source in the mixture to train on it)")
    t0 = time.perf_counter()
    tokenizer, data = prepare(recipe, load_tokenizer(own_tokenizer) if own_tokenizer is not None else None,
                              bos=kept_bos)
    if kept_bos is not None and (line := describe_kept_bos(tokenizer, kept_bos, recipe.data.add_bos)):
        say(line)
    say(f"data: {data.describe()} ({'cached' if data.from_cache else 'tokenized'}, "
        f"{time.perf_counter() - t0:.1f}s); tokenizer vocab {tokenizer.vocab_size}")

    s = setup(recipe, mesh)
    say(f"mesh: {dict(s.mesh.shape)} over {jax.device_count()} {jax.devices()[0].platform} device(s), "
        f"{jax.process_count()} process(es)")
    params = s.params
    if recipe.lora.enabled:
        # Checkpoints hold only the adapters: the frozen base is read from init_from at every start.
        params = lora_state.load_base(recipe, params, s.param_shardings, say)
        if main and not candidates:
            record_history(run_dir, "fine-tune", step=0, init_from=str(recipe.checkpoint.init_from))
    elif not candidates and recipe.checkpoint.init_from:
        # Before the optimizer state: its fp32 master copies of low-precision weights are made from these.
        params = load_init_weights(recipe, abstract_with_shardings(params, s.param_shardings), say)
        if main:
            record_history(run_dir, "fine-tune", step=0, init_from=str(recipe.checkpoint.init_from))
    # A resumed run's state comes from the checkpoint: made here too, it would be a second whole copy
    # in (pinned host) memory while the restore writes the first (benchmarks/host_memory_phases.py).
    opt_state = None if candidates else jax.jit(s.optimizer.init, out_shardings=s.opt_state_shardings)(params)
    loader = train_loader(data, recipe, jax.process_index(), jax.process_count())
    # Loss masks, example ids and positions of fine-tuning rows (or of text with data.document_mask).
    as_batch = functools.partial(batch_from_rows, document_mask=recipe.data.uses_document_mask,
                                 eos_id=tokenizer.eos_id)
    check_weights = make_weights_check(s.graphdef, s.mesh, loss_chunk=cfg.loss_chunk, grad_accum=cfg.grad_accum,
                                       param_shardings=s.param_shardings, batch_sharding=s.batch_sharding)

    def restored_weights_problem(restored: dict) -> str | None:
        # the weights against the batch the resumed run trains on first; the loader is put back after
        loader.restore(restored["loader_state"])
        first_local = next(loader)
        data.check_token_ids(first_local, recipe.model.vocab_size)  # a damaged cache, not diverged weights
        first_batch = _global_batch(as_batch(first_local), s.batch_sharding)
        loader.restore(restored["loader_state"])
        return check_weights(lora_state.with_restored(recipe, params, restored["params"]), first_batch).problem()

    # offload.update=next_forward: the optimizer update each step leaves for the next one's forward pass
    # (recipes/optim/update_in_forward.py); `settle` applies it before anything reads params or state.
    deferred = s.nothing_pending(params) if s.defers_update else None
    settled = True

    def settle() -> None:
        nonlocal params, opt_state, deferred, settled
        if not settled:
            params, opt_state, deferred = s.flush(params, opt_state, deferred)
            settled = True

    step = 0
    if candidates:
        resumed = restore_for_resume(
            checkpointer, recipe, candidates,
            abstract_params=lora_state.checkpointed(recipe, abstract_with_shardings(params, s.param_shardings)),
            abstract_opt_state=s.optimizer.saved_abstract_state(params, s.param_shardings),
            weights_problem=restored_weights_problem, say=say)
        # Checkpoints hold the state in saved form (one array per leaf); the
        # streamed host leaves go back to their two buffers.
        params, step = lora_state.with_restored(recipe, params, resumed.params), int(resumed.meta["step"])
        opt_state = s.optimizer.from_saved_form(resumed.opt_state, consume=True)
        loader.restore(resumed.loader_state)
        changes = "".join(f"; {field}: {before} -> {after}" for field, (before, after) in resumed.changed.items())
        say(f"resumed from {checkpointer.step_dir(resumed.step)} at step {step}{changes}")
        if main:
            record_history(run_dir, "resume", step=step, changed=resumed.changed, set_aside=resumed.set_aside)
    elif main and not recipe.checkpoint.init_from:
        record_history(run_dir, "start", step=0)

    def resume_hint() -> str:
        """Where a diverged run can resume from: only steps that were checked before they were saved."""
        steps = checkpointer.all_steps()
        if not steps:
            return ("no checkpoint was saved before it diverged, so a rerun starts over (lower the learning "
                    "rate first)")
        older = f"; an earlier one with --set train.resume_step=N (steps: {steps})" if len(steps) > 1 else ""
        return (f"step {steps[-1]} is intact ({checkpointer.step_dir(steps[-1])}): a rerun with a lower "
                f"optimizer.learning_rate resumes from it{older}")

    peeked = None  # the next batch, drawn early to check the weights of a save against it

    def checked(local_bt: np.ndarray) -> np.ndarray:
        # an id past the embedding is a damaged cache, not diverged weights (which is what it would look like)
        data.check_token_ids(local_bt, recipe.model.vocab_size)
        return as_batch(local_bt)

    def next_batch():
        nonlocal peeked
        batch, peeked = (peeked if peeked is not None else _global_batch(checked(next(loader)), s.batch_sharding)), None
        return batch

    def save(at_step: int, metrics) -> None:
        """Saves `at_step` (the caller decided it is due) unless its weights are diverged: then stops.

        The weights are checked against the next batch (divergence.py), drawn here and kept for the next
        step; the loader state saved is the one before it, so a resumed run draws that batch again."""
        nonlocal peeked
        lock.check(say)  # another run got into the directory: stop before writing a checkpoint over its own
        loader_state = loader.state()
        peeked = next_batch()
        problem = check_weights(params, peeked, metrics).problem()
        if problem is not None:
            raise NonFiniteLossError(f"the weights after step {at_step} are diverged ({problem}): not saved, "
                                     f"stopping; {resume_hint()}")
        # the state as it lies (LayerHalves too): the checkpointer writes it in saved form (checkpoint_io.py)
        checkpointer.save(at_step, params=lora_state.checkpointed(recipe, params),   # a LoRA run: its adapters
                          opt_state=opt_state, loader_state=loader_state,
                          meta={"step": at_step, "seed": cfg.seed, "tokens_seen": at_step * tokens_per_step},
                          recipe_json=recipe.to_json(), force=True)

    logger = RunLogger(run_dir, start_step=step, enabled=main)
    if main:
        save_run_tokenizer(tokenizer, run_dir, recipe)  # `spillway generate RUN_DIR` needs it (and the chat template)
    eval_step = jax.jit(make_eval_step(s.graphdef, s.mesh), in_shardings=(s.param_shardings, s.batch_sharding))
    tokens_per_step = cfg.global_batch * data.seq_len
    flops_per_step = model_flops_per_token(recipe.decoder_spec(), data.seq_len) * tokens_per_step
    peak_flops, peak_source = peak_flops_per_device()
    peak_total = peak_flops * jax.device_count()

    def validation_loss(val_rows) -> float:
        losses = []
        batches = eval_batches(val_rows, global_batch_size=cfg.global_batch,
                               process_index=jax.process_index(), process_count=jax.process_count())
        for _, local in zip(range(cfg.eval_batches), batches):
            losses.append(eval_step(params, _global_batch(checked(local), s.batch_sharding)))
        return float(np.mean([float(x) for x in losses])) if losses else float("nan")

    def validation_losses() -> dict[str, float]:
        """`val_loss`; for a mixture also `val_loss/<source>`, and `val_loss` is their weighted average
        (recipes/train/data_pipeline.py)."""
        per_source = {name: validation_loss(rows) for name, rows in data.validation_sets().items()}
        if not data.is_mixture:
            return {"val_loss": per_source[next(iter(per_source))]}
        mixed = sum(data.weights[name] * loss for name, loss in per_source.items())
        return {"val_loss": mixed, **{f"val_loss/{name}": loss for name, loss in per_source.items()}}

    def mixture_tokens() -> dict[str, float]:
        """Tokens trained on so far from each source of a mixture (all processes), for the metrics."""
        if not data.is_mixture:
            return {}
        return {f"tokens/{name}": taken * data.seq_len for name, taken in loader.state()["taken"].items()}

    first_step = step
    say(f"training steps {step}..{cfg.steps}: {tokens_per_step} tokens/step; MFU against {peak_source} "
        f"({peak_flops / 1e9:.0f} GFLOP/s per device)")
    bar = tqdm(total=cfg.steps, initial=step, disable=not (main and progress), unit="step", dynamic_ncols=True)
    pending = None  # (step, metrics on device) of the previous step: checked one step late, keeps dispatch async
    warned_unbalanced = False
    window_start, window_steps = time.perf_counter(), 0
    with StopSignals(echo=(lambda text: bar.write(text)) if main else (lambda text: None)) as signals:
        group_stop = GroupStop(signals, s.mesh)
        try:
            while step < cfg.steps:
                if profile and step == profile[0] and main:
                    jax.profiler.start_trace(str(run_dir / "profile"))
                if deferred is None:
                    params, opt_state, metrics = s.train_step(params, opt_state, next_batch())
                else:
                    params, opt_state, deferred, metrics = s.train_step(params, opt_state, deferred, next_batch())
                    settled = False
                step += 1
                window_steps += 1
                lock.check(bar.write if main else None)  # metrics and checkpoints are written below
                if profile and step == profile[1] and main:
                    jax.block_until_ready(params)
                    jax.profiler.stop_trace()
                    say(f"profile of steps {profile[0]}..{profile[1]} written to {run_dir / 'profile'}")
                if pending is not None:
                    check_finite(pending[0], float(pending[1]["loss"]), resume_hint())
                pending = (step, metrics)
                checkpointer.raise_if_save_failed()  # a failed async save stops the run here, not a save later
                if step % cfg.log_every == 0 or step == cfg.steps:
                    loss = float(metrics["loss"])
                    check_finite(step, loss, resume_hint())
                    elapsed = time.perf_counter() - window_start
                    step_time = elapsed / window_steps
                    row = {"loss": loss, "grad_norm": float(metrics["grad_norm"]),
                           "learning_rate": float(metrics["learning_rate"]),
                           "tokens_per_s": tokens_per_step / step_time, "step_time_s": step_time,
                           "mfu": flops_per_step / step_time / peak_total}
                    memory = device_memory_in_use()
                    if memory is not None:
                        row["memory_gib"] = memory / 2**30
                    row.update(mixture_tokens())
                    row.update(aux_terms.logged(metrics.get(aux_terms.AUX_METRICS, {})))
                    if not warned_unbalanced and aux_terms.router_keys(row) and not recipe.aux_loss.load_balancing:
                        warned_unbalanced = True
                        bar.write("warning: the model routes tokens to experts and aux_loss.load_balancing is 0: "
                                  "nothing keeps the experts' load balanced (Mixtral trains with 0.02, Qwen3-MoE "
                                  "with 0.001)") if main else None
                    logger.log(step, row)
                    bar.set_postfix({"loss": f"{loss:.3f}", **aux_terms.progress(row),
                                     "tok/s": f"{row['tokens_per_s']:.0f}",
                                     "mfu": f"{row['mfu']:.1%}", "step": f"{step_time * 1e3:.0f}ms",
                                     **({"mem": f"{row['memory_gib']:.1f}G"} if memory is not None else {})})
                    window_start, window_steps = time.perf_counter(), 0
                if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                    settle()
                    vals = validation_losses()
                    logger.log(step, vals)
                    per_source = "".join(f", {key.removeprefix('val_loss/')} {value:.4f}"
                                         for key, value in vals.items() if key != "val_loss")
                    bar.write(f"step {step}: train loss {float(metrics['loss']):.4f}, validation loss "
                              f"{vals['val_loss']:.4f}{per_source}") if main else None
                    window_start, window_steps = time.perf_counter(), 0
                stop_status = group_stop.poll()  # every process gets the same answer at the same step
                leave_early = stop_after is not None and step - first_step >= stop_after and step < cfg.steps
                # the last step is always saved, whatever the period, and so is a step the run stops at
                if checkpointer.should_save(step) or step == cfg.steps or leave_early or stop_status:
                    settle()
                    save(step, metrics)
                bar.update(1)
                if leave_early:
                    say(f"stopping after {stop_after} steps at step {step} (checkpoint saved)")
                    break
                if stop_status:
                    checkpointer.wait()
                    bar.write(f"{signal_name(stop_status)}: saved step {step} "
                              f"({checkpointer.step_dir(step)}), stopping") if main else None
                    raise SystemExit(stop_status)
        finally:
            bar.close()
            if sys.exc_info()[1] is None:
                logger.close()
            else:   # a failure in flight (a full disk, say) is the error to report, not this flush's
                with contextlib.suppress(OSError):
                    logger.close()
    checkpointer.wait()
    settle()

    plot = logger.plot_loss()
    if plot:
        say(f"loss curve: {plot}; metrics: {run_dir / 'metrics.jsonl'}; TensorBoard: {run_dir / 'tb'}")
    elif main and not logger.metrics_path.is_file():
        say(f"warning: {logger.metrics_path} was deleted while the run wrote it: no loss curve (the checkpoints "
            f"are saved; TensorBoard: {run_dir / 'tb'})")
    load_plot = logger.plot_expert_load()   # None for a model without MoE layers
    if load_plot:
        say(f"expert load: {load_plot}")

    model = nnx.merge(s.graphdef, params)
    sample = None
    if main and cfg.sample_tokens > 0:
        # a prompt starts as the documents the model trained on did: with the BOS, if they had one
        prefix = tokenizer.document_prefix()
        prompt_ids = prefix + tokenizer.encode([cfg.sample_prompt])[0] or [tokenizer.eos_id]
        room = recipe.model.max_seq_len - len(prompt_ids)
        new_ids = generate(model, prompt_ids, max_new_tokens=min(cfg.sample_tokens, room), temperature=0.8,
                           top_p=0.95, seed=cfg.seed, stop_id=tokenizer.eos_id)
        sample = tokenizer.decode(prompt_ids[len(prefix):] + new_ids)   # the text, without the BOS put first
        say("sample:\n" + "-" * 60 + "\n" + sample + "\n" + "-" * 60)
    # Process 0 did extra work above; leave together, or jax.distributed's shutdown barrier can time out.
    distributed.barrier("spillway-train-end")
    return RunResult(run_dir, step, logger.history, sample, model, tokenizer)
