"""The two ways an MoE layer sends tokens to its experts and brings the results back.

Both take the same inputs (tokens [b, t, d], the routing's expert indices and
combine weights [b, t, k], the stacked expert weights) and give the layer's
output [b, t, d] plus the number of token-choices dropped:

    dropless   every token copy is computed. The b*t*k copies are sorted by expert,
               the experts run as grouped matmuls (`jax.lax.ragged_dot` or the blocked
               loop of layers/grouped_matmul.py, group sizes from the routing), the
               results are unsorted and summed with the combine weights. Shapes are
               fixed; what varies is where the group boundaries fall. Nothing is dropped.
    capacity   fixed shapes throughout: each sequence (a "group") gives every expert
               `capacity` slots; token copies claim slots in choice-major order (all
               first choices in token order, then all second choices, as GShard and
               ST-MoE do), copies beyond an expert's slots are dropped (they add
               nothing to the output; the residual stream carries the token) and
               counted. The experts run as one batched einsum over
               [experts, groups, capacity, d]. Padding slots cost compute.

Neither is assumed fast (docs/DESIGN.md section 12): XLA's ragged_dot on GPUs
has been reported far below dense matmul speed (and jax 0.10.2's GPU lowering
expands it per group), the blocked loop runs many small matmuls, and the
capacity einsum spends FLOPs on empty slots; the recipe chooses, and the choice
is measured.

Under a mesh (`layers.sharding.activation_sharding`), experts are split over
the mesh axes the "expert" rule names (fsdp by default) and tokens over the
batch axes. The token exchange each dispatch implies:

    capacity   the dispatched buffer is resharded from groups-split to experts-split
               (sharding constraints; XLA lowers the change to an all-to-all), each
               device runs its own experts on every group's slots for them, and the
               results go back the same way.
    dropless   the sorted copies of a device's tokens have data-dependent group sizes,
               which a fixed-shape all-to-all cannot carry without worst-case buffers;
               so the tokens stay and the experts come to them: inside a shard_map,
               each device gathers the expert weights over the axes that split them
               (as FSDP gathers any weight; the backward pass reduce-scatters their
               gradients) and keeps the hidden axis split over "tensor", summing the
               down projection over it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from spillway.layers import names
from spillway.layers.sharding import constrain, current_activation_mesh, logical_to_spec

# Logical axes of the stacked expert weights (one layer's slice: the stack prepends "layers").
EXPERT_IN_AXES = (names.EXPERT, names.EMBED, names.MLP)    # gate and up: [E, d, f]
EXPERT_OUT_AXES = (names.EXPERT, names.MLP, names.EMBED)   # down: [E, f, d]


class ExpertWeights(NamedTuple):
    """One layer's experts, already in the compute dtype. `gate` is None for an ungated MLP."""

    up: jax.Array             # [E, d, f]
    down: jax.Array           # [E, f, d]
    gate: jax.Array | None    # [E, d, f]


