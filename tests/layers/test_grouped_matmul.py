"""The blocked grouped matmul (layers/grouped_matmul.py) equals `jax.lax.ragged_dot`, values and gradients,
including empty groups, one group holding every row, and blocks larger than every group."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spillway.layers.grouped_matmul import blocked_grouped_matmul, padded_blocks


@pytest.mark.parametrize("group_sizes, block", [([3, 0, 5, 1, 4], 4), ([13, 0, 0, 0, 0], 4), ([0, 0, 0, 0, 13], 3),
                                                ([2, 2, 2, 3, 4], 16), ([1, 1, 1, 1, 9], 1)])
def test_blocked_equals_ragged_dot(group_sizes, block):
    sizes = jnp.asarray(group_sizes, jnp.int32)
    rows = sum(group_sizes)
    keys = jax.random.split(jax.random.key(0), 3)
    x_md, w_gdf = jax.random.normal(keys[0], (rows, 6)), jax.random.normal(keys[1], (5, 6, 7))
    cotangent = jax.random.normal(keys[2], (rows, 7))

    def objective(matmul):
        return jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(matmul(x, w) * cotangent), argnums=(0, 1)))

    want, want_grads = objective(lambda x, w: jax.lax.ragged_dot(x, w, sizes))(x_md, w_gdf)
    got, got_grads = objective(lambda x, w: blocked_grouped_matmul(x, w, sizes, block))(x_md, w_gdf)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(got_grads, want_grads):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(blocked_grouped_matmul(x_md, w_gdf, sizes, block),
                               jax.lax.ragged_dot(x_md, w_gdf, sizes), rtol=1e-5, atol=1e-5)


def test_the_padding_bound_holds_for_the_worst_case():
    """Every group one row past a multiple of the block: rows / block + groups blocks at most."""
    assert padded_blocks(13, 5, 4) == 4 + 5
    sizes = [5, 5, 1, 1, 1]          # ceil: 2 + 2 + 1 + 1 + 1 = 7 blocks <= 9
    assert sum(-(-s // 4) for s in sizes) <= padded_blocks(sum(sizes), 5, 4)
