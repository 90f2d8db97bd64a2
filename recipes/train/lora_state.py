"""A LoRA run's state: the adapters train, the base weights are frozen, checkpoints hold the adapters.

The model carries its adapters as `nnx.LoRAParam`s beside the base weights
(layers/lora.py); the parameter tree the loop and the step pass around is the
whole model, so the step's signature, shardings and donation are those of any
run. What differs:

* the train step (`make_train_step`) splits the tree into adapters and base,
  differentiates the loss with respect to the adapters only (the base enters
  as a non-differentiated input: no weight gradient is computed for it, host
  resident or not), updates the adapters and returns the base unchanged;
* the optimizer (`AdapterOptimizer`) holds state for the adapters only: it
  takes whole trees where the loop and the planner hand them over and passes
  the adapter part to an `Optimizer` built over it;
* checkpoints (`checkpointed`, `with_restored`) hold the adapters; the base is
  the run's `checkpoint.init_from`, which the recipe saved beside every step
  names, pinned to one step folder when the run starts (`pin_base`), so a
  source run that trains on cannot change the base under the adapters;
* reading a run back (`restore_run_params`: generate, export) loads the base
  from that pointer and the adapters from the step.

LoRA dropout draws its mask from the run's seed and the optimizer's step
count (and the micro-batch), so a resumed run draws what the uninterrupted
run would have.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from spillway.layers import lora
from spillway.recipes.config import Recipe


def _is_adapter(var) -> bool:
    return isinstance(var, nnx.LoRAParam)


def split(state) -> tuple[nnx.State, nnx.State]:
    """(adapters, base) of an nnx.State whose leaves are Variables (LoRAParams are the adapters)."""
    flat = list(nnx.to_flat_state(state))
    adapters = [(path, var) for path, var in flat if _is_adapter(var)]
    base = [(path, var) for path, var in flat if not _is_adapter(var)]
    return nnx.from_flat_state(adapters), nnx.from_flat_state(base)


def join(adapters: nnx.State, base: nnx.State) -> nnx.State:
    """The whole state again (the same tree structure `split` took apart)."""
    return nnx.merge_state(base, adapters)


def adapters_of(state) -> nnx.State:
    return split(state)[0]


def trained_part(recipe: Recipe, state):
    """What the optimizer updates: the adapters for a LoRA run, else the whole state."""
    return adapters_of(state) if recipe.lora.enabled else state


class AdapterOptimizer:
    """An Optimizer over the adapters, taking the whole parameter tree where callers hand it over.

    The state (moments, masters, count) is the inner optimizer's, for the
    adapters only; checkpoint forms and byte counts are the inner one's.
    """

    def __init__(self, inner):
        self.inner = inner

    def init(self, params):
        return self.inner.init(adapters_of(params))

    def state_shardings(self, param_shardings):
        return self.inner.state_shardings(adapters_of(param_shardings))

    def abstract_state(self, params, param_shardings=None):
        return self.inner.abstract_state(adapters_of(params),
                                         None if param_shardings is None else adapters_of(param_shardings))

    def saved_abstract_state(self, params, param_shardings=None):
        return self.inner.saved_abstract_state(adapters_of(params),
                                               None if param_shardings is None else adapters_of(param_shardings))

    def update(self, grads, opt_state, params, **kwargs):
        """`grads` are the adapters'; `params` the whole tree. Returns (whole params, state, stats)."""
        adapters, base = split(params)
        adapters, opt_state, stats = self.inner.update(grads, opt_state, adapters, **kwargs)
        return join(adapters, base), opt_state, stats

    def __getattr__(self, name):   # saved_form, from_saved_form, halved_part, host_bytes, schedule, ...
        return getattr(self.inner, name)


