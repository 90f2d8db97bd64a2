"""A LoRA run's train step and optimizer: the gradient of the adapters only, state for them only.

The pieces the train step (recipes/train/step.py) builds on; what checkpoints
and a run's start make of them is recipes/train/lora_state.py (docs/DESIGN.md
section 13). `split` / `join` take the model's parameter tree apart into the
adapters (`nnx.LoRAParam`s, layers/lora.py) and the frozen base, and put it
together again with the same structure.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from spillway.layers import lora
from spillway.recipes.config import Recipe
from spillway.recipes.train.batch import Batch, micro_batches
from spillway.recipes.train.sft_batch import with_step_denominator


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
    """(params, opt_state, pending, Batch) -> (params, opt_state, pending, metrics), the gradient taken for
    the adapters only; `pending` is None (the signature of every step, step.TrainSetup.train_step).

    `objective(params, Batch) -> (value, metrics)` is step.make_objective's: the one loss entry point, which
    reads the batch's loss mask, segment ids and positions as the whole-model step's does. Micro-batches
    are taken as step.make_train_step takes them (batch.micro_batches: rows m, m + grad_accum, ...) and
    their float32 gradient sum is divided by their count, so the adapters' update is the one a
    whole-model run would make for them.
    """
    def train_step(params, opt_state, pending: None, batch: Batch):
        adapters, base = split(params)
        key = dropout_key(seed, opt_state.count)

        def adapter_objective(adapters, micro_batch, micro_key):
            with lora.dropout_key(micro_key):
                return objective(join(adapters, base), micro_batch)

        grad_fn = jax.value_and_grad(adapter_objective, has_aux=True)
        if grad_accum == 1:
            (_, metrics), grads = grad_fn(adapters, batch, key)
        else:
            # Masked targets: each micro-batch's loss is over the whole step's target count (sft_batch.py).
            micro = micro_batches(with_step_denominator(batch, grad_accum), grad_accum)

            def accumulate(grad_sum, indexed):
                index, micro_batch = indexed
                (_, metrics), grads = grad_fn(adapters, micro_batch, jax.random.fold_in(key, index))
                return jax.tree.map(lambda t, g: t + g.astype(jnp.float32), grad_sum, grads), metrics

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), adapters)
            grad_sum, per_micro = jax.lax.scan(accumulate, zeros, (jnp.arange(grad_accum), micro))
            grads = jax.tree.map(lambda g: g / grad_accum, grad_sum)
            metrics = jax.tree.map(lambda m: jnp.mean(m, axis=0), per_micro)
        params, opt_state, stats = optimizer.update(grads, opt_state, params)
        return params, opt_state, pending, {**metrics, **stats}
    return train_step
