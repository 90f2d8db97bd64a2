"""The deferred update (offload.update=next_forward) with gradient accumulation (train.grad_accum = K > 1).

The step splits its batch into K micro-batches, as the step that applies its own update does
(recipes/train/step.py make_train_step), and runs

    micro-batch 1   the one-batch deferred step (recipes/optim/update_in_forward.py): the pending update
                    applied inside its forward pass, each block layer's just before that layer runs, and
                    its gradient made (the stacked leaves' written over the old pending gradients in HBM)
    micro-batches   a scan, as after the backward pass: each one's gradient with the new weights, added
    2 .. K          in float32 to micro-batch 1's
    after them      the float32 sum divided by K and its global norm: the new pending update, exactly
                    the mean gradient the update after the backward pass hands the optimizer

So only micro-batch 1's forward pass hides the update's link time: clipping needs the global norm of
all K gradients before any layer's update may start, so no compute of step t can run beside step t's
update. The price is compile size: micro-batch 1 runs outside the scan, a second trace of the model
(forward and backward) beside the scan body's.

The pending gradients wait in HBM (offload.pending_gradients=device) as the float32 running sum: a
sum on the host side would cross the link twice per micro-batch (recipes/config.py refuses the host
placement with K > 1). The optimizer state stays in host memory, written in place as with K = 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from spillway.layers.names import LATER_MICRO_BATCHES_SCOPE
from spillway.recipes.optim import update_in_forward
from spillway.recipes.optim.update_in_forward import PendingUpdate
from spillway.recipes.train.batch import micro_batches
from spillway.recipes.train.sft_batch import with_step_denominator

# Metrics the one-batch deferred step adds to its batch's: recomputed here for the mean gradient.
_STEP_METRICS = ("grad_norm", "learning_rate")


def make_train_step(objective, optimizer, grad_accum: int):
    """(params, opt_state, pending, batch) -> (params, opt_state, pending, metrics), as
    update_in_forward.make_train_step, over `grad_accum` micro-batches of `batch`.

    The returned pending gradients are the float32 mean of the micro-batches' (`nothing_pending` makes
    the first step's of that dtype); the metrics are the micro-batches' means, the mean gradient's norm
    and the learning rate it will be applied with.
    """
    first_micro_batch_step = update_in_forward.make_train_step(objective, optimizer, pending_in_host_memory=False)
    grad_fn = jax.value_and_grad(objective, has_aux=True)

    def train_step(params, opt_state, pending: PendingUpdate, batch):
        # Masked targets: each micro-batch's loss is over the whole step's target count (sft_batch.py).
        micro = micro_batches(with_step_denominator(batch, grad_accum), grad_accum)
        first, rest = jax.tree.map(lambda a: a[0], micro), jax.tree.map(lambda a: a[1:], micro)
        params, opt_state, first_pending, first_metrics = first_micro_batch_step(params, opt_state, pending, first)

        def accumulate(grad_sum, micro_batch):
            (_, metrics), grads = grad_fn(params, micro_batch)
            return jax.tree.map(lambda t, g: t + g.astype(jnp.float32), grad_sum, grads), metrics

        # Named so that the planner prices the update beside micro-batch 1's compute alone (recipes/plan/hlo.py).
        with jax.named_scope(LATER_MICRO_BATCHES_SCOPE):
            grad_sum, rest_metrics = lax.scan(accumulate, as_float32(first_pending.grads), rest)
        grads = jax.tree.map(lambda g: g / grad_accum, grad_sum)
        grad_norm = optimizer.grad_norm(grads)   # as Optimizer.update reads it after the backward pass
        metrics = {**_micro_batch_means(first_metrics, rest_metrics), "grad_norm": grad_norm,
                   "learning_rate": first_metrics["learning_rate"]}
        return params, opt_state, PendingUpdate(grads, grad_norm, jnp.ones((), bool)), metrics

    return train_step


def _micro_batch_means(first_metrics: dict, rest_metrics: dict) -> dict:
    """The mean over all micro-batches of each batch metric: micro-batch 1's (without the step's own,
    `_STEP_METRICS`) stacked before the scan's, as the step after the backward pass averages them."""
    first = {k: v for k, v in first_metrics.items() if k not in _STEP_METRICS}
    stacked = jax.tree.map(lambda f, r: jnp.concatenate([f[None], r]), first, rest_metrics)
    return jax.tree.map(lambda m: jnp.mean(m, axis=0), stacked)


def as_float32(tree):
    """Every leaf of `tree` in float32 (a no-op for those already so)."""
    return jax.tree.map(lambda g: g.astype(jnp.float32), tree)


def nothing_pending(params) -> PendingUpdate:
    """update_in_forward.nothing_pending with float32 gradients: what the accumulating step returns, so that
    the first step's pending buffers are the same type as every later one's (and donated into them)."""
    empty = update_in_forward.nothing_pending(params)
    return PendingUpdate(as_float32(empty.grads), empty.grad_norm, empty.apply)
