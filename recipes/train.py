"""The train loop: one jitted, sharded train step driven by a Recipe, with checkpoints and metrics.

    recipe -> data (tokenizer, packed rows, loader) -> mesh -> model and
    optimizer state created in their shards -> jitted step (grad accumulation,
    AdamW, donation) -> loop (progress, validation, checkpoints, profile) ->
    a text sample at the end.

There is exactly one train step (`make_train_step`); the planner compiles the
same function for GPU targets, so what it measures is what runs.
"""

from __future__ import annotations

import dataclasses
import functools
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from layers import names
from layers.sharding import (activation_sharding, batch_sharding, constrain, create_sharded, make_mesh,
                             state_shardings)
from models.llama import Llama
from recipes import distributed
from recipes.config import Recipe
from recipes.generate import generate
from recipes.metrics import RunLogger, check_finite, device_memory_in_use, peak_flops_per_device
from recipes.optimizer import Optimizer, check_host_memory, donate_opt_state_ok, make_layouts


def cross_entropy(logits_btv: jax.Array, targets_bt: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in float32, whatever the logits' dtype."""
    logits_btv = logits_btv.astype(jnp.float32)
    log_z_bt = jax.nn.logsumexp(logits_btv, axis=-1)
    target_logit_bt = jnp.take_along_axis(logits_btv, targets_bt[..., None], axis=-1)[..., 0]
    return jnp.mean(log_z_bt - target_logit_bt)


def chunked_cross_entropy(logits_fn, head_params, x_btd: jax.Array, targets_bt: jax.Array,
                          chunk: int) -> jax.Array:
    """cross_entropy(logits_fn(head_params, x), targets) computed `chunk` tokens at a time.

    Only one chunk's [b, chunk, vocab] float32 logits exist at once instead of
    the whole sequence's (4.2 GB for 8192 tokens of a 128k vocabulary); the
    backward pass recomputes each chunk's logits (one extra head matmul).
    The head's gradient is summed over chunks in float32 and rounded to the
    parameter dtype once, as the whole-sequence matmul would: autodiff of a
    scan would sum the chunks' bf16 gradients in bf16, rounding once per chunk.
    """
    b, t, d = x_btd.shape
    if t % chunk:
        raise ValueError(f"train.loss_chunk ({chunk}) must divide the sequence length ({t})")
    x_nbcd = x_btd.reshape(b, t // chunk, chunk, d).swapaxes(0, 1)
    targets_nbc = targets_bt.reshape(b, t // chunk, chunk).swapaxes(0, 1)
    return _chunked_loss_sum(logits_fn, head_params, x_nbcd, targets_nbc) / targets_bt.size


def _chunk_loss_sum(logits_fn, head_params, x_bcd, targets_bc):
    return cross_entropy(logits_fn(head_params, x_bcd), targets_bc) * targets_bc.size


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked_loss_sum(logits_fn, head_params, x_nbcd, targets_nbc):
    def step(total, chunk_inputs):
        return total + _chunk_loss_sum(logits_fn, head_params, *chunk_inputs), None

    total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), (x_nbcd, targets_nbc))
    return total


def _chunked_loss_sum_fwd(logits_fn, head_params, x_nbcd, targets_nbc):
    return _chunked_loss_sum(logits_fn, head_params, x_nbcd, targets_nbc), (head_params, x_nbcd, targets_nbc)


def _chunked_loss_sum_bwd(logits_fn, residuals, g):
    head_params, x_nbcd, targets_nbc = residuals

    def step(head_grad_sum, chunk_inputs):
        x_bcd, targets_bc = chunk_inputs
        _, vjp = jax.vjp(lambda h, x: _chunk_loss_sum(logits_fn, h, x, targets_bc), head_params, x_bcd)
        head_grad, x_grad = vjp(g)
        return jax.tree.map(lambda s, h: s + h.astype(jnp.float32), head_grad_sum, head_grad), x_grad

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), head_params)
    head_grad_sum, x_grad_nbcd = jax.lax.scan(step, zeros, (x_nbcd, targets_nbc))
    head_grad = jax.tree.map(lambda s, p: s.astype(p.dtype), head_grad_sum, head_params)
    targets_grad = np.zeros(targets_nbc.shape, jax.dtypes.float0)   # integer input: no gradient
    return head_grad, x_grad_nbcd, targets_grad


_chunked_loss_sum.defvjp(_chunked_loss_sum_fwd, _chunked_loss_sum_bwd)


