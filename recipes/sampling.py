"""Sampling from a trained model: KV-cache decoding with temperature and top-p.

The prompt is processed in one call (prefill) that writes the cache; then one
jitted step per new token reads and extends it. Temperature 0 is greedy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def sample_token(logits_bv: jax.Array, key: jax.Array, temperature: float, top_p: float,
                 vocab_limit: int | None = None) -> jax.Array:
    """One token per row: greedy at temperature 0, else nucleus sampling; ids from `vocab_limit` on never (the
    model's embedding may be larger than its tokenizer, whose decoder has no piece for them)."""
    if vocab_limit is not None and vocab_limit < logits_bv.shape[-1]:
        logits_bv = jnp.where(jnp.arange(logits_bv.shape[-1]) < vocab_limit, logits_bv, -jnp.inf)
    if temperature < np.finfo(np.float32).tiny:   # 0, or so small that only the largest logit could be drawn
        return jnp.argmax(logits_bv, axis=-1)
    # The largest logit made 0 before dividing: a tiny temperature overflowed the others to inf (and inf - inf
    # to NaN: garbage tokens); now they go to -inf, as their probability does.
    logits_bv = logits_bv.astype(jnp.float32)
    logits_bv = (logits_bv - jnp.max(logits_bv, axis=-1, keepdims=True)) / temperature
    if top_p < 1.0:
        sorted_bv = jnp.sort(logits_bv, axis=-1)[:, ::-1]
        cumulative_bv = jnp.cumsum(jax.nn.softmax(sorted_bv, axis=-1), axis=-1)
        # Keep the smallest prefix whose probability reaches top_p (at least one token).
        cutoff_index_b = jnp.sum(cumulative_bv < top_p, axis=-1, keepdims=True)
        cutoff_b1 = jnp.take_along_axis(sorted_bv, cutoff_index_b, axis=-1)
        logits_bv = jnp.where(logits_bv < cutoff_b1, -jnp.inf, logits_bv)
    return jax.random.categorical(key, logits_bv, axis=-1)


_STATIC = ("graphdef", "temperature", "top_p", "vocab_limit")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _prefill(graphdef, state, tokens_bt, cache, key, temperature, top_p, vocab_limit):
    model = nnx.merge(graphdef, state)
    logits_btv, cache = model(tokens_bt, cache=cache, cache_index=jnp.int32(0))
    return sample_token(logits_btv[:, -1], key, temperature, top_p, vocab_limit), cache


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("cache",))
def _decode_step(graphdef, state, token_b, cache, index, key, temperature, top_p, vocab_limit):
    model = nnx.merge(graphdef, state)
    logits_btv, cache = model(token_b[:, None], cache=cache, cache_index=index)
    return sample_token(logits_btv[:, -1], key, temperature, top_p, vocab_limit), cache


def generate(model, prompt_ids: list[int], *, max_new_tokens: int, temperature: float = 0.8, top_p: float = 0.95,
             seed: int = 0, stop_id: int | None = None, stop_ids=(), vocab_limit: int | None = None) -> list[int]:
    """Continue `prompt_ids`; returns only the new tokens (stops early at `stop_id` or any of `stop_ids`, the
    end-of-turn tokens of a chat, which are not returned). `vocab_limit`: the tokenizer's vocabulary size, where
    the model's embedding is larger (ids past it are never drawn)."""
    stops = set(stop_ids) | ({stop_id} if stop_id is not None else set())
    if not prompt_ids:
        raise ValueError("generate needs a non-empty prompt")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    max_len = len(prompt_ids) + max_new_tokens
    if max_len > model.spec.max_seq_len:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"max_seq_len ({model.spec.max_seq_len})")
    graphdef, state = nnx.split(model)
    cache = model.init_cache(1, max_len)
    key = jax.random.key(seed)
    key, sub = jax.random.split(key)
    token, cache = _prefill(graphdef, state, jnp.asarray([prompt_ids], jnp.int32), cache, sub, temperature, top_p,
                            vocab_limit)
    out = []
    for i in range(max_new_tokens):
        token_id = int(np.asarray(token)[0])
        if token_id in stops:
            break
        out.append(token_id)
        if i == max_new_tokens - 1:
            break
        key, sub = jax.random.split(key)
        token, cache = _decode_step(graphdef, state, token, cache, jnp.int32(len(prompt_ids) + i), sub,
                                    temperature, top_p, vocab_limit)
    return out
