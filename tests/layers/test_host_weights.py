"""layers/host_weights.py: where a stacked weight lives, its running gradient sum's custom VJP (hand-worked),
host zeros made a layer at a time, and the policy wrapper that never saves a weight's device copy."""

import types

import jax
import jax.numpy as jnp
import numpy as np

from spillway.layers import host_weights


def test_the_metadata_overrides_the_setting_for_one_weight():
    assert host_weights.stacked_weight_memory({}, "host") == "host"
    assert host_weights.stacked_weight_memory({"param_memory": "device"}, "host") == "device"


def test_experts_places_only_the_routed_experts_on_host():
    def memory(axes, **metadata):
        return host_weights.stacked_weight_memory({"logical_axes": axes, **metadata}, "experts")
    assert memory(("layers", "expert", "embed", "mlp")) == "host"      # gate and up
    assert memory(("layers", "expert", "mlp", "embed")) == "host"      # down
    assert memory(("layers", "embed", "expert")) == "device"           # the router
    assert memory(("layers", "embed", "heads", "kv")) == "device"      # attention
    assert memory(("layers", "norm")) == "device"
    assert memory(("layers", "expert", "embed", "mlp"), param_memory="device") == "device"


def test_the_backward_of_an_accumulating_weight_adds_its_gradient_to_the_running_sum():
    """By hand: loss = sum(3 * w * x) with x = [1, 2], so d loss / d w = [3, 6]; the sum [10, 20] comes back
    as [13, 26], in host memory, in place of the sums' gradient."""
    weight = jnp.array([5.0, 7.0])
    x = jnp.array([1.0, 2.0])

    def loss(weight, grad_sum):
        on_device = host_weights.layer_to_device({"w": host_weights.AccumulatingWeight(weight, grad_sum)})["w"]
        return jnp.sum(3.0 * on_device * x)

    grad_sum = jax.device_put(jnp.array([10.0, 20.0]), jax.memory.Space.Host)   # the sums live in host memory
    new_sum = jax.jit(jax.grad(loss, argnums=1))(weight, grad_sum)
    assert host_weights.in_host_memory(new_sum)
    np.testing.assert_array_equal(np.asarray(new_sum), [13.0, 26.0])
    assert float(jax.jit(loss)(weight, grad_sum)) == 3 * (5 + 14)


def test_host_zeros_are_float32_in_host_memory_shaped_like_the_stack():
    stacked = jnp.ones((3, 2, 4), jnp.bfloat16)
    zeros = jax.jit(host_weights.host_zeros_f32_like)(stacked)
    assert zeros.shape == (3, 2, 4) and zeros.dtype == jnp.float32
    assert host_weights.in_host_memory(zeros) and not host_weights.in_host_memory(stacked)
    np.testing.assert_array_equal(np.asarray(zeros), 0)


def test_a_policy_never_saves_the_device_copy_of_a_host_weight():
    def save_everything(prim, *args, **params):
        return True
    wrapped = host_weights.never_save_device_weights(save_everything)
    named = types.SimpleNamespace(name="name")
    assert wrapped(named, name=host_weights.DEVICE_WEIGHTS) is False
    assert wrapped(named, name="mlp_hidden") is True
    assert wrapped(types.SimpleNamespace(name="dot_general")) is True
