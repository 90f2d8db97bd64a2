"""The AdamW update of one piece of one leaf: optax's clip + AdamW chain written out op for op.

    optax.chain(optax.clip_by_global_norm(clip_norm),
                optax.adamw(schedule, b1, b2, eps, weight_decay, mask=decay_mask))

One function serves every placement (a whole leaf on device, a layer or a
piece of rows streamed through HBM, the host CPU), so device and host leaves
give the same numbers (tests/recipes/optim/test_optimizer.py checks it against
that chain). Gradients are upcast to fp32 first; a low-precision parameter with
a master copy becomes the master's rounding (docs/DESIGN.md section 6).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from spillway.recipes.optim.config import OptimizerConfig
from spillway.recipes.optim.layouts import LeafLayout


@dataclasses.dataclass(frozen=True)
class StepScalars:
    """Everything the per-piece update needs besides the piece itself (traced scalars)."""
    grad_norm: jax.Array
    count_inc: jax.Array
    learning_rate: jax.Array
    # A boolean scalar, or None: where False the piece comes back unchanged (a deferred update with
    # nothing pending: recipes/optim/update_in_forward.py).
    apply: jax.Array | None = None


def adamw_piece(cfg: OptimizerConfig, layout: LeafLayout, scalars: StepScalars,
                 grad, param, state):
    """One piece (a leaf, or one layer of a stacked leaf) of clip + AdamW + apply.

    state is (mu, nu) or (mu, nu, master); master is fp32, the moments are fp32 or
    cfg.moment_dtype (read as optax reads a `mu_dtype` moment, and stored rounded to it,
    mu and nu alike). Returns (new param in param's dtype, new state). The operations and their order follow optax 0.2.8
    (clip_by_global_norm, scale_by_adam, add_decayed_weights,
    scale_by_learning_rate, apply_updates) so the numbers match.
    """
    g = grad.astype(jnp.float32)
    if cfg.clip_norm is not None:
        keep = jnp.squeeze(scalars.grad_norm < cfg.clip_norm)
        g = lax.select(keep, g, (g / scalars.grad_norm.astype(g.dtype)) * cfg.clip_norm)
    mu, nu = state[0], state[1]
    # optax's update_moment with order 1 and 2; `g ** 1` kept so the traced ops match.
    mu = (1 - cfg.b1) * (g ** 1) + cfg.b1 * mu
    nu = (1 - cfg.b2) * (g ** 2) + cfg.b2 * nu
    mu_hat = mu / (1 - cfg.b1 ** scalars.count_inc).astype(mu.dtype)
    nu_hat = nu / (1 - cfg.b2 ** scalars.count_inc).astype(nu.dtype)
    update = mu_hat / (jnp.sqrt(nu_hat + 0.0) + cfg.eps)  # + eps_root (0.0), as optax
    weights = state[2] if layout.master else param.astype(jnp.float32)
    if layout.decay and cfg.weight_decay != 0.0:
        update = update + cfg.weight_decay * weights
    # scale_by_learning_rate: step size -lr(count), cast to the update's dtype
    update = jnp.array(-1 * scalars.learning_rate, dtype=update.dtype) * update
    new_weights = (weights + update).astype(jnp.float32)  # optax.apply_updates
    stored = jnp.dtype(cfg.moment_dtype)   # optax's tree_cast(mu, mu_dtype) after the update; nu too
    mu, nu = mu.astype(stored), nu.astype(stored)
    new_state = (mu, nu, new_weights) if layout.master else (mu, nu)
    if scalars.apply is None:
        return new_weights.astype(param.dtype), new_state
    new_state = tuple(jnp.where(scalars.apply, new, old.astype(new.dtype)) for new, old in zip(new_state, state))
    if layout.master:
        # The parameter is its master's rounding whether or not the step applied: the old
        # parameter is not read (a deferred update then never holds the old weights).
        return new_state[2].astype(param.dtype), new_state
    return jnp.where(scalars.apply, new_weights.astype(param.dtype), param), new_state
