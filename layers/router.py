"""The mixture-of-experts router and its auxiliary losses.

`Router` is a linear map from d_model to the expert count, computed and
softmaxed in float32 (the logits are tiny, [tokens, experts], and bfloat16
logits change which expert wins). `route` picks the top-k experts per token
and their combine weights: the top-k probabilities, renormalised to sum to 1
where the family does so (Mixtral, Qwen3-MoE with norm_topk_prob) or left as
they are (Qwen2-MoE without it, DeepSeek-style routers).

`RouterStats` holds what the losses and the logs need as sums, so that they
add over micro-batches, layers and devices: per-expert top-k choice counts
and router probability sums, the token count, the sum of squared
log-partition values and the token-choices a capacity dispatch dropped. The
losses are formed from the sums:

    load_balancing_loss  E * sum_e f_e * P_e, with f_e = (top-k choices of e) / tokens and
                         P_e = (sum of e's router probabilities) / tokens; the statistics of
                         stacked layers are pooled before the product, exactly as Hugging Face's
                         Mixtral / Qwen3-MoE `load_balancing_loss_func` does (so f sums to k and a
                         perfectly balanced router scores k, not 1)
    router_z_loss        mean over tokens of logsumexp(logits)^2 (ST-MoE)
    expert_load          each expert's share of the top-k choices (what the logs plot)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from spillway.layers import names
from spillway.layers.params import normal, param
from spillway.layers.sharding import constrain, current_activation_mesh, logical_to_spec

# The router's output axis is labelled "expert" too; its embed axis takes fsdp first, so it is not split.
ROUTER_AXES = (names.EMBED, names.EXPERT)


class Routing(NamedTuple):
    """Each token's experts and combine weights; tokens flattened or not, experts last."""

    expert_index: jax.Array   # int32 [..., k]
    weight: jax.Array         # float32 [..., k] combine weights
    probs: jax.Array          # float32 [..., E] softmax of the logits
    logits: jax.Array         # float32 [..., E]


class RouterStats(NamedTuple):
    """Sums over tokens (and, stacked, a leading layer axis): they add across micro-batches and devices."""

    expert_choices: jax.Array    # float32 [E]: how many top-k choices went to each expert
    router_prob_sum: jax.Array   # float32 [E]: sum over tokens of each expert's router probability
    tokens: jax.Array            # float32 []: tokens routed
    z_loss_sum: jax.Array        # float32 []: sum over tokens of logsumexp(logits)^2
    dropped: jax.Array           # float32 []: token-choices a capacity dispatch dropped (0 when dropless)


class Router(nnx.Module):
    def __init__(self, d_model: int, num_experts: int, *, param_dtype=jnp.float32, init_std: float = 0.02,
                 rngs: nnx.Rngs):
        self.w = param(rngs, normal(init_std), (d_model, num_experts), ROUTER_AXES, param_dtype)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        """float32 logits [b, t, E], tagged ROUTER_LOGITS."""
        logits_bte = x_btd.astype(jnp.float32) @ self.w[...].astype(jnp.float32)
        return checkpoint_name(constrain(logits_bte, (names.BATCH, names.SEQ, None)), names.ROUTER_LOGITS)


def route(logits: jax.Array, top_k: int, renormalize: bool) -> Routing:
    """Top-k experts of each token by router probability (ties: the lower expert index, as torch.topk)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weight, expert_index = _top_k(probs, top_k)
    if renormalize:
        weight = weight / jnp.sum(weight, axis=-1, keepdims=True)
    return Routing(expert_index.astype(jnp.int32), weight, probs, logits)


def _top_k(probs: jax.Array, top_k: int):
    """lax.top_k, per device under a mesh: XLA's partitioner gathered the whole batch's probabilities
    for a top_k of batch-split ones (jaxlib 0.10.2, CPU); each token's choice needs only its own row."""
    active = current_activation_mesh()
    if active is None or probs.ndim != 3:
        return jax.lax.top_k(probs, top_k)
    mesh, rules = active
    spec = logical_to_spec((names.BATCH, names.SEQ, None), probs.shape, mesh, rules)
    per_device = jax.shard_map(lambda p: tuple(jax.lax.top_k(p, top_k)), mesh=mesh, in_specs=spec,
                               out_specs=(spec, spec))
    return per_device(probs)


def router_stats(routing: Routing, dropped: jax.Array | float = 0.0) -> RouterStats:
    """The sums of one layer's routing over all its tokens."""
    num_experts = routing.probs.shape[-1]
    # A one-hot sum, not a scatter: under a mesh it reduces where the tokens are (a scatter of
    # batch-split indices made XLA gather the whole batch's [tokens, experts] first).
    choices = jnp.sum(jax.nn.one_hot(routing.expert_index, num_experts, dtype=jnp.float32),
                      axis=tuple(range(routing.expert_index.ndim)))
    probs = routing.probs.reshape(-1, num_experts)
    log_z = jax.nn.logsumexp(routing.logits.reshape(-1, num_experts).astype(jnp.float32), axis=-1)
    return RouterStats(choices, jnp.sum(probs, axis=0), jnp.asarray(probs.shape[0], jnp.float32),
                       jnp.sum(log_z ** 2), jnp.asarray(dropped, jnp.float32))


def _pooled(stats: RouterStats) -> RouterStats:
    """Every leading axis (layers, micro-batches) summed away."""
    return RouterStats(*(jnp.sum(jnp.reshape(leaf, (-1,) + (leaf.shape[-1:] if i < 2 else ())), axis=0)
                         for i, leaf in enumerate(stats)))


def load_balancing_loss(stats: RouterStats) -> jax.Array:
    """E * sum_e f_e * P_e over the pooled statistics (see the module docstring)."""
    pooled = _pooled(stats)
    num_experts = pooled.expert_choices.shape[-1]
    fraction = pooled.expert_choices / pooled.tokens
    mean_prob = pooled.router_prob_sum / pooled.tokens
    return num_experts * jnp.sum(fraction * mean_prob)


def router_z_loss(stats: RouterStats) -> jax.Array:
    """Mean over all pooled tokens of logsumexp(logits)^2."""
    pooled = _pooled(stats)
    return pooled.z_loss_sum / pooled.tokens


def expert_load(stats: RouterStats) -> jax.Array:
    """Each expert's share of the top-k choices, per layer where stacked ([..., E], rows sum to 1)."""
    return stats.expert_choices / jnp.sum(stats.expert_choices, axis=-1, keepdims=True)
