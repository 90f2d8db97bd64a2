"""Grouped matmul by blocks: rows sorted by group, each block of rows times its group's matrix, in a loop.

`jax.lax.ragged_dot(x, w, group_sizes)` computes, for rows sorted by group,
x[rows of g] @ w[g]. On GPUs jax 0.10.2 hands it to XLA, which expands it into
a dense product masked per group: E times the FLOPs and a [rows, E, d]
intermediate (docs/DESIGN.md section 12). `blocked_grouped_matmul` computes the
same product with memory proportional to the rows:

1. each group's rows are padded to a multiple of `block` (static bound on the
   padded length: rows + groups x (block - 1), rounded to blocks);
2. a loop over the blocks multiplies each [block, d] slice by its group's
   [d, f] matrix (a block never straddles two groups);
3. the rows are gathered back out of the padding.

The loop's backward pass is written out (a custom VJP): the input gradient
is the same loop with the matrices transposed; the weight gradient a loop that
adds each block's x^T @ dy into its group's slice of a float32 accumulator
(in place, a loop carry), so no per-block [E, d, f] temporary exists. Extra
FLOPs: the padding, at most groups x (block - 1) rows. Whether its sequence of
small matmuls is fast on a GPU is a measurement nobody has made here yet.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spillway.layers.jax_compat import varying_mesh_axes


def padded_blocks(rows: int, groups: int, block: int) -> int:
    """Blocks enough for `rows` rows in `groups` groups, each padded to a multiple of `block`."""
    return -(-rows // block) + groups


@jax.custom_vjp
def _blocks_matmul(x_nbd, w_gdf, group_n):
    return jax.lax.map(lambda args: args[0] @ w_gdf[args[1]], (x_nbd, group_n))


def _blocks_matmul_fwd(x_nbd, w_gdf, group_n):
    return _blocks_matmul(x_nbd, w_gdf, group_n), (x_nbd, w_gdf, group_n)


def _blocks_matmul_bwd(residuals, ct_nbf):
    x_nbd, w_gdf, group_n = residuals
    ct_x = jax.lax.map(lambda args: args[0] @ w_gdf[args[1]].T, (ct_nbf, group_n))

    def add_block(ct_w, args):
        x_bd, ct_bf, group = args
        return ct_w.at[group].add(jnp.einsum("bd,bf->df", x_bd, ct_bf, preferred_element_type=jnp.float32))

    # The first block starts the accumulator, so that inside a shard_map it varies over the same mesh
    # axes as every later sum (a zeros carry would vary over none, and scan needs equal carry types).
    first = add_block(jnp.zeros(w_gdf.shape, jnp.float32), (x_nbd[0], ct_nbf[0], group_n[0]))
    ct_w, _ = jax.lax.scan(lambda ct_w, args: (add_block(ct_w, args), None), first,
                           (x_nbd[1:], ct_nbf[1:], group_n[1:]))
    return _like_primal(ct_x, x_nbd), _like_primal(ct_w, w_gdf).astype(w_gdf.dtype), None


def _like_primal(cotangent, primal):
    """Inside a shard_map, the cotangent summed over the mesh axes it varies over and its primal does not
    (tokens split over data x fsdp give a data-replicated weight a per-device partial gradient)."""
    extra = varying_mesh_axes(cotangent) - varying_mesh_axes(primal)
    return jax.lax.psum(cotangent, tuple(sorted(extra))) if extra else cotangent


_blocks_matmul.defvjp(_blocks_matmul_fwd, _blocks_matmul_bwd)


def blocked_grouped_matmul(x_md: jax.Array, w_gdf: jax.Array, group_sizes: jax.Array, block: int) -> jax.Array:
    """x_md[rows of g] @ w_gdf[g] for rows sorted by group (`group_sizes` [G], summing to m): [m, f]."""
    m, d = x_md.shape
    groups = w_gdf.shape[0]
    num_blocks = padded_blocks(m, groups, block)
    group_sizes = group_sizes.astype(jnp.int32)
    padded_sizes = -(-group_sizes // block) * block
    ends = jnp.cumsum(group_sizes)
    padded_ends = jnp.cumsum(padded_sizes)
    rows = jnp.arange(m, dtype=jnp.int32)
    group_m = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)
    position_m = rows - (ends - group_sizes)[group_m] + (padded_ends - padded_sizes)[group_m]
    x_pd = jnp.zeros((num_blocks * block, d), x_md.dtype).at[position_m].set(x_md, unique_indices=True)
    # Blocks past the last group's padding hold zeros; any matrix will do for them.
    block_starts = jnp.arange(num_blocks, dtype=jnp.int32) * block
    group_n = jnp.minimum(jnp.searchsorted(padded_ends, block_starts, side="right"), groups - 1).astype(jnp.int32)
    out_nbf = _blocks_matmul(x_pd.reshape(num_blocks, block, d), w_gdf, group_n)
    return out_nbf.reshape(num_blocks * block, -1)[position_m]
