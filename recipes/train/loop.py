"""The train loop, as its phases: checks, data, state built or restored, the steps, the finish.

    checks        train(): every setting a user can get wrong, once, before anything is written
                  (the run's inputs, the attention kernel on this backend, aux_loss coefficients);
                  a LoRA run's base pinned to the step folder init_from names (lora_state.py)
    run directory the run lock (run_lock.py), checkpoints writable there (checkpoint.py)
    before data   which step to resume from and may this recipe resume it (resume.py; a LoRA run
                  only on its own base), the corpus the run trained on (corpus_record.py), a
                  fine-tune's tokenizer (finetune.py)
    host checks   before data: the mesh, the run's host memory per phase (host_memory.py; a split
                  host:N state too) and the save that fits (orbax's whole async one, or in pieces)
    data          tokenizer and packed rows (run_data.py, data_pipeline.py); the batches (batch.BatchFeed)
    setup         the model in its shards and the jitted step (step.py), the programs the loop runs
                  (run_state.StepPrograms)
    state         built, a fine-tune's weights, or restored (run_state.initial_state; a LoRA run's
                  base read from init_from at every start, its checkpoints the adapters)
    steps         one step, then the parts that decide themselves whether they run
                  (loop_parts.py: loss check, progress, validation, stopping, saving, profile)
    finish        plots, the model, a text sample

Inside the loop, a step is saved only after its weights pass divergence.py's
check; the last step is always saved; SIGTERM and Ctrl-C save at the step
boundary (preemption.py); an async save that fails stops the run at the next
step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import jax
from flax import nnx

from spillway.layers.memory import Memory
from spillway.layers.mesh import replicated_micro_batch
from spillway.layers.residency import memory_of
from spillway.layers.sharding import make_mesh
from spillway.recipes.train.base_generation import base_stop_ids, keep_base_config, keep_base_generation
from spillway.recipes.config import Recipe
from spillway.recipes.optim.host_memory import check_host_memory
from spillway.recipes.sampling import generate
from spillway.recipes.train import distributed, gpu_allocators, host_memory
from spillway.recipes.train.errors import RunError
from spillway.recipes.train.loop_parts import LossWatch, Profile, Progress, Saving, Stopping, Validation
from spillway.recipes.train.metrics import METRICS_FILENAME, RunLogger
from spillway.recipes.train.preemption import GroupStop, StopSignals
from spillway.recipes.train.run_data import prepare_run_data
from spillway.recipes.train.run_identity import keep_run_identity
from spillway.recipes.train.run_lock import RunLock, RunLockedError
from spillway.recipes.train.run_state import (RunState, StepPrograms, initial_state, step_programs,
                                              weights_from_elsewhere)
from spillway.recipes.train.step import MeshWarning, TrainSetup, abstract_setup, pinned_bytes_of_setup, setup


@dataclasses.dataclass
class RunResult:
    run_dir: Path
    final_step: int
    history: list
    sample: str | None
    model: object
    tokenizer: object


@contextlib.contextmanager
def _gone_if_nothing_trained(run_dir: Path, main: bool):
    """A run folder this call made is removed again when the run fails before anything of it is worth keeping:
    no step saved, no step logged (a validation set smaller than a batch, a corpus that does not tokenize, a
    Ctrl-C while preparing data). It left checkpoints/ empty and a corpus.json that looked like a run. A folder
    that was there before is never touched, nor one with several processes writing to it."""
    made_here = main and jax.process_count() == 1 and not run_dir.exists()
    try:
        yield
    except BaseException:
        if made_here and _nothing_trained(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def _nothing_trained(run_dir: Path) -> bool:
    from spillway.recipes.train.checkpoint import CHECKPOINTS_DIRNAME, finalised_step_dirs
    from spillway.recipes.train.run_lock import LOCK_FILENAME

    if (run_dir / LOCK_FILENAME).exists():   # ours is released by now: another run took the folder, it is its own
        return False
    checkpoints = run_dir / CHECKPOINTS_DIRNAME
    metrics = run_dir / METRICS_FILENAME
    return ((not checkpoints.is_dir() or not finalised_step_dirs(checkpoints))
            and (not metrics.exists() or metrics.stat().st_size == 0))


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
          host_ram_gb: float | None = None, programs: Callable[[TrainSetup], StepPrograms] = step_programs
          ) -> RunResult:
    """Run (or resume) the recipe. `stop_after`: leave after that many steps of this invocation, with a
    checkpoint, as a time-limited job would; the next call resumes. `host_ram_gb`: the host RAM to check
    the run's host memory peak against (default: the machine's; above it, a warning). `programs`: what
    makes the device programs the loop runs from the setup (run_state.step_programs; a test's stand-in
    runs the loop's policy without compiling a step).

    Failures a user can fix raise RunError subclasses with one-line messages; SIGTERM and Ctrl-C save the
    step in progress and raise SystemExit(143 or 130) (recipes/train/preemption.py).
    """
    from spillway.recipes.train.checkpoint import CHECKPOINTS_DIRNAME, RunCheckpointer

    named_base = recipe.checkpoint.init_from   # as the command named it: a LoRA resume keeps its started base
    recipe, main, say = run_checks(recipe, echo, host_ram_gb)
    run_dir = Path(recipe.run_dir)
    with _gone_if_nothing_trained(run_dir, main), _owned_run_dir(run_dir, main, say) as lock:
        # opening checks that checkpoints can be written there: before any data is prepared
        checkpointer = RunCheckpointer(run_dir / CHECKPOINTS_DIRNAME, keep=recipe.checkpoint.keep,
                                       every_steps=recipe.checkpoint.every_steps,
                                       async_save=recipe.checkpoint.async_save)
        try:
            return _train_owned(recipe, run_dir, checkpointer, lock, programs, main=main, say=say,
                                progress=progress, stop_after=stop_after, host_ram_gb=host_ram_gb,
                                named_base=named_base)
        except Exception as error:
            from spillway.recipes.train.out_of_memory import is_out_of_memory, out_of_memory_error
            if is_out_of_memory(error):   # the user's settings, not a bug: name them
                raise out_of_memory_error(recipe, error, jax.default_backend()) from error
            raise
        finally:
            checkpointer.close()


def run_checks(recipe: Recipe, echo, host_ram_gb: float | None):
    """(recipe, is this process 0, its `say`): every check that needs no run directory, once each,
    before anything is written or any data prepared."""
    from spillway.recipes.train import lora_state
    from spillway.recipes.train.checkpoint_dirs import check_not_inside_a_runs_steps
    from spillway.recipes.train.finetune import check_not_its_own_source
    from spillway.recipes.train.init_weights import check_hf_tensors, resolve_init_from
    from spillway.recipes.train.preflight import check_base_model_first, check_run_inputs
    from spillway.recipes.train.sft_preflight import check_fine_tuning_inputs
    from spillway.recipes.train.step import check_attention_backend, check_aux_loss

    if host_ram_gb is not None and not host_ram_gb > 0:
        from spillway.layers.errors import ConfigError
        raise ConfigError(f"--host-ram-gb must be positive, got {host_ram_gb}")
    # A base (hf: or a run's step) that is not there: one line with every other missing input, before the
    # model's shapes are traced for the pinned limit below (seconds for a large model, wasted on a typo).
    check_base_model_first(recipe)
    # Before anything starts the GPU backend: the pinned limit from the run's pinned peak (shapes only).
    gpu_allocators.configure(pinned_need_bytes=host_memory.pinned_need_of_recipe(recipe))
    distributed.maybe_initialize()
    main = distributed.is_main_process()
    say = echo if main else (lambda *a, **k: None)
    distributed.check_same_recipe(recipe.to_dict())  # all processes train one run, or none does
    recipe = resolve_init_from(recipe, say)  # an hf: checkpoint must be this model (it brings its tokenizer)
    check_hf_tensors(recipe)  # ... and hold its tensors, named and shaped as the model's: before data is prepared
    check_not_its_own_source(recipe)  # init_from == checkpoint.dir: say so, not a tokenizer mismatch later
    check_not_inside_a_runs_steps(recipe.run_dir)  # another run's checkpoints/ or step folder: not written into
    recipe = lora_state.pin_base(recipe)  # a LoRA run's base: the step folder init_from names now
    check_run_inputs(recipe)  # a missing corpus or tokenizer: one line now, before the run directory is taken
    check_fine_tuning_inputs(recipe)  # chat/instruct on a text corpus, document masks cuDNN cannot apply
    check_attention_backend(recipe.execution.attention_impl, jax.default_backend())
    check_aux_loss(recipe)  # a coefficient that would weight nothing (one abstract trace, only when one is set)
    return recipe, main, say


def _train_owned(recipe: Recipe, run_dir: Path, checkpointer, lock: RunLock, programs, *, main: bool, say,
                 progress: bool, stop_after: int | None, host_ram_gb: float | None,
                 named_base: str | None = None) -> RunResult:
    from spillway.recipes.train.batch import BatchFeed
    from spillway.recipes.train.data_pipeline import save_run_tokenizer, train_loader
    from spillway.recipes.train.sft_batch import batch_from_rows

    recipe, candidates, own_tokenizer, kept_bos, record_corpus_now = _before_data(recipe, run_dir, checkpointer,
                                                                                  say, named_base)
    mesh = _host_checks(recipe, checkpointer, host_ram_gb, say)
    tokenizer, data = prepare_run_data(recipe, own_tokenizer, kept_bos, say, resuming=bool(candidates))
    s = _build_setup(recipe, mesh, say, initialise=not weights_from_elsewhere(recipe, candidates))
    # Loss masks, example ids and positions of fine-tuning rows (or of text with data.document_mask).
    as_batch = functools.partial(batch_from_rows, document_mask=recipe.data.uses_document_mask,
                                 eos_id=tokenizer.eos_id)
    feed = BatchFeed(data, train_loader(data, recipe, jax.process_index(), jax.process_count()),
                     recipe.model.vocab_size, s.batch_sharding, as_batch)
    state = initial_state(s, programs(s), feed, checkpointer, candidates, run_dir=run_dir, main=main, say=say)
    if record_corpus_now:   # a resume without corpus.json: recorded once its data position was read
        from spillway.recipes.train.corpus_record import record_corpus
        record_corpus(run_dir, recipe)
    logger = RunLogger(run_dir, start_step=state.step, enabled=main)
    if main:
        save_run_tokenizer(tokenizer, run_dir, recipe)  # `spillway generate RUN_DIR` needs it (and the chat template)
        keep_base_generation(recipe, run_dir, tokenizer.vocab_size)   # the base's stop ids, kept with the run
        keep_base_config(recipe, run_dir)   # what an adapter export reads of the base, which may go
    _run_steps(recipe, run_dir, s, state, feed, checkpointer, logger, lock, main=main, say=say, progress=progress,
               stop_after=stop_after)
    checkpointer.wait()
    state.settle()
    return _finish(recipe, run_dir, s, state, logger, tokenizer, main=main, say=say)


def _before_data(recipe: Recipe, run_dir: Path, checkpointer, say, named_base: str | None = None):
    """(recipe, the steps to try resuming from, the tokenizer file a resumed run keeps or None, the BOS rule
    it keeps or None, whether to record the corpus once resumed): what the run directory says, checked before
    any data is prepared. `named_base`: the
    checkpoint.init_from the command named, before a LoRA run's pin (lora_state.keep_started_base)."""
    # Imported here, not at module level: the train step (setup, make_train_step) must stay importable
    # where `datasets` or orbax are missing, e.g. by the GPU benchmark and the planner's compile process.
    from spillway.recipes.train import lora_state
    from spillway.recipes.train.checkpoint import CorruptCheckpointError
    from spillway.recipes.train.corpus_record import check_corpus
    from spillway.recipes.train.finetune import keep_started_source, with_source_tokenizer
    from spillway.recipes.train.init_weights import hf_checkpoint_dir
    from spillway.recipes.train.resume import steps_to_try
    from spillway.recipes.train.tokenization_record import kept_tokenizer_file, recorded_bos

    steps = checkpointer.all_steps() if recipe.train.resume else []
    resuming = bool(steps)
    if resuming and not recipe.checkpoint.init_from:   # a fine-tune resumed without naming its source again
        try:
            recipe = keep_started_source(recipe, checkpointer.read_recipe_json(steps[-1]))
        except CorruptCheckpointError:
            pass   # a step without its recipe: the restore sets it aside and tries the one before
    if recipe.checkpoint.init_from and hf_checkpoint_dir(recipe.checkpoint.init_from) is None:
        recipe = with_source_tokenizer(recipe, run_dir, resuming=resuming, say=say)
    candidates = steps_to_try(checkpointer, recipe)  # a recipe that cannot resume fails here, before data
    if candidates and recipe.lora.enabled:   # a LoRA run's adapters resume only on their own base
        try:
            saved = checkpointer.read_recipe_json(candidates[0])
        except CorruptCheckpointError:
            saved = None   # a step without its recipe: the restore sets it aside and tries the one before
        if saved is not None:
            recipe = lora_state.keep_started_base(recipe, named_base, saved)
            lora_state.check_same_base(recipe, saved, checkpointer.step_dir(candidates[0]))
    if jax.process_index() == 0:
        keep_run_identity(run_dir)   # what its exports and its base's pin record of it, wherever the folder goes
        if recipe.lora.enabled and recipe.checkpoint.init_from:
            from spillway.recipes.train.base_pins import record_pin
            record_pin(recipe.checkpoint.init_from, run_dir, say)   # the base run's retention keeps that step
    # an edited corpus fails here too; a resume without a record records it once resumed (True)
    record_corpus_now = check_corpus(run_dir, recipe, resuming=bool(candidates), say=say)
    # A resumed run tokenizes with the tokenizer it trained with, never one retrained (corpus_record.py): its
    # copy in the run folder, also where the tokenizer it names is gone (an hf: base removed: preflight.py).
    own_tokenizer = kept_tokenizer_file(run_dir, recipe.data.tokenizer) if candidates else None
    # ... and with or without a BOS before each document, as it started (tokenization_record.py).
    kept_bos = recorded_bos(run_dir) if candidates else None
    return recipe, candidates, own_tokenizer, kept_bos, record_corpus_now


def _host_checks(recipe: Recipe, checkpointer, host_ram_gb: float | None, say):
    """The mesh, after the host memory checks, before data is prepared and anything is allocated: pinned
    memory the host cannot give (host state, a split host:N too), the peak over the run's phases (state
    creation, step, checkpoint save, restore) against the RAM, and the save that fits: orbax's whole async
    one, or in pieces (the checkpointer is set to it)."""
    mesh = make_mesh(recipe.mesh)
    abstract = abstract_setup(recipe, mesh, platform=jax.default_backend())
    if memory_of(recipe.offload.optimizer_state) == Memory.HOST:
        pinned = pinned_bytes_of_setup(abstract)
        check_host_memory(pinned.total, breakdown=pinned.describe())
    phases = host_memory.check_run(abstract, host_ram_bytes=None if host_ram_gb is None else int(host_ram_gb * 1e9),
                                   say=say, async_save=recipe.checkpoint.async_save)
    checkpointer.save_in_pieces = phases.save_in_pieces
    return mesh


def _build_setup(recipe: Recipe, mesh, say, initialise: bool = True) -> TrainSetup:
    """The model in its shards (or, `initialise=False`, its targets only) and the step, on `mesh` (checked by
    `_host_checks`)."""
    with warnings.catch_warnings(record=True) as caught:   # (the others as the filters in force say)
        warnings.simplefilter("always", MeshWarning)
        s = setup(recipe, mesh, initialise=initialise)
    say(f"mesh: {dict(s.mesh.shape)} over {jax.device_count()} {jax.devices()[0].platform} device(s), "
        f"{jax.process_count()} process(es)")
    for warning in caught:   # the mesh's own warning said as the run's other lines are, not with a source line
        if issubclass(warning.category, MeshWarning):
            say(f"warning: {warning.message}")
        else:
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    if (line := replicated_micro_batch(dict(s.mesh.shape), recipe.train.global_batch, recipe.train.grad_accum)):
        say(line)
    return s


def _run_steps(recipe: Recipe, run_dir: Path, s: TrainSetup, state: RunState, feed, checkpointer, logger,
               lock: RunLock, *, main: bool, say, progress: bool, stop_after: int | None) -> None:
    """The steps from `state.step` to train.steps (or a stop), each followed by the parts of loop_parts.py."""
    from tqdm import tqdm

    cfg = recipe.train
    nothing_to_train = state.step >= cfg.steps
    if nothing_to_train:   # "training steps 10..5" read as a run going backwards; said before a bar is drawn
        say(f"nothing to train: the run is at step {state.step} and train.steps is {cfg.steps} (raise "
            f"train.steps to train on)")
    bar = tqdm(total=cfg.steps, initial=state.step, disable=not (main and progress) or nothing_to_train,
               unit="step", dynamic_ncols=True)
    write = bar.write if main else (lambda text: None)
    progress_log = Progress(recipe, feed, logger, bar, checkpointer, main=main)
    if not nothing_to_train:
        say(f"training steps {state.step}..{cfg.steps}: {progress_log.tokens_per_step} tokens/step; MFU against "
            f"{progress_log.peak_source} ({progress_log.peak_flops / 1e9:.0f} GFLOP/s per device)")
    losses, profile = LossWatch(checkpointer), Profile(recipe, run_dir, main=main, say=say)
    validation = Validation(recipe, feed, logger, write)
    saving = Saving(recipe, checkpointer, feed, lock, say, progress_log.tokens_per_step)
    with StopSignals(echo=write) as signals, _closing(bar, logger):
        stopping = Stopping(GroupStop(signals, s.mesh), stop_after=stop_after, first_step=state.step,
                            last_step=cfg.steps)
        progress_log.restart_window()
        while state.step < cfg.steps:
            profile.before_step(state.step)
            metrics = state.advance(feed.next())
            lock.check(bar.write if main else None)  # metrics and checkpoints are written below
            profile.after_step(state)
            losses.after_step(state.step, metrics)
            checkpointer.raise_if_save_failed()  # a failed async save stops the run here, not a save later
            progress_log.after_step(state.step, metrics)
            if validation.after_step(state, metrics):
                progress_log.restart_window()
            stopping.after_step(state.step)
            if saving.after_step(state, metrics, stopping=stopping.requested):
                stopping.after_save(state.step)
            bar.update(1)
            if stopping.leave(state.step, checkpointer, write):
                break
    if (line := stopping.left_early_line(state.step)) is not None:
        say(line)


@contextlib.contextmanager
def _closing(bar, logger):
    """Closes the progress bar and the logger; a failure in flight (a full disk, say) is the error to report,
    not the logger's flush."""
    try:
        yield
    except BaseException:
        bar.close()
        with contextlib.suppress(OSError):
            logger.close()
        raise
    bar.close()
    logger.close()


def _finish(recipe: Recipe, run_dir: Path, s: TrainSetup, state: RunState, logger, tokenizer, *, main: bool,
            say) -> RunResult:
    """The plots, the trained model and (process 0, train.sample_tokens > 0) a text sample from it."""
    plot = logger.plot_loss()
    if plot:
        say(f"loss curve: {plot}; metrics: {run_dir / METRICS_FILENAME}; TensorBoard: {run_dir / 'tb'}")
    elif main and logger.wrote_rows and not logger.metrics_path.is_file():
        say(f"warning: {logger.metrics_path} was deleted while the run wrote it: no loss curve (the checkpoints "
            f"are saved; TensorBoard: {run_dir / 'tb'})")
    load_plot = logger.plot_expert_load()   # None for a model without MoE layers
    if load_plot:
        say(f"expert load: {load_plot}")
    model = nnx.merge(s.graphdef, state.params)
    cfg = recipe.train
    sample = None
    if main and cfg.sample_tokens > 0 and jax.process_count() > 1:
        # the weights are sharded over every process's devices: process 0 alone could not compute with them
        # (it waited for the others forever, which waited at the barrier below)
        say(f"sample: none in a run of {jax.process_count()} processes; one process samples the saved step: "
            f"spillway generate {run_dir}")
    elif main and cfg.sample_tokens > 0:
        from spillway.recipes.train.chat_prompt import chat_prompt, text_prompt
        chat = recipe.data.format != "text"
        if chat:   # a chat/instruct run answers train.sample_prompt as a user's message
            prefix, (prompt_ids, stop_ids) = [], chat_prompt(run_dir, recipe, tokenizer, cfg.sample_prompt)
            heading = f"sample (the answer to {cfg.sample_prompt!r}, through the chat template):"
        else:   # a prompt starts as the documents the model trained on did: with the BOS, if they had one
            (prefix, prompt_ids, stop_ids), heading = text_prompt(run_dir, tokenizer, cfg.sample_prompt), "sample:"
        room = recipe.model.max_seq_len - len(prompt_ids)
        if room <= 0:
            say(f"sample: none, train.sample_prompt is {len(prompt_ids)} tokens and model.max_seq_len "
                f"{recipe.model.max_seq_len}")
        else:
            stop_ids = (*stop_ids, *base_stop_ids(recipe, run_dir, tokenizer))   # as its export stops
            new_ids = generate(model, prompt_ids, max_new_tokens=min(cfg.sample_tokens, room), temperature=0.8,
                               top_p=0.95, seed=cfg.seed, stop_id=tokenizer.eos_id, stop_ids=stop_ids,
                               vocab_limit=tokenizer.vocab_size)
            sample = (tokenizer.decode(new_ids).strip() if chat
                      else tokenizer.decode(prompt_ids[len(prefix):] + new_ids))   # the text, without the BOS first
            say(heading + "\n" + "-" * 60 + "\n" + sample + "\n" + "-" * 60)
    # Process 0 did extra work above; leave together, or jax.distributed's shutdown barrier can time out.
    distributed.barrier("spillway-train-end")
    return RunResult(run_dir, state.step, logger.history, sample, model, tokenizer)
