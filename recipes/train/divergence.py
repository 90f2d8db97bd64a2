"""Never save diverged weights: a check of the state about to be saved (or just restored), on device.

A run whose learning rate is far too high can produce weights that are still
finite (5e29) but whose next loss is NaN: checking only that the parameters
are finite would save them, and every resume would diverge again at once.
Even the loss of those weights on the batch that produced them can be finite
(measured on the micro recipe: 6.24, with the next batch's loss NaN): the
tokens of that batch had their embeddings blown up so far that the norms
flatten them to zero, while tokens not yet seen still reach the exploded
layers. So the check asks what the next step would compute, in one jitted
call and one transfer of four numbers:

* the loss and gradient norm of the step being saved are finite;
* every parameter is finite (one reduction over the parameters);
* the loss of the weights being saved on the *next* batch, the one a resumed
  run trains on first, is finite: exactly the next step's loss, one forward
  pass per save (small next to the save). With grad_accum > 1 the forward
  runs one micro-batch at a time (lax.map), so it needs no more memory than
  the step.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from spillway.recipes.train.batch import Batch, micro_batches
from spillway.recipes.train.step import make_loss_fn


@dataclasses.dataclass(frozen=True)
class WeightsReport:
    loss_after: float              # loss of the weights themselves on the next batch
    params_finite: bool
    step_loss: float | None = None  # loss and gradient norm of the step that produced the weights
    grad_norm: float | None = None  # (None after a restore: not known)

    def problem(self) -> str | None:
        """What is wrong, for a message, or None if the weights can be saved."""
        problems = []
        if self.step_loss is not None and not math.isfinite(self.step_loss):
            problems.append(f"the step's loss was {self.step_loss}")
        if self.grad_norm is not None and not math.isfinite(self.grad_norm):
            problems.append(f"the step's gradient norm was {self.grad_norm}")
        if not self.params_finite:
            problems.append("some parameters are NaN or infinite")
        if not math.isfinite(self.loss_after):
            problems.append(f"the weights give loss {self.loss_after} on the next batch")
        return "; ".join(problems) or None


def make_weights_check(graphdef, mesh, *, loss_chunk: int, grad_accum: int, param_shardings, batch_sharding):
    """(params, next Batch, step metrics or None) -> WeightsReport, one jitted call."""
    loss_fn = make_loss_fn(graphdef, loss_chunk, mesh)

    def batch_loss(params, batch: Batch):
        if grad_accum == 1:
            return loss_fn(params, batch)
        # the train step's micro-batches (recipes/train/batch.py)
        return jax.lax.map(lambda micro: loss_fn(params, micro), micro_batches(batch, grad_accum)).mean()

    def check(params, batch, step_loss, grad_norm):
        leaves = [leaf for leaf in jax.tree.leaves(params) if jnp.issubdtype(leaf.dtype, jnp.inexact)]
        params_finite = jnp.all(jnp.stack([jnp.isfinite(leaf).all() for leaf in leaves]))
        return jnp.stack([jnp.asarray(step_loss, jnp.float32), jnp.asarray(grad_norm, jnp.float32),
                          batch_loss(params, batch).astype(jnp.float32), params_finite.astype(jnp.float32)])

    jitted = jax.jit(check, in_shardings=(param_shardings, batch_sharding, None, None))

    def run(params, batch: Batch, step_metrics: dict | None = None) -> WeightsReport:
        """`batch`: the next batch to train on. `step_metrics`: the train step's metrics ("loss",
        "grad_norm") when the weights come from a step (None after a restore)."""
        known = step_metrics is not None
        values = np.asarray(jitted(params, batch, step_metrics["loss"] if known else 0.0,
                                   step_metrics["grad_norm"] if known else 0.0))
        return WeightsReport(loss_after=float(values[2]), params_finite=bool(values[3]),
                             step_loss=float(values[0]) if known else None,
                             grad_norm=float(values[1]) if known else None)

    return run