def make_loss_fn(graphdef, loss_chunk: int = 0, mesh=None):
    """Mean next-token loss of a [batch, seq+1] token batch; `loss_chunk` > 0 applies the head in chunks.

    With a `mesh`, the layers pin their activations to the batch sharding
    while this is traced (layers.sharding.activation_sharding).
    """
    def loss_fn(params, tokens_bt):
        with activation_sharding(mesh):
            return _loss(params, tokens_bt)

    def _loss(params, tokens_bt):
        model = nnx.merge(graphdef, params)
        tokens_bt = constrain(tokens_bt, (names.BATCH, None))
        inputs_bt, targets_bt = tokens_bt[:, :-1], tokens_bt[:, 1:].astype(jnp.int32)
        if not loss_chunk or loss_chunk >= inputs_bt.shape[1]:
            return cross_entropy(model(inputs_bt), targets_bt)
        positions_bt = jnp.broadcast_to(jnp.arange(inputs_bt.shape[1]), inputs_bt.shape)
        x_btd, _ = model.hidden_states(inputs_bt, positions_bt)
        head_logits, head_params = model.split_head()
        return chunked_cross_entropy(head_logits, head_params, x_btd, targets_bt, loss_chunk)
    return loss_fn


def make_train_step(graphdef, optimizer: Optimizer, grad_accum: int, loss_chunk: int = 0, mesh=None):
    """(params, opt_state, tokens [batch, seq+1]) -> (params, opt_state, metrics).

    With grad_accum > 1 the batch is split into micro-batches whose gradients
    are summed in float32 by a scan, so activation memory is that of one
    micro-batch. Micro-batch m takes rows m, m + grad_accum, ... so that every
    device's shard of the batch holds rows of every micro-batch: each
    micro-batch stays spread over all devices, with no reshuffle.
    """
    loss_fn = make_loss_fn(graphdef, loss_chunk, mesh)
    grad_fn = jax.value_and_grad(loss_fn)

    def train_step(params, opt_state, tokens_bt):
        if grad_accum == 1:
            loss, grads = grad_fn(params, tokens_bt)
        else:
            micro_mbt = tokens_bt.reshape(-1, grad_accum, tokens_bt.shape[-1]).swapaxes(0, 1)

            def accumulate(grad_sum, micro_bt):
                loss, grads = grad_fn(params, micro_bt)
                return jax.tree.map(lambda s, g: s + g.astype(jnp.float32), grad_sum, grads), loss

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
            grad_sum, losses = jax.lax.scan(accumulate, zeros, micro_mbt)
            grads = jax.tree.map(lambda g: g / grad_accum, grad_sum)
            loss = jnp.mean(losses)
        params, opt_state, stats = optimizer.update(grads, opt_state, params)
        return params, opt_state, {"loss": loss, **stats}

    return train_step


def make_eval_step(graphdef, mesh=None):
    return make_loss_fn(graphdef, mesh=mesh)


@dataclasses.dataclass
class TrainSetup:
    """Everything built from a recipe before the first step (also what the planner compiles)."""

    recipe: Recipe
    mesh: jax.sharding.Mesh
    graphdef: object
    params: object
    param_shardings: object
    optimizer: Optimizer
    opt_state_shardings: object
    batch_sharding: NamedSharding
    train_step: object  # jitted


def build_model(recipe: Recipe, mesh, seed: int):
    cfg = recipe.model_config()
    model = create_sharded(lambda: Llama(cfg, rngs=nnx.Rngs(seed)), mesh)
    return nnx.split(model)


def setup(recipe: Recipe, mesh=None) -> TrainSetup:
    """Build the model in its shards and the jitted train step."""
    mesh = mesh or make_mesh(recipe.mesh.data, recipe.mesh.fsdp, recipe.mesh.tensor)
    graphdef, params = build_model(recipe, mesh, recipe.train.seed)
    param_sh = jax.tree.map(lambda v: v.sharding, params)
    return _assemble(recipe, mesh, graphdef, params, param_sh, donate_opt_state_ok())


def abstract_setup(recipe: Recipe, mesh, *, platform: str = "cuda") -> TrainSetup:
    """setup() without allocating anything: `params` are ShapeDtypeStructs carrying their shardings.

    For compiling the train step ahead of time (the planner compiles it for a GPU
    target on a mesh of compile-only devices, recipes/planner_child.py), where an
    8B model must never be built concretely. `platform` is the target's: it decides
    donation as donate_opt_state_ok does at run time.
    """
    graphdef, abstract_state = abstract_model(recipe)
    param_sh = state_shardings(abstract_state, mesh)
    return _assemble(recipe, mesh, graphdef, abstract_with_shardings(abstract_state, param_sh), param_sh,
                     donate_opt_state_ok(platform), layout_source=abstract_state)