def expert_capacity(tokens_per_group: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert per group: ceil(factor * k * tokens / E), at most the group's tokens (an
    expert is chosen at most once per token); a factor of E / k or more drops nothing."""
    return max(1, min(tokens_per_group, math.ceil(capacity_factor * top_k * tokens_per_group / num_experts)))


def _hidden(x: jax.Array, weights: ExpertWeights, act: Callable, matmul: Callable) -> jax.Array:
    up = checkpoint_name(matmul(x, weights.up), names.EXPERT_HIDDEN)
    if weights.gate is None:
        return act(up)
    gate = checkpoint_name(matmul(x, weights.gate), names.EXPERT_HIDDEN)
    return act(gate) * up


# --- dropless ------------------------------------------------------------------------------------

def _dropless_local(x_nd, expert_nk, weight_nk, weights: ExpertWeights, act, num_experts: int, grouped_matmul):
    """Sort, grouped matmuls, unsort and combine, on the tokens and experts this program holds."""
    n, k = expert_nk.shape
    flat_expert = expert_nk.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)               # copy i of the sorted list is flat copy order[i]
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[flat_expert].add(1)
    x_sorted = checkpoint_name(x_nd[order // k], names.EXPERT_INPUT)
    matmul = lambda a, w: grouped_matmul(a, w, group_sizes)   # noqa: E731
    out_sorted = checkpoint_name(matmul(_hidden(x_sorted, weights, act, matmul), weights.down), names.EXPERT_OUT)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))
    out_nkd = out_sorted[inverse].reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", out_nkd, weight_nk.astype(out_nkd.dtype))


def dropless(x_btd, expert_btk, weight_btk, weights: ExpertWeights, act: Callable,
             grouped_matmul: Callable = jax.lax.ragged_dot):
    """(output [b, t, d], dropped = 0). Under a mesh, runs per device with the experts gathered.

    `grouped_matmul(rows sorted by group, [G, d, f], group sizes)` is `jax.lax.ragged_dot` or
    `layers.grouped_matmul.blocked_grouped_matmul` (with its block size bound)."""
    b, t, d = x_btd.shape
    num_experts = weights.up.shape[0]
    active = current_activation_mesh()
    if active is None:
        y_nd = _dropless_local(x_btd.reshape(b * t, d), expert_btk.reshape(b * t, -1),
                               weight_btk.reshape(b * t, -1), weights, act, num_experts, grouped_matmul)
        return y_nd.reshape(b, t, d), jnp.zeros((), jnp.float32)
    y_btd = _dropless_sharded(x_btd, expert_btk, weight_btk, weights, act, grouped_matmul, *active)
    return y_btd, jnp.zeros((), jnp.float32)


def _axes_of(entry) -> tuple[str, ...]:
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def _dropless_sharded(x_btd, expert_btk, weight_btk, weights: ExpertWeights, act, grouped_matmul, mesh, rules):
    num_experts = weights.up.shape[0]
    token_spec = logical_to_spec(names.RESIDUAL_AXES, x_btd.shape, mesh, rules)
    route_spec = PartitionSpec(token_spec[0], token_spec[1], None)
    in_spec = logical_to_spec(EXPERT_IN_AXES, weights.up.shape, mesh, rules)
    out_spec = logical_to_spec(EXPERT_OUT_AXES, weights.down.shape, mesh, rules)
    hidden_axes = _axes_of(in_spec[2])      # the hidden axis stays split (tensor parallel)
    if _axes_of(out_spec[1]) != hidden_axes:
        raise ValueError(f"expert weights split their hidden axis differently: up {in_spec}, down {out_spec}")

    def gather(w, spec, keep_dim):
        for dim, entry in enumerate(spec):
            if dim != keep_dim and _axes_of(entry):
                w = jax.lax.all_gather(w, _axes_of(entry), axis=dim, tiled=True)
        return w

    def per_device(x_btd, expert_btk, weight_btk, up, down, gate):
        local = ExpertWeights(gather(up, in_spec, 2), gather(down, out_spec, 1),
                              None if gate is None else gather(gate, in_spec, 2))
        b, t, d = x_btd.shape
        y_nd = _dropless_local(x_btd.reshape(b * t, d), expert_btk.reshape(b * t, -1),
                               weight_btk.reshape(b * t, -1), local, act, num_experts, grouped_matmul)
        if hidden_axes:
            y_nd = jax.lax.psum(y_nd, hidden_axes)
        return y_nd.reshape(b, t, d)

    gate_spec = None if weights.gate is None else in_spec
    run = jax.shard_map(per_device, mesh=mesh, out_specs=token_spec,
                        in_specs=(token_spec, route_spec, route_spec, in_spec, out_spec, gate_spec))
    return run(x_btd, expert_btk, weight_btk, weights.up, weights.down, weights.gate)


# --- capacity ------------------------------------------------------------------------------------

def capacity_slots(expert_gsk: jax.Array, num_experts: int, capacity: int) -> tuple[jax.Array, jax.Array]:
    """(slot [g, s, k] of each token copy in its expert's queue, kept [g, s, k]): choice-major priority."""
    g, s, k = expert_gsk.shape
    choice_major = jnp.swapaxes(expert_gsk, 1, 2).reshape(g, k * s)
    one_hot = jax.nn.one_hot(choice_major, num_experts, dtype=jnp.int32)        # [g, k*s, E]
    position = jnp.sum((jnp.cumsum(one_hot, axis=1) - 1) * one_hot, axis=-1)     # [g, k*s]
    slot = jnp.swapaxes(position.reshape(g, k, s), 1, 2)
    return slot, slot < capacity


def capacity(x_btd, expert_btk, weight_btk, weights: ExpertWeights, act: Callable, capacity_factor: float):
    """(output [b, t, d], token-choices dropped). Each sequence is a group with `expert_capacity` slots
    per expert."""
    b, t, d = x_btd.shape
    num_experts, k = weights.up.shape[0], expert_btk.shape[-1]
    slots = expert_capacity(t, num_experts, k, capacity_factor)
    slot_btk, kept_btk = capacity_slots(expert_btk, num_experts, slots)
    # Flat slot index into [E * C]; a dropped copy points past the end, where scatters drop and gathers fill 0.
    index_bn = jnp.where(kept_btk, expert_btk * slots + slot_btk, num_experts * slots).reshape(b, t * k)
    copies_bnd = jnp.repeat(x_btd, k, axis=1)             # [b, t*k, d]: copy j of token i at i*k+j

    def scatter(copies_nd, index_n):
        return jnp.zeros((num_experts * slots, d), x_btd.dtype).at[index_n].add(copies_nd, mode="drop")

    buffer_becd = jax.vmap(scatter)(copies_bnd, index_bn).reshape(b, num_experts, slots, d)
    buffer_becd = constrain(buffer_becd, (names.BATCH, None, None, names.ACT_EMBED))
    # Groups-split to experts-split: the token exchange (an all-to-all over the expert axes).
    buffer_ebcd = checkpoint_name(constrain(jnp.swapaxes(buffer_becd, 0, 1),
                                            (names.EXPERT, names.BATCH, None, names.ACT_EMBED)), names.EXPERT_INPUT)

    def einsum_to(feature_axis):
        def matmul(a_ebcx, w_exy):
            return constrain(jnp.einsum("ebcx,exy->ebcy", a_ebcx, w_exy),
                             (names.EXPERT, names.BATCH, None, feature_axis))
        return matmul

    hidden_ebcf = _hidden(buffer_ebcd, weights, act, einsum_to(names.ACT_MLP))
    out_ebcd = checkpoint_name(einsum_to(names.ACT_EMBED)(hidden_ebcf, weights.down), names.EXPERT_OUT)
    out_becd = constrain(jnp.swapaxes(out_ebcd, 0, 1), (names.BATCH, None, None, names.ACT_EMBED))
    gathered_bnd = jax.vmap(lambda out, index: out.at[index].get(mode="fill", fill_value=0))(
        out_becd.reshape(b, num_experts * slots, d), index_bn)
    combine_btk = jnp.where(kept_btk, weight_btk, 0.0).astype(gathered_bnd.dtype)
    y_btd = jnp.einsum("btkd,btk->btd", gathered_bnd.reshape(b, t, k, d), combine_btk)
    return y_btd, jnp.sum(~kept_btk).astype(jnp.float32)
