"""The one train step and what builds it: loss function, gradient accumulation, optimizer update, shardings.

There is exactly one train step (`make_train_step`); the train loop runs it and
the planner compiles the same function for GPU targets (`abstract_setup`), so
what the planner measures is what runs. What it differentiates is
`make_objective`: the loss plus the auxiliary losses of what the model's blocks
emit (recipes/train/aux_terms.py), in every variant of the step.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from spillway.layers import aux_outputs, host_weights, names
from spillway.layers.errors import ConfigError
from spillway.layers.mesh import check_batch_split
from spillway.layers.residency import whole_placement
from spillway.layers.sharding import (activation_sharding, batch_sharding, constrain, init_program, make_mesh,
                                      state_shardings, undivided_dims)
from spillway.recipes.config import NEXT_FORWARD, PENDING_HOST, AuxLossConfig, Recipe
from spillway.recipes.optim import update_in_forward
from spillway.recipes.optim import param_placement as placement
from spillway.recipes.optim.host_streaming import tree_nbytes_by_memory_kind
from spillway.recipes.optim.layouts import make_layouts
from spillway.recipes.optim.optimizer import Optimizer
from spillway.recipes.train import accumulate_in_forward, aux_terms, lora_step, xla_settings
from spillway.recipes.train import batch as batch_lib
from spillway.recipes.train.batch import Batch, micro_batches
from spillway.recipes.train.sft_batch import with_step_denominator
from spillway.recipes.train.loss import chunked_cross_entropy, cross_entropy


def make_loss_fn(graphdef, loss_chunk: int = 0, mesh=None):
    """(params, Batch) -> the mean next-token loss of its rows; `loss_chunk` > 0 applies the head in chunks.

    The one place the batch's fields become the loss (recipes/train/batch.py). With a `mesh`, the layers
    pin their activations to the batch sharding while this is traced (layers.sharding.activation_sharding).
    """
    def loss_fn(params, batch: Batch):
        with activation_sharding(mesh):
            return _loss(params, batch)

    def _loss(params, batch: Batch):
        model = nnx.merge(graphdef, params)
        # Token rows, and for fine-tuning (recipes/train/sft_batch.py) a loss mask and example ids.
        fields = batch
        tokens_bt = constrain(fields.tokens, (names.BATCH, None))
        inputs_bt, targets_bt = tokens_bt[:, :-1], tokens_bt[:, 1:].astype(jnp.int32)
        weights_bt = fields.loss_mask
        denominator = None if fields.loss_denominator is None else fields.loss_denominator[0]
        positions_bt = fields.positions
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(inputs_bt.shape[1]), inputs_bt.shape)
        x_btd, _ = model.hidden_states(inputs_bt, positions_bt, segment_ids_bt=fields.segment_ids)
        if not loss_chunk or loss_chunk >= inputs_bt.shape[1]:
            return cross_entropy(model.logits(x_btd), targets_bt, weights_bt, denominator)
        head_logits, head_params = model.split_head()
        return chunked_cross_entropy(head_logits, head_params, x_btd, targets_bt, loss_chunk, weights_bt,
                                     denominator)
    return loss_fn


def make_objective(graphdef, loss_chunk: int = 0, mesh=None, aux_loss: AuxLossConfig = AuxLossConfig(),
                   params_keep: int = 0):
    """(params, Batch) -> (what the step differentiates, this batch's metrics).

    `params_keep` (offload.params_keep): the last that many streamed block layers keep the weights the
    forward pass fetched into HBM for the backward pass (layers/host_weights.keeping_fetched_weights).

    The loss of `make_loss_fn` with a collector open around the model
    (layers/aux_outputs.py): what the blocks emit becomes metrics, and router
    statistics also loss terms weighted by `aux_loss` (recipes/train/aux_terms.py).
    Metrics: "loss" (the cross-entropy, without the auxiliary terms, so that it
    compares with the validation loss and with dense runs) and, when the blocks
    emit anything, their metrics under aux_terms.AUX_METRICS. A model whose
    blocks emit nothing gives its plain loss: the same program as without the
    collector.
    """
    loss_fn = make_loss_fn(graphdef, loss_chunk, mesh)

    def objective(params, batch: Batch):
        with aux_outputs.collecting() as collected, host_weights.keeping_fetched_weights(params_keep):
            loss = loss_fn(params, batch)
        weighted, aux_metrics = aux_terms.batch_terms(collected.values, aux_loss)
        metrics = {"loss": loss, **({aux_terms.AUX_METRICS: aux_metrics} if aux_metrics else {})}
        return (loss if weighted is None else loss + weighted), metrics
    return objective


def emitted_values(graphdef, params, batch: Batch, mesh=None):
    """The structure (ShapeDtypeStructs) of what the model's blocks emit for a batch, traced, nothing run."""
    loss_fn = make_loss_fn(graphdef, mesh=mesh)

    def collect(params, batch):
        with aux_outputs.collecting() as collected:
            loss_fn(params, batch)
        return collected.values
    return jax.eval_shape(collect, params, batch)


def make_train_step(graphdef, optimizer: Optimizer, grad_accum: int, loss_chunk: int = 0, mesh=None,
                    aux_loss: AuxLossConfig = AuxLossConfig(), params_keep: int = 0):
    """(params, opt_state, pending, Batch) -> (params, opt_state, pending, metrics); `pending` is None
    (the signature of every step, TrainSetup.train_step; the deferred update's step passes a
    PendingUpdate, recipes/optim/update_in_forward.py).

    The step differentiates `make_objective`: the loss plus the auxiliary losses
    `aux_loss` weights. With grad_accum > 1 the batch is split into micro-batches
    whose gradients are summed in float32 by a scan, so activation memory is that
    of one micro-batch; each micro-batch's objective is its own (the load-balancing
    loss from its own statistics, recipes/train/aux_terms.py), and the step's
    metrics are the micro-batches' means. Micro-batch m takes rows m,
    m + grad_accum, ... so that every device's shard of the batch holds rows of
    every micro-batch: each micro-batch stays spread over all devices, with no
    reshuffle.
    """
    objective = make_objective(graphdef, loss_chunk, mesh, aux_loss, params_keep)
    grad_fn = jax.value_and_grad(objective, has_aux=True)

    def train_step(params, opt_state, pending: None, batch: Batch):
        if grad_accum == 1:
            (_, metrics), grads = grad_fn(params, batch)
        else:
            # Masked targets: each micro-batch's loss is over the whole step's target count (sft_batch.py).
            micro = micro_batches(with_step_denominator(batch, grad_accum), grad_accum)
            if host_weights.any_in_host_memory(params):
                metrics, grads = _accumulate_in_backward(objective, params, micro)
            else:
                def accumulate(grad_sum, micro_batch):
                    (_, metrics), grads = grad_fn(params, micro_batch)
                    return jax.tree.map(lambda t, g: t + g.astype(jnp.float32), grad_sum, grads), metrics

                zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
                grad_sum, per_micro = jax.lax.scan(accumulate, zeros, micro)
                grads = jax.tree.map(lambda g: g / grad_accum, grad_sum)
                metrics = jax.tree.map(lambda m: jnp.mean(m, axis=0), per_micro)
        params, opt_state, stats = optimizer.update(grads, opt_state, params)
        return params, opt_state, pending, {**metrics, **stats}

    return train_step


def _accumulate_in_backward(objective, params, micro: Batch):
    """(mean metrics, mean gradients) over micro-batches, the host weights' gradients summed inside each backward.

    The float32 sums of host-resident weights stay in host memory and pass
    through HBM a layer at a time (layers/host_weights.AccumulatingWeight): the
    objective is differentiated with respect to those sums, so what comes back for
    them is the new sum. The objective is divided by the micro-batch count before
    differentiating, so the sums are the mean gradient with no division pass
    over them at the end (a host computation would write its result to HBM
    first). Device-resident gradients are summed on device as usual.
    """
    grad_accum = jax.tree.leaves(micro)[0].shape[0]
    on_host = jax.tree.map(host_weights.in_host_memory, params)

    def micro_step(grad_sum, micro_batch):
        def scaled_objective(differentiated):
            merged = jax.tree.map(lambda p, d, host: host_weights.AccumulatingWeight(p, d) if host else d,
                                  params, differentiated, on_host)
            value, metrics = objective(merged, micro_batch)
            return value / grad_accum, metrics

        differentiated = jax.tree.map(lambda p, s, host: s if host else p, params, grad_sum, on_host)
        (_, metrics), grads = jax.value_and_grad(scaled_objective, has_aux=True)(differentiated)
        grad_sum = jax.tree.map(lambda s, g, host: g if host else s + g.astype(jnp.float32),
                                grad_sum, grads, on_host)
        return grad_sum, metrics

    host_zeros = {}   # one host buffer of zeros per shape: the first micro-batch only reads them

    def zeros_like(p, host):
        if not host:
            return jnp.zeros(p.shape, jnp.float32)
        if p.shape not in host_zeros:
            host_zeros[p.shape] = host_weights.host_zeros_f32_like(p)
        return host_zeros[p.shape]

    zeros = jax.tree.map(zeros_like, params, on_host)
    grad_sum, per_micro = jax.lax.scan(micro_step, zeros, micro)
    return jax.tree.map(lambda m: jnp.mean(m, axis=0), per_micro), grad_sum


def make_eval_step(graphdef, mesh=None):
    """(params, Batch) -> (the summed loss of its target tokens, their count), float32 scalars.

    Validation divides the sums over its batches by the counts over them
    (loop_parts.Validation), so the validation loss is the mean over the set's
    target tokens, not a mean of batch means: fine-tuning batches hold
    different numbers of answer tokens. A text batch counts every token.
    """
    loss_fn = make_loss_fn(graphdef, mesh=mesh)

    def eval_sums(params, batch: Batch):
        mask = batch.loss_mask
        if mask is None:
            mask = jnp.ones((batch.tokens.shape[0], batch.tokens.shape[1] - 1), jnp.float32)
        rows = batch.tokens.shape[0]
        # A denominator of 1 makes the masked mean its numerator: the sum of the target tokens' losses.
        summed = loss_fn(params, batch._replace(loss_mask=mask, loss_denominator=jnp.ones((rows,), jnp.float32)))
        return summed, jnp.sum(mask)
    return eval_sums


def _nothing_to_flush(params, opt_state, pending):
    """TrainSetup.flush of a step that applies its update itself: nothing is left to apply."""
    return params, opt_state, pending


@dataclasses.dataclass
class TrainSetup:
    """Everything built from a recipe before the first step (also what the planner compiles).

    One step signature whatever offload.update is: `train_step` (jitted) is
    (params, opt_state, pending, Batch) -> (params, opt_state, pending, metrics).
    `pending` is the update a step leaves for the next one's forward pass with
    offload.update=next_forward (recipes/optim/update_in_forward.py), None
    otherwise; `flush` applies what is pending (jitted; with nothing deferred,
    it returns its arguments).
    """

    recipe: Recipe
    mesh: jax.sharding.Mesh
    graphdef: object
    params: object
    param_shardings: object
    optimizer: Optimizer
    opt_state_shardings: object
    batch_sharding: NamedSharding
    train_step: object  # jitted
    pending_shardings: object = None   # the PendingUpdate's when the update is deferred
    flush: object = _nothing_to_flush

    @property
    def defers_update(self) -> bool:
        return self.pending_shardings is not None

    def nothing_pending(self, params):
        """The `pending` of a run's first step (or one after a resume): nothing to apply (None when the
        step applies its own update)."""
        if not self.defers_update:
            return None
        return jax.jit(empty_pending_of(self.recipe), out_shardings=self.pending_shardings)(params)


def empty_pending_of(recipe: Recipe):
    """(params) -> the PendingUpdate with nothing to apply that the recipe's deferred step takes: gradients of
    the parameters' dtypes with one batch per step, float32 ones (the accumulated mean's) with grad_accum > 1."""
    if recipe.train.grad_accum > 1:
        return accumulate_in_forward.nothing_pending
    return update_in_forward.nothing_pending


def build_model(recipe: Recipe, mesh, seed: int, shardings=None):
    """(graphdef, params) of the recipe's model, every parameter created in its shard and memory.

    Split weights (offload.params=host:N) are created whole in host memory, a layer at a time, then cut
    by the host CPU: their first layers copied into HBM (placement.params_from_saved)."""
    whole = None if shardings is None else placement.whole_shardings(shardings)
    graphdef, program = init_program(model_maker(recipe, seed, whole), mesh, shardings=whole)
    params = program()
    if shardings is not None and placement.any_split(shardings):
        params = placement.params_from_saved(params, placement.placed_structs(
            abstract_model(recipe)[1], shardings, recipe.offload.params))
    return graphdef, params


def model_maker(recipe: Recipe, seed: int, shardings=None):
    """A function that builds the recipe's model; where `shardings` put block weights in pinned host
    memory, it creates them there a layer at a time (layers/host_weights.initialised_in_host_memory),
    so start-up never holds them in HBM."""
    def make():
        return recipe.build_model(nnx.Rngs(seed))

    if shardings is None or not placement.any_host_sharding(shardings):
        return make

    def make_in_host_memory():
        with host_weights.initialised_in_host_memory(whole_placement(recipe.offload.params)):
            return make()
    return make_in_host_memory


def setup(recipe: Recipe, mesh=None, *, initialise: bool = True) -> TrainSetup:
    """Build the model in its shards and the jitted train step.

    `initialise=False`: the same setup with `params` as ShapeDtypeStructs carrying their shardings (and
    split leaves as ResidentSplits of them), nothing allocated: for a run whose weights come from elsewhere
    (a resume, a fine-tune), which restores straight into those targets instead of initialising weights
    that the restore would then hold beside the restored ones (recipes/train/run_state.py).

    The recipe's checks against the model (`check_attention_backend`, `check_aux_loss`) are its callers':
    the train loop and the planner run them once, before data is prepared (recipes/train/loop.py)."""
    mesh = mesh or make_mesh(recipe.mesh)
    graphdef, abstract_state = abstract_model(recipe)
    param_sh = placement.placed_shardings(abstract_state, state_shardings(abstract_state, mesh),
                                          recipe.offload.params)
    if initialise:
        graphdef, params = build_model(recipe, mesh, recipe.train.seed, param_sh)
    else:
        params = placement.placed_structs(abstract_state, param_sh, recipe.offload.params)
    _warn_if_replicated(abstract_state if placement.any_split(params) or not initialise else params, mesh)
    return _assemble(recipe, mesh, graphdef, params, param_sh, layout_source=abstract_state,
                     platform=jax.default_backend())


@dataclasses.dataclass(frozen=True)
class PinnedHostBytes:
    """Pinned host memory this process needs for a recipe (bytes), known before anything is allocated."""

    optimizer_state: int
    weights: int      # block weights in host memory (offload.params=host)
    gradients: int    # their gradients during the step: one copy, or with grad_accum > 1 two float32 sums

    @property
    def total(self) -> int:
        return self.optimizer_state + self.weights + self.gradients

    def describe(self) -> str:
        gib = 2**30
        return (f"optimizer state {self.optimizer_state / gib:.2f} GiB, weights {self.weights / gib:.2f} GiB, "
                f"their gradients {self.gradients / gib:.2f} GiB")


def pinned_host_bytes(recipe: Recipe, mesh) -> PinnedHostBytes:
    """What `recipe` pins in host memory on this process, from its abstract setup (nothing allocated).

    Counts the step's arguments and the host gradients it makes; its other
    temporaries are the planner's to report (spillway plan's host column).
    With grad_accum > 1 the float32 running sum is read and a new one written
    in each micro-batch: two of them. With the update in the next forward pass
    the new state is written over the old one and the new pending gradients
    over the old ones (both donated): one state, one copy of the gradients.
    """
    return pinned_bytes_of_setup(abstract_setup(recipe, mesh, platform=jax.default_backend()))


def pinned_bytes_of_setup(s: TrainSetup) -> PinnedHostBytes:
    """`pinned_host_bytes` of a setup already built (abstract or concrete)."""
    state = s.optimizer.host_bytes(s.optimizer.abstract_state(s.params, s.param_shardings))
    weights = tree_nbytes_by_memory_kind(s.params).get(placement.PINNED_HOST, 0)
    as_f32 = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32, sharding=p.sharding), s.params)
    pending = tree_nbytes_by_memory_kind(_abstract_pending(s)).get(placement.PINNED_HOST, 0)   # None: 0
    return pinned_step_bytes(s.recipe, state=state, weights=weights,
                             weights_f32=tree_nbytes_by_memory_kind(as_f32).get(placement.PINNED_HOST, 0),
                             pending=pending)


