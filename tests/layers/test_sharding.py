"""Sharding on 8 fake CPU devices: parameters follow the logical rules; a sharded step runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from layers.sharding import batch_sharding, create_sharded, logical_to_spec, make_mesh
from models.llama import Llama, llama_config


def test_eight_fake_devices():
    assert jax.device_count() == 8, "tests/conftest.py sets --xla_force_host_platform_device_count=8"


def test_make_mesh_fills_minus_one_and_rejects_mismatch():
    assert dict(make_mesh(2, -1, 2).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    with pytest.raises(ValueError, match="= 12 devices, but 8 devices are available"):
        make_mesh(3, 2, 2)
    with pytest.raises(ValueError, match="does not divide 8 devices"):
        make_mesh(3, -1, 1)


def test_undividable_dims_are_replicated():
    mesh = make_mesh(2, 2, 2)
    assert logical_to_spec(("embed", "kv_heads", "head_dim"), (8, 1, 4), mesh) == P("fsdp", None, None)
    assert logical_to_spec(("embed", "mlp"), (7, 6), mesh) == P(None, "tensor")


@pytest.fixture(scope="module")
def sharded_model():
    cfg = llama_config("tiny_odd", d_model=64, num_heads=4, num_kv_heads=2, mlp_hidden=96, vocab_size=130,
                       remat="offload_dots")
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    return create_sharded(lambda: Llama(cfg, rngs=nnx.Rngs(0)), mesh), mesh


def test_parameters_are_sharded_as_the_rules_say(sharded_model):
    model, mesh = sharded_model
    blocks = model.layers.blocks
    spec = lambda v: v.get_value().sharding.spec  # noqa: E731
    assert spec(model.embed.table) == P("tensor", "fsdp")
    assert spec(model.head.w) == P("fsdp", "tensor")
    assert spec(blocks.attn.wq) == P(None, "fsdp", "tensor", None)
    assert spec(blocks.attn.wk) == P(None, "fsdp", "tensor", None)
    assert spec(blocks.attn.wo) == P(None, "tensor", None, "fsdp")
    assert spec(blocks.mlp.w_gate) == P(None, "fsdp", "tensor")
    assert spec(blocks.mlp.w_down) == P(None, "tensor", "fsdp")
    assert spec(blocks.attn_norm.scale) == P(None, None)
    assert model.layers.blocks.attn.wq.get_value().sharding.mesh.shape == mesh.shape


def test_sharded_forward_and_backward_match_single_device(sharded_model):
    model, mesh = sharded_model
    tokens = jax.random.randint(jax.random.key(0), (4, 13), 0, 130)
    tokens_sharded = jax.device_put(tokens, batch_sharding(mesh))
    assert tokens_sharded.sharding.spec == P(("data", "fsdp"), None)

    def loss_fn(model, tokens):
        logits = model(tokens[:, :-1]).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

    loss, grads = jax.jit(nnx.value_and_grad(loss_fn))(model, tokens_sharded)
    # Gradients come back sharded like the parameters.
    assert grads.layers.blocks.mlp.w_up.get_value().sharding.spec == P(None, "fsdp", "tensor")
    # Same numbers on one device.
    local = jax.tree.map(lambda x: jax.device_put(x, jax.devices()[0]), nnx.state(model))
    single = nnx.merge(nnx.graphdef(model), local)
    ref_loss, ref_grads = jax.jit(nnx.value_and_grad(loss_fn))(single, tokens)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(grads.layers.blocks.mlp.w_up.get_value(), ref_grads.layers.blocks.mlp.w_up.get_value(),
                               rtol=1e-4, atol=1e-6)