def dropout_key(seed: int, count) -> jax.Array:
    """The step's LoRA dropout key: from the run's seed and the optimizer's step count (resumes exactly)."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 0x10AA), count)


def make_train_step(objective, optimizer: AdapterOptimizer, grad_accum: int, seed: int):
    """(params, opt_state, tokens) -> (params, opt_state, metrics), the gradient taken for the adapters only.

    `objective(params, tokens) -> (value, metrics)` is step.make_objective's. Micro-batches are taken
    as step.make_train_step takes them (rows m, m + grad_accum, ...) and their float32 gradient sum is
    divided by their count, so the adapters' update is the one a whole-model run would make for them.
    """
    def train_step(params, opt_state, tokens_bt):
        adapters, base = split(params)
        key = dropout_key(seed, opt_state.count)

        def adapter_objective(adapters, micro_bt, micro_key):
            with lora.dropout_key(micro_key):
                return objective(join(adapters, base), micro_bt)

        grad_fn = jax.value_and_grad(adapter_objective, has_aux=True)
        if grad_accum == 1:
            (_, metrics), grads = grad_fn(adapters, tokens_bt, key)
        else:
            micro_mbt = tokens_bt.reshape(-1, grad_accum, tokens_bt.shape[-1]).swapaxes(0, 1)

            def accumulate(grad_sum, micro):
                index, micro_bt = micro
                (_, metrics), grads = grad_fn(adapters, micro_bt, jax.random.fold_in(key, index))
                return jax.tree.map(lambda t, g: t + g.astype(jnp.float32), grad_sum, grads), metrics

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), adapters)
            grad_sum, per_micro = jax.lax.scan(accumulate, zeros, (jnp.arange(grad_accum), micro_mbt))
            grads = jax.tree.map(lambda g: g / grad_accum, grad_sum)
            metrics = jax.tree.map(lambda m: jnp.mean(m, axis=0), per_micro)
        params, opt_state, stats = optimizer.update(grads, opt_state, params)
        return params, opt_state, {**metrics, **stats}
    return train_step


# --- checkpoints: the adapters, and the base they adapt ------------------------------------------


def checkpointed(recipe: Recipe, params):
    """What a checkpoint holds of the parameters: a LoRA run's adapters, any other run's whole tree."""
    return adapters_of(params) if recipe.lora.enabled else params


def with_restored(recipe: Recipe, params, restored):
    """The whole tree after a restore of `checkpointed` parameters: `params`' base with the restored
    adapters for a LoRA run; the restored tree itself for any other."""
    if not recipe.lora.enabled:
        return restored
    return join(restored, split(params)[1])


def pin_base(recipe: Recipe) -> Recipe:
    """A LoRA run's init_from resolved to the step folder it names (a run directory's newest step now),
    so the pointer every checkpoint saves keeps naming the same weights. `hf:` folders are kept."""
    init_from = recipe.checkpoint.init_from
    if not recipe.lora.enabled or not init_from or init_from.startswith("hf:"):
        return recipe
    from spillway.recipes.train.checkpoint import resolve_step_dir
    step_dir = str(resolve_step_dir(init_from))
    return dataclasses.replace(recipe, checkpoint=dataclasses.replace(recipe.checkpoint, init_from=step_dir))


def load_base(recipe: Recipe, params, param_shardings, say=print):
    """`params` with the base weights of `checkpoint.init_from` (the adapters as they are): a LoRA run
    reads its base this way at every start, a resume too, since checkpoints hold only the adapters."""
    from spillway.recipes.train.init_weights import load_init_weights

    adapters, base = split(params)
    _, base_shardings = split(param_shardings)
    abstract_base = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), base, base_shardings)
    loaded = load_init_weights(recipe, abstract_base, say)
    return join(adapters, loaded)


def restore_run_params(step_dir, recipe: Recipe, abstract_params):
    """The whole parameter tree of a saved step, into `abstract_params`' shardings: for a LoRA run the
    base from its pointer and the adapters from the step (generate, export)."""
    from spillway.recipes.train.checkpoint import restore_params_only

    if not recipe.lora.enabled:
        return restore_params_only(step_dir, abstract_params)[0]
    abstract_adapters, abstract_base = split(abstract_params)
    adapters = restore_params_only(step_dir, abstract_adapters)[0]
    base = _load_base_weights(recipe, abstract_base)
    return join(adapters, base)


def _load_base_weights(recipe: Recipe, abstract_base):
    from spillway.recipes.train.init_weights import load_init_weights

    init_from = recipe.checkpoint.init_from
    if init_from and not init_from.startswith("hf:") and not Path(init_from).expanduser().exists():
        from spillway.recipes.train.checkpoint import CheckpointError
        raise CheckpointError(f"the LoRA run's base checkpoint.init_from={init_from} does not exist any more: "
                              f"its adapters need it (put it back, or point the saved recipe at a copy)")
    return load_init_weights(recipe, abstract_base, say=lambda *_: None)