def pinned_step_bytes(recipe: Recipe, *, state: int, weights: int, weights_f32: int, pending: int) -> PinnedHostBytes:
    """What the step pins, from the host bytes of the optimizer state, of the block weights (and the same
    weights in float32) and of the deferred update's pending gradients: the one rule, which
    `pinned_bytes_of_setup` feeds from a setup and recipes/train/host_memory.py `phases_of_recipe` from
    shapes alone."""
    if recipe.offload.update == NEXT_FORWARD:
        # The step writes the new state over the old and the new pending gradients over the old ones
        # (both donated; recipes/optim/update_in_forward.py, make_setup).
        return PinnedHostBytes(state, weights, pending)
    if recipe.lora.enabled:
        gradients = 0   # the frozen base has none; the adapters' live in HBM
    elif recipe.train.grad_accum == 1:
        gradients = weights
    else:
        gradients = 2 * weights_f32   # the float32 running sum, read and written anew each micro-batch
    return PinnedHostBytes(state, weights, gradients)


def check_aux_loss(recipe: Recipe, graphdef=None, params=None, mesh=None) -> None:
    """ConfigError when an `aux_loss` coefficient is set and the model's blocks emit no router statistics
    for it to weight (recipes/train/aux_terms.check_emitted): one abstract trace of the model, only when a
    coefficient is set. `graphdef`, `params`: the model when already built (abstractly or not)."""
    if not recipe.aux_loss.any_set:
        return
    if graphdef is None:
        graphdef, params = abstract_model(recipe)
    micro = batch_lib.abstract(recipe.train.global_batch // recipe.train.grad_accum, recipe.data.seq_len)
    aux_terms.check_emitted(emitted_values(graphdef, params, micro, mesh), recipe.aux_loss)


def check_attention_backend(attention_impl: str, backend: str) -> None:
    """cuDNN attention runs on NVIDIA GPUs only: elsewhere, one line that says what to set instead."""
    if attention_impl == "cudnn" and backend not in xla_settings.GPU_PLATFORMS:
        raise ConfigError(f"execution.attention_impl=cudnn needs an NVIDIA GPU, and this run's backend is "
                          f"{backend}: --set execution.attention_impl=flash (the same memory, written in JAX)")


class MeshWarning(UserWarning):
    """A mesh that runs but does not split what it was meant to (weights it replicates)."""


def _warn_if_replicated(params, mesh) -> None:
    """A mesh axis that does not divide a weight dimension replicates it (layers/sharding.py): it runs,
    but costs memory and compute the mesh was meant to split, so say so (the planner refuses it)."""
    undivided = undivided_dims(params, mesh)
    if undivided:
        nbytes = sum({dim.path: dim.nbytes for dim in undivided}.values())
        listed = "; ".join(dim.describe() for dim in undivided[:4]) + (" ..." if len(undivided) > 4 else "")
        size = f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"
        warnings.warn(f"the mesh {dict(mesh.shape)} does not divide {len(undivided)} weight dimension(s), "
                      f"which are replicated instead of sharded ({size} of weights): {listed}",
                      MeshWarning, stacklevel=3)


def abstract_setup(recipe: Recipe, mesh, *, platform: str = "cuda") -> TrainSetup:
    """setup() without allocating anything: `params` are ShapeDtypeStructs carrying their shardings.

    For compiling the train step ahead of time (the planner compiles it for a GPU
    target on a mesh of compile-only devices, recipes/plan/child.py), where an
    8B model must never be built concretely. `platform` is the target's (its XLA
    settings, whether streamed state is kept in halves).
    """
    graphdef, abstract_state = abstract_model(recipe)
    param_sh = placement.placed_shardings(abstract_state, state_shardings(abstract_state, mesh),
                                          recipe.offload.params)
    return _assemble(recipe, mesh, graphdef, placement.placed_structs(abstract_state, param_sh, recipe.offload.params),
                     param_sh, layout_source=abstract_state, platform=platform)


def abstract_model(recipe: Recipe):
    """(graphdef, parameter state of ShapeDtypeStructs with their metadata): the model, nothing allocated."""
    return nnx.split(nnx.eval_shape(lambda: recipe.build_model(nnx.Rngs(recipe.train.seed))))


def _assemble(recipe: Recipe, mesh, graphdef, params, param_sh, layout_source=None,
              platform: str = "cuda") -> TrainSetup:
    """What setup() and abstract_setup() share: optimizer, shardings and the one jitted step.

    `platform` (the runtime's, or the target's) decides whether streamed host state is kept in two
    buffers per leaf: on a GPU, so that the two host-link directions overlap; not on CPU, where there
    is no link and the halves only cost a whole copy at every checkpoint save (Optimizer's
    halve_stacked_state; benchmarks/host_memory_phases.py)."""
    # A micro-batch the batch axes do not divide is replicated: it runs (the planner refuses it).
    check_batch_split(dict(mesh.shape), recipe.train.global_batch, recipe.train.grad_accum, micro_batches_too=False)
    # A LoRA run's optimizer holds state for the adapters only (recipes/train/lora_step.py).
    layouts = make_layouts(lora_step.trained_part(recipe, params if layout_source is None else layout_source),
                           recipe.optimizer, state_memory=recipe.offload.optimizer_state)
    deferred = recipe.offload.update == NEXT_FORWARD
    # The same XLA settings wherever this step compiles: a GPU run, and the planner's deviceless compile.
    xla_options = xla_settings.step_compiler_options(platform)
    optimizer = Optimizer(recipe.optimizer, layouts, total_steps=recipe.schedule_steps, update_in_forward=deferred,
                          halve_stacked_state=platform != "cpu")
    if recipe.lora.enabled:
        optimizer = lora_step.AdapterOptimizer(optimizer)
    opt_sh = optimizer.state_shardings(param_sh)
    batch_sh = batch_sharding(mesh)
    scalar_sh = NamedSharding(mesh, PartitionSpec())
    if deferred:
        # offload.pending_gradients: the stacked leaves' pending gradients in host memory, or in HBM.
        pending_on_host = recipe.offload.pending_gradients == PENDING_HOST
        pending_sh = update_in_forward.pending_shardings(optimizer, param_sh, scalar_sh, pending_on_host)
        objective = make_objective(graphdef, recipe.train.loss_chunk, mesh, recipe.aux_loss)
        if recipe.train.grad_accum > 1:   # micro-batch 1 takes the update; recipes/config.py: pending in HBM
            step_fn = accumulate_in_forward.make_train_step(objective, optimizer, recipe.train.grad_accum)
        else:
            step_fn = update_in_forward.make_train_step(objective, optimizer, pending_on_host)
        # The params, the optimizer state and the pending gradients are donated: the forward pass writes
        # each layer's new state over its old row in the carried host buffers
        # (update_in_forward._UpdateBeforeEachLayer), and the new gradients go where the old ones were
        # (deviceless H200, Llama 3.2 1B: host alias = the host arguments, host temp 0). keep_unused:
        # with a float32 master the old stacked weights are not read, and JAX, dropping those inputs,
        # paired the donated gradient buffers (same shapes) with the new weights, which XLA then kept
        # in host memory and copied there (the bf16 block weights twice among the host outputs and
        # 1.8 GiB of host-to-host copies; docs/DESIGN.md section 6). Kept, each donated input pairs
        # with its own output. Pending gradients in HBM are donated the same way: the new ones are made
        # in the backward pass, after the forward pass has read the old ones for the last time.
        donated = ((0, 1) if not placement.any_host_sharding(param_sh) else (1,)) + (2,)
        step = jax.jit(step_fn, in_shardings=(param_sh, opt_sh, pending_sh, batch_sh),
                       out_shardings=(param_sh, opt_sh, pending_sh, scalar_sh), donate_argnums=donated,
                       keep_unused=True, compiler_options=xla_options)
        flush = jax.jit(update_in_forward.make_flush(optimizer, pending_on_host),
                        in_shardings=(param_sh, opt_sh, pending_sh),
                        out_shardings=(param_sh, opt_sh, pending_sh), donate_argnums=donated,
                        keep_unused=True, compiler_options=xla_options)
        return TrainSetup(recipe, mesh, graphdef, params, param_sh, optimizer, opt_sh, batch_sh, step,
                          pending_sh, flush)
    if recipe.lora.enabled:   # the gradient of the adapters only; the base passes through
        step_fn = lora_step.make_train_step(make_objective(graphdef, recipe.train.loss_chunk, mesh, recipe.aux_loss),
                                            optimizer, recipe.train.grad_accum, recipe.train.seed)
    else:
        step_fn = make_train_step(graphdef, optimizer, recipe.train.grad_accum, recipe.train.loss_chunk, mesh,
                                  recipe.aux_loss, recipe.offload.params_keep)
    # The params and the optimizer state are donated on every platform, CPU included: the step writes
    # the new ones over the old, so it never holds two copies of the state. (Donating host state used
    # to abort on CPU, where XLA aliased a donated pinned_host buffer to a device output; JAX 0.10.2
    # pairs a donated buffer only with an output of its own memory kind: docs/DESIGN.md section 4,
    # tests/recipes/train/test_host_memory.py runs the donated step with host state on CPU.)
    step = jax.jit(step_fn,
                   in_shardings=(param_sh, opt_sh, None, batch_sh),
                   out_shardings=(param_sh, opt_sh, None, scalar_sh),
                   donate_argnums=STEP_DONATES, compiler_options=xla_options)
    return TrainSetup(recipe, mesh, graphdef, params, param_sh, optimizer, opt_sh, batch_sh, step)


STEP_DONATES = (0, 1)   # the step applying its own update donates (params, opt_state)


def abstract_step_arguments(s: TrainSetup) -> tuple:
    """(params, opt_state, pending, Batch) as ShapeDtypeStructs with the step's shardings, for `.lower()`
    (pending: None unless the step defers its update). The batch is [global_batch, seq_len + 1] int32
    tokens, as the loader delivers them."""
    opt_state = abstract_with_shardings(jax.eval_shape(s.optimizer.init, s.params), s.opt_state_shardings)
    batch = batch_lib.abstract(s.recipe.train.global_batch, s.recipe.data.seq_len, s.batch_sharding)
    return s.params, opt_state, _abstract_pending(s), batch


def _abstract_pending(s: TrainSetup):
    """The step's `pending` argument as ShapeDtypeStructs with its shardings (None: nothing deferred)."""
    if not s.defers_update:
        return None
    return abstract_with_shardings(jax.eval_shape(empty_pending_of(s.recipe), s.params), s.pending_shardings)


def is_abstract(params) -> bool:
    """Whether `params` are ShapeDtypeStructs (setup(initialise=False), abstract_setup), not arrays."""
    return any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(params))


def abstract_with_shardings(tree, shardings):
    """ShapeDtypeStructs of `tree`'s arrays carrying `shardings`: targets for lowering and restoring."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)
