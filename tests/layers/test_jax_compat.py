"""layers/jax_compat.py: the one place that knows how each tested JAX version spells an API.

These run in every environment of the matrix (jax 0.10.2, 0.11.2, newest), so
each spelling is exercised by the JAX that needs it.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spillway.layers import jax_compat


def test_on_host_computes_f_and_leaves_its_outputs_in_host_memory():
    x = jax.device_put(jnp.arange(8, dtype=jnp.float32), jax.memory.Space.Host)

    @jax.jit
    def step(x):
        doubled, plus_one = jax_compat.on_host(lambda a: (a * 2, a + 1),
                                               out_memory_spaces=jax.memory.Space.Host)(x)
        return doubled, plus_one, jax.device_put(plus_one, jax.memory.Space.Device)

    doubled, plus_one, on_device = step(x)
    np.testing.assert_array_equal(np.asarray(doubled), np.arange(8) * 2)
    np.testing.assert_array_equal(np.asarray(on_device), np.arange(8) + 1)
    assert doubled.sharding.memory_kind == plus_one.sharding.memory_kind == "pinned_host"
    assert on_device.sharding.memory_kind == "device"


def test_the_transform_found_takes_output_memory_spaces():
    # Whichever name this JAX gives it (compute_on2 on 0.10, compute_on after).
    parameters = inspect.signature(jax_compat._compute_on_transform()).parameters
    assert {"compute_type", "out_memory_spaces"} <= set(parameters)


def test_an_unknown_spelling_is_an_error_that_points_here(monkeypatch):
    from jax.experimental import compute_on as module

    def context_manager_only(compute_type):   # the jax 0.10 compute_on, without compute_on2 beside it
        raise AssertionError("must not be called")

    monkeypatch.setattr(module, "compute_on", context_manager_only)
    monkeypatch.delattr(module, "compute_on2", raising=False)
    with pytest.raises(ImportError, match="layers/jax_compat.py"):
        jax_compat.on_host(lambda a: a, out_memory_spaces=jax.memory.Space.Host)