def abstract_model(recipe: Recipe):
    """(graphdef, parameter state of ShapeDtypeStructs with their metadata): the model, nothing allocated."""
    cfg = recipe.model_config()
    return nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(recipe.train.seed))))


def _assemble(recipe: Recipe, mesh, graphdef, params, param_sh, donate_opt_state: bool,
              layout_source=None) -> TrainSetup:
    """What setup() and abstract_setup() share: optimizer, shardings and the one jitted step."""
    if recipe.train.global_batch % (mesh.shape["data"] * mesh.shape["fsdp"]) and mesh.size > 1:
        raise ValueError(f"train.global_batch ({recipe.train.global_batch}) must be divisible by the "
                         f"data x fsdp mesh size ({mesh.shape['data'] * mesh.shape['fsdp']})")
    opt_cfg = recipe.optimizer_config()
    optimizer = Optimizer(opt_cfg, make_layouts(params if layout_source is None else layout_source, opt_cfg))
    opt_sh = optimizer.state_shardings(param_sh)
    batch_sh = batch_sharding(mesh)
    step = jax.jit(make_train_step(graphdef, optimizer, recipe.train.grad_accum, recipe.train.loss_chunk, mesh),
                   in_shardings=(param_sh, opt_sh, batch_sh),
                   out_shardings=(param_sh, opt_sh, NamedSharding(mesh, PartitionSpec())),
                   donate_argnums=(0, 1) if donate_opt_state else (0,))
    return TrainSetup(recipe, mesh, graphdef, params, param_sh, optimizer, opt_sh, batch_sh, step)


def abstract_step_arguments(s: TrainSetup) -> tuple:
    """(params, opt_state, tokens) as ShapeDtypeStructs with the step's shardings, for `.lower()`.

    Tokens are [global_batch, seq_len + 1] int32, as the loader delivers them.
    """
    opt_state = abstract_with_shardings(jax.eval_shape(s.optimizer.init, s.params), s.opt_state_shardings)
    tokens = jax.ShapeDtypeStruct((s.recipe.train.global_batch, s.recipe.data.seq_len + 1), jnp.int32,
                                  sharding=s.batch_sharding)
    return s.params, opt_state, tokens


def abstract_with_shardings(tree, shardings):
    """ShapeDtypeStructs of `tree`'s arrays carrying `shardings`: targets for lowering and restoring."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


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

    from data import eval_batches
    from recipes.checkpoint import SIGTERM_EXIT_STATUS, RunCheckpointer, restore_params_only
    from recipes.data_pipeline import prepare, train_loader

    distributed.maybe_initialize()
    main = distributed.is_main_process()
    say = echo if main else (lambda *a, **k: None)
    cfg = recipe.train
    profile = _parse_profile(cfg.profile_steps)

    say(f"recipe {recipe.name}: {recipe.model.num_params() / 1e6:.2f}M parameters, "
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
            abstract_opt_state=abstract_with_shardings(opt_state, s.opt_state_shardings))
        params, opt_state = restored["params"], restored["opt_state"]
        loader.restore(restored["loader_state"])
        step = int(restored["meta"]["step"])
        say(f"resumed from {run_dir / 'checkpoints'} at step {step}")
    elif recipe.checkpoint.init_from:
        params, meta = restore_params_only(recipe.checkpoint.init_from,
                                           abstract_with_shardings(params, s.param_shardings))
        say(f"fine-tuning from {recipe.checkpoint.init_from} (weights of step {meta.get('step')}); "
            f"fresh optimizer state and schedule")

    def save(at_step: int, force: bool = False):
        checkpointer.save(at_step, params=params, opt_state=opt_state, loader_state=loader.state(),
                          meta={"step": at_step, "seed": cfg.seed, "tokens_seen": at_step * tokens_per_step},
                          recipe_json=recipe.to_json(), force=force)

    logger = RunLogger(run_dir, enabled=main)
    if main:
        tokenizer.save(run_dir / "tokenizer.model")  # `spillway generate RUN_DIR` needs it
    eval_step = jax.jit(make_eval_step(s.graphdef, s.mesh), in_shardings=(s.param_shardings, s.batch_sharding))
    tokens_per_step = cfg.global_batch * packed.seq_len
    flops_per_step = recipe.model.flops_per_token(packed.seq_len) * tokens_per_step
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
