"""The training loss: next-token cross-entropy in float32, whole or a chunk of tokens at a time.

Both see the logits the model gives: a family's final-logit soft-cap (Gemma 2)
is applied by the model's head, whole (`DecoderLM.logits`) or as the
`logits_fn` of `DecoderLM.split_head` that the chunked loss calls per chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def token_cross_entropy(logits_btv: jax.Array, targets_bt: jax.Array) -> jax.Array:
    """Each token's next-token cross-entropy [b, t] in float32, whatever the logits' dtype."""
    logits_btv = logits_btv.astype(jnp.float32)
    log_z_bt = jax.nn.logsumexp(logits_btv, axis=-1)
    target_logit_bt = jnp.take_along_axis(logits_btv, targets_bt[..., None], axis=-1)[..., 0]
    return log_z_bt - target_logit_bt


def cross_entropy(logits_btv: jax.Array, targets_bt: jax.Array, weights_bt: jax.Array | None = None,
                  denominator: jax.Array | None = None) -> jax.Array:
    """Mean next-token cross-entropy in float32; with `weights_bt` (the loss mask) the mean over the weighted
    targets: sum(w * ce) / `denominator` (default sum(w)), as transformers' labels=-100 gives; 0, not NaN,
    when no token counts."""
    losses_bt = token_cross_entropy(logits_btv, targets_bt)
    if weights_bt is None:
        return jnp.mean(losses_bt)
    return masked_mean(jnp.sum(losses_bt * weights_bt), weights_bt, denominator)


def masked_mean(total: jax.Array, weights_bt: jax.Array, denominator: jax.Array | None) -> jax.Array:
    """`total` over the number of targets (`denominator`, else the weights' sum); 0 when there are none."""
    count = jnp.sum(weights_bt) if denominator is None else denominator
    return jnp.where(count > 0, total / jnp.maximum(count, 1e-9), 0.0)


def chunked_cross_entropy(logits_fn, head_params, x_btd: jax.Array, targets_bt: jax.Array,
                          chunk: int, weights_bt: jax.Array | None = None,
                          denominator: jax.Array | None = None) -> jax.Array:
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
    if weights_bt is None:
        return _chunked_loss_sum(logits_fn, head_params, x_nbcd, targets_nbc, None) / targets_bt.size
    weights_nbc = weights_bt.astype(jnp.float32).reshape(b, t // chunk, chunk).swapaxes(0, 1)
    return masked_mean(_chunked_loss_sum(logits_fn, head_params, x_nbcd, targets_nbc, weights_nbc), weights_bt,
                       denominator)


def _chunk_loss_sum(logits_fn, head_params, x_bcd, targets_bc, weights_bc):
    losses_bc = token_cross_entropy(logits_fn(head_params, x_bcd), targets_bc)
    return jnp.sum(losses_bc) if weights_bc is None else jnp.sum(losses_bc * weights_bc)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked_loss_sum(logits_fn, head_params, x_nbcd, targets_nbc, weights_nbc):
    def step(total, chunk_inputs):
        return total + _chunk_loss_sum(logits_fn, head_params, *chunk_inputs), None

    total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), (x_nbcd, targets_nbc, weights_nbc))
    return total


def _chunked_loss_sum_fwd(logits_fn, head_params, x_nbcd, targets_nbc, weights_nbc):
    residuals = (head_params, x_nbcd, targets_nbc, weights_nbc)
    return _chunked_loss_sum(logits_fn, head_params, x_nbcd, targets_nbc, weights_nbc), residuals


def _chunked_loss_sum_bwd(logits_fn, residuals, g):
    head_params, x_nbcd, targets_nbc, weights_nbc = residuals

    def step(head_grad_sum, chunk_inputs):
        x_bcd, targets_bc, weights_bc = chunk_inputs
        _, vjp = jax.vjp(lambda h, x: _chunk_loss_sum(logits_fn, h, x, targets_bc, weights_bc), head_params, x_bcd)
        head_grad, x_grad = vjp(g)
        return jax.tree.map(lambda s, h: s + h.astype(jnp.float32), head_grad_sum, head_grad), x_grad

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), head_params)
    head_grad_sum, x_grad_nbcd = jax.lax.scan(step, zeros, (x_nbcd, targets_nbc, weights_nbc))
    head_grad = jax.tree.map(lambda s, p: s.astype(p.dtype), head_grad_sum, head_params)
    targets_grad = np.zeros(targets_nbc.shape, jax.dtypes.float0)   # integer input: no gradient
    # The loss mask is data, not a parameter: no gradient flows into it.
    weights_grad = None if weights_nbc is None else jnp.zeros_like(weights_nbc)
    return head_grad, x_grad_nbcd, targets_grad, weights_grad


_chunked_loss_sum.defvjp(_chunked_loss_sum_fwd, _chunked_loss_sum_bwd)
