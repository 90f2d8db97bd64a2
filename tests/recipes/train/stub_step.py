"""A stand-in for the train step's model work, so the loop's host-side policy runs in seconds.

`stub_programs` (for `train(programs=...)`, recipes/train/run_state.StepPrograms)
keeps the run's real optimizer (its schedule, its state, checkpointed and
restored as a run's) but replaces the model's forward and backward pass with a
function of the parameters and the batch that is a few reductions:

    loss(params, batch) = mean token id / vocab + mean over leaves of mean(p^2)
    gradient            = a constant per leaf: that loss's batch term

so a step compiles in a second instead of tens. What it keeps of a real run:
the loss depends on the batch drawn and on the weights (an exact resume gives
the same losses, a resume from the wrong data position does not); the
learning rate is the schedule's (warmup from 0: step 1 leaves the weights
where they are); a learning rate of 1e30 makes weights that are still finite
(about 1e30) and whose next loss overflows to inf, the failure the divergence
check exists for.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from spillway.recipes.train.divergence import WeightsReport
from spillway.recipes.train.run_state import StepPrograms


def _stub_loss(params, batch, vocab_size: int):
    leaves = [leaf for leaf in jax.tree.leaves(params) if jnp.issubdtype(leaf.dtype, jnp.inexact)]
    data_term = jnp.mean(batch.tokens.astype(jnp.float32)) / vocab_size
    weight_term = jnp.mean(jnp.stack([jnp.mean(jnp.square(leaf.astype(jnp.float32))) for leaf in leaves]))
    return data_term + weight_term, data_term


def stub_programs(s) -> StepPrograms:
    """StepPrograms of TrainSetup `s` with the stub loss; the optimizer update is `s`'s own."""
    vocab = s.recipe.model.vocab_size

    def train_step(params, opt_state, pending, batch):
        loss, data_term = _stub_loss(params, batch, vocab)
        grads = jax.tree.map(lambda p: jnp.full(p.shape, data_term, p.dtype), params)
        params, opt_state, stats = s.optimizer.update(grads, opt_state, params)
        return params, opt_state, pending, {"loss": loss, **stats}

    scalar = NamedSharding(s.mesh, PartitionSpec())
    step = jax.jit(train_step, in_shardings=(s.param_shardings, s.opt_state_shardings, None, s.batch_sharding),
                   out_shardings=(s.param_shardings, s.opt_state_shardings, None, scalar), donate_argnums=(0, 1))
    # The validation program's (summed loss, count), a text batch counting every target token.
    eval_loss = jax.jit(lambda params, batch: (_stub_loss(params, batch, vocab)[0] * batch.tokens[:, 1:].size,
                                               jnp.float32(batch.tokens[:, 1:].size)))

    @jax.jit
    def check(params, batch):
        leaves = [leaf for leaf in jax.tree.leaves(params) if jnp.issubdtype(leaf.dtype, jnp.inexact)]
        finite = jnp.all(jnp.stack([jnp.isfinite(leaf).all() for leaf in leaves]))
        return jnp.stack([_stub_loss(params, batch, vocab)[0], finite.astype(jnp.float32)])

    def check_weights(params, batch, step_metrics=None) -> WeightsReport:
        loss_after, finite = (float(x) for x in check(params, batch))
        known = step_metrics is not None
        return WeightsReport(loss_after=loss_after, params_finite=bool(finite),
                             step_loss=float(step_metrics["loss"]) if known else None,
                             grad_norm=float(step_metrics["grad_norm"]) if known else None)

    return StepPrograms(step, s.flush, eval_loss, check_weights)
