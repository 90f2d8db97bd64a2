"""The train loop: data, the sharded step, progress, validation, checkpoints, a sample at the end.

    recipe -> data (tokenizer, packed rows, loader) -> mesh -> model and
    optimizer state created in their shards -> the jitted step (step.py) ->
    loop (progress, validation, checkpoints, profile) -> a text sample.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from spillway.recipes.config import Recipe
from spillway.recipes.plan.flops import model_flops_per_token
from spillway.recipes.sampling import generate
from spillway.recipes.train import distributed
from spillway.recipes.train.metrics import RunLogger, check_finite, device_memory_in_use, peak_flops_per_device
from spillway.recipes.train.optimizer import check_host_memory
from spillway.recipes.train.step import abstract_with_shardings, make_eval_step, setup


def _global_batch(local_bt: np.ndarray, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_process_local_data(sharding, np.asarray(local_bt, np.int32))


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


class _StopRequested:
    """SIGTERM sets a flag; the loop saves at the next step boundary and exits (no save mid-step)."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        def handler(signum, frame):
            self.requested = True
        try:
            self._previous = signal.signal(signal.SIGTERM, handler)
        except ValueError:  # not the main thread: no handler, no graceful stop
            self._previous = None
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def train(recipe: Recipe, *, echo=print, progress: bool = True, stop_after: int | None = None) -> RunResult:
    """Run (or resume) the recipe. `stop_after`: leave after that many steps of this invocation, with a
    checkpoint, as a time-limited job would; the next call resumes."""
    # Imported here, not at module level: the train step (setup, make_train_step) must stay importable
    # where `datasets` or orbax are missing, e.g. by the GPU benchmark and the planner's compile process.
    from tqdm import tqdm

    from spillway.data import eval_batches
    from spillway.recipes.train.checkpoint import SIGTERM_EXIT_STATUS, RunCheckpointer, restore_params_only
    from spillway.recipes.train.data_pipeline import prepare, train_loader

    distributed.maybe_initialize()
    main = distributed.is_main_process()
    say = echo if main else (lambda *a, **k: None)
    cfg = recipe.train
    profile = _parse_profile(cfg.profile_steps)

    say(f"recipe {recipe.name} ({recipe.family}): {recipe.num_params() / 1e6:.2f}M parameters, "
        f"activations: {recipe.offload.activations}, optimizer state: {recipe.offload.optimizer_state}")
    t0 = time.perf_counter()
    tokenizer, packed = prepare(recipe)
    say(f"data: {packed.train.shape[0]} train rows, {packed.val.shape[0]} val rows of {packed.seq_len + 1} tokens "
        f"({'cached' if packed.from_cache else 'tokenized'}, {time.perf_counter() - t0:.1f}s); "
        f"tokenizer vocab {tokenizer.vocab_size}")

    s = setup(recipe)
    say(f"mesh: {dict(s.mesh.shape)} over {jax.device_count()} {jax.devices()[0].platform} device(s), "
        f"{jax.process_count()} process(es)")
    if recipe.offload.optimizer_state == "host":
        # Before allocating: pinned memory the host cannot give fails here, not mid-init.
        check_host_memory(s.optimizer.host_bytes(s.optimizer.abstract_state(s.params, s.param_shardings)))
    opt_state = jax.jit(s.optimizer.init, out_shardings=s.opt_state_shardings)(s.params)
    params = s.params
    loader = train_loader(packed, recipe, jax.process_index(), jax.process_count())

    run_dir = Path(recipe.run_dir)
    checkpointer = RunCheckpointer(run_dir / "checkpoints", keep=recipe.checkpoint.keep,
                                   every_steps=recipe.checkpoint.every_steps,
                                   async_save=recipe.checkpoint.async_save)
    step = 0
    latest = checkpointer.latest_step() if cfg.resume else None
    if latest is not None:
        restored = checkpointer.restore(
            latest, abstract_params=abstract_with_shardings(params, s.param_shardings),
            abstract_opt_state=s.optimizer.saved_abstract_state(s.params, s.param_shardings))
        # Checkpoints hold the state in saved form (one array per leaf); the
        # streamed host leaves go back to their two buffers.
        params, opt_state = restored["params"], s.optimizer.from_saved_form(restored["opt_state"])
        loader.restore(restored["loader_state"])
        step = int(restored["meta"]["step"])
        say(f"resumed from {run_dir / 'checkpoints'} at step {step}")
    elif recipe.checkpoint.init_from:
        params, meta = restore_params_only(recipe.checkpoint.init_from,
                                           abstract_with_shardings(params, s.param_shardings))
        say(f"fine-tuning from {recipe.checkpoint.init_from} (weights of step {meta.get('step')}); "
            f"fresh optimizer state and schedule")

    def save(at_step: int, force: bool = False):
        checkpointer.save(at_step, params=params, opt_state=s.optimizer.saved_form(opt_state),
                          loader_state=loader.state(),
                          meta={"step": at_step, "seed": cfg.seed, "tokens_seen": at_step * tokens_per_step},
                          recipe_json=recipe.to_json(), force=force)

    logger = RunLogger(run_dir, enabled=main)
    if main:
        tokenizer.save(run_dir / "tokenizer.model")  # `spillway generate RUN_DIR` needs it
    eval_step = jax.jit(make_eval_step(s.graphdef, s.mesh), in_shardings=(s.param_shardings, s.batch_sharding))
    tokens_per_step = cfg.global_batch * packed.seq_len
    flops_per_step = model_flops_per_token(recipe.decoder_spec(), packed.seq_len) * tokens_per_step
    peak_flops, peak_source = peak_flops_per_device()
    peak_total = peak_flops * jax.device_count()

    def validation_loss() -> float:
        losses = []
        batches = eval_batches(packed.val, global_batch_size=cfg.global_batch,
                               process_index=jax.process_index(), process_count=jax.process_count())
        for _, local in zip(range(cfg.eval_batches), batches):
            losses.append(eval_step(params, _global_batch(local, s.batch_sharding)))
        return float(np.mean([float(x) for x in losses])) if losses else float("nan")

    first_step = step
    say(f"training steps {step}..{cfg.steps}: {tokens_per_step} tokens/step; MFU against {peak_source} "
        f"({peak_flops / 1e9:.0f} GFLOP/s per device)")
    bar = tqdm(total=cfg.steps, initial=step, disable=not (main and progress), unit="step", dynamic_ncols=True)
    pending = None  # (step, metrics on device) of the previous step: checked one step late, keeps dispatch async
    window_start, window_steps = time.perf_counter(), 0
    with _StopRequested() as stop:
        try:
            while step < cfg.steps:
                if profile and step == profile[0] and main:
                    jax.profiler.start_trace(str(run_dir / "profile"))
                batch = _global_batch(next(loader), s.batch_sharding)
                params, opt_state, metrics = s.train_step(params, opt_state, batch)
                step += 1
                window_steps += 1
                if profile and step == profile[1] and main:
                    jax.block_until_ready(params)
                    jax.profiler.stop_trace()
                    say(f"profile of steps {profile[0]}..{profile[1]} written to {run_dir / 'profile'}")
                if pending is not None:
                    check_finite(pending[0], float(pending[1]["loss"]))
                pending = (step, metrics)
                if step % cfg.log_every == 0 or step == cfg.steps:
                    loss = float(metrics["loss"])
                    check_finite(step, loss)
                    elapsed = time.perf_counter() - window_start
                    step_time = elapsed / window_steps
                    row = {"loss": loss, "grad_norm": float(metrics["grad_norm"]),
                           "learning_rate": float(metrics["learning_rate"]),
                           "tokens_per_s": tokens_per_step / step_time, "step_time_s": step_time,
                           "mfu": flops_per_step / step_time / peak_total}
                    memory = device_memory_in_use()
                    if memory is not None:
                        row["memory_gib"] = memory / 2**30
                    logger.log(step, row)
                    bar.set_postfix({"loss": f"{loss:.3f}", "tok/s": f"{row['tokens_per_s']:.0f}",
                                     "mfu": f"{row['mfu']:.1%}", "step": f"{step_time * 1e3:.0f}ms",
                                     **({"mem": f"{row['memory_gib']:.1f}G"} if memory is not None else {})})
                    window_start, window_steps = time.perf_counter(), 0
                if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                    val = validation_loss()
                    logger.log(step, {"val_loss": val})
                    bar.write(f"step {step}: train loss {float(metrics['loss']):.4f}, validation loss {val:.4f}") \
                        if main else None
                    window_start, window_steps = time.perf_counter(), 0
                if checkpointer.should_save(step) or step == cfg.steps:
                    save(step)
                bar.update(1)
                if stop_after is not None and step - first_step >= stop_after and step < cfg.steps:
                    save(step, force=True)
                    say(f"stopping after {stop_after} steps at step {step} (checkpoint saved)")
                    break
                if stop.requested:
                    bar.write(f"SIGTERM: saving step {step} and stopping") if main else None
                    save(step, force=True)
                    checkpointer.wait()
                    raise SystemExit(SIGTERM_EXIT_STATUS)
        finally:
            bar.close()
            checkpointer.wait()
            checkpointer.close()
            logger.close()

    plot = logger.plot_loss()
    if plot:
        say(f"loss curve: {plot}; metrics: {run_dir / 'metrics.jsonl'}; TensorBoard: {run_dir / 'tb'}")
    model = nnx.merge(s.graphdef, params)
    sample = None
    if main and cfg.sample_tokens > 0:
        prompt_ids = tokenizer.encode([cfg.sample_prompt])[0] or [tokenizer.eos_id]
        room = recipe.model.max_seq_len - len(prompt_ids)
        new_ids = generate(model, prompt_ids, max_new_tokens=min(cfg.sample_tokens, room), temperature=0.8,
                           top_p=0.95, seed=cfg.seed, stop_id=tokenizer.eos_id)
        sample = tokenizer.decode(prompt_ids + new_ids)
        say("sample:\n" + "-" * 60 + "\n" + sample + "\n" + "-" * 60)
    # Process 0 did extra work above; leave together, or jax.distributed's shutdown barrier can time out.
    distributed.barrier("spillway-train-end")
    return RunResult(run_dir, step, logger.history, sample, model, tokenizer)
