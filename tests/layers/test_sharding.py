"""Sharding on 8 fake CPU devices: parameters and activations follow the logical rules; a sharded step runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from spillway.layers.mesh import MeshConfig
from spillway.layers.sharding import activation_sharding, batch_sharding, constrain, create_sharded, logical_to_spec, make_mesh
from spillway.models.decoder import DecoderLM
from spillway.models.registry import preset_config


def test_eight_fake_devices():
    assert jax.device_count() == 8, "tests/conftest.py sets --xla_force_host_platform_device_count=8"


def test_make_mesh_fills_minus_one_and_rejects_mismatch():
    assert dict(make_mesh(MeshConfig(2, -1, 2)).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    # The one mesh rule's words (layers/mesh.py), the planner's too.
    with pytest.raises(ValueError, match="data=3 x fsdp=2 x tensor=2 needs 12 devices, but the device count is 8"):
        make_mesh(MeshConfig(3, 2, 2))
    with pytest.raises(ValueError, match="does not fit 8 devices: 8 is not a multiple of 3"):
        make_mesh(MeshConfig(3, -1, 1))


def test_undividable_dims_are_replicated():
    mesh = make_mesh(MeshConfig(2, 2, 2))
    assert logical_to_spec(("embed", "kv_heads", "head_dim"), (8, 1, 4), mesh) == P("fsdp", None, None)
    assert logical_to_spec(("embed", "mlp"), (7, 6), mesh) == P(None, "tensor")


@pytest.fixture(scope="module")
def sharded_model():
    cfg = preset_config("llama", "tiny_odd", d_model=64, num_heads=4, num_kv_heads=2, mlp_hidden=96, vocab_size=130)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    return create_sharded(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0), remat="offload_dots"), mesh), mesh


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


def _constraint_specs(fn, *args):
    """PartitionSpecs of every sharding_constraint in fn's jaxpr (sub-jaxprs included)."""
    import jax.extend.core as jex_core
    found = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "sharding_constraint":
                found.append(eqn.params["sharding"].spec)
            for sub in jex_core.jaxprs_in_params(eqn.params):
                visit(sub)

    visit(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_constrain_is_a_no_op_without_a_mesh_and_checks_the_rank():
    x = jnp.ones((4, 6, 8))
    assert _constraint_specs(lambda x: constrain(x, ("batch", "seq", "act_embed")), x) == []
    with activation_sharding(make_mesh(MeshConfig(2, 2, 2))):
        with pytest.raises(ValueError, match="do not match an activation of shape"):
            constrain(x, ("batch", "act_embed"))


def test_activations_are_split_over_the_batch_not_over_d_model(sharded_model):
    """Inside activation_sharding the residual stream is batch-sharded over data x fsdp, heads and
    MLP hidden over tensor: never the weights' fsdp-on-embed layout."""
    model, mesh = sharded_model
    tokens = jnp.zeros((4, 12), jnp.int32)

    def forward(model, tokens):
        with activation_sharding(mesh):
            return model(tokens)

    specs = _constraint_specs(forward, model, tokens)
    residual = P(("data", "fsdp"), None, None)
    # embedding, block input and output (the scanned body is traced once), attention out, MLP out
    assert specs.count(residual) == 5, specs
    assert P(("data", "fsdp"), None, "tensor") in specs          # MLP hidden (96 / 2) and logits
    assert P(("data", "fsdp"), None, "tensor", None) in specs    # query heads (4 / 2)
    assert all("fsdp" not in (spec[-1] or ()) for spec in specs), "an activation's feature axis on fsdp"


def test_forward_and_backward_with_activation_constraints_match_single_device(sharded_model):
    model, mesh = sharded_model
    tokens = jax.random.randint(jax.random.key(1), (4, 13), 0, 130)

    def loss_fn(model, tokens):
        with activation_sharding(mesh):
            logits = model(tokens[:, :-1]).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

    loss, grads = jax.jit(nnx.value_and_grad(loss_fn))(model, jax.device_put(tokens, batch_sharding(mesh)))
    local = jax.tree.map(lambda x: jax.device_put(x, jax.devices()[0]), nnx.state(model))
    single = nnx.merge(nnx.graphdef(model), local)

    def plain_loss(model, tokens):
        logits = model(tokens[:, :-1]).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

    ref_loss, ref_grads = jax.jit(nnx.value_and_grad(plain_loss))(single, tokens)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(grads.layers.blocks.attn.wq.get_value(), ref_grads.layers.blocks.attn.wq.get_value(),
                               rtol=1e-4, atol=1e-6)


def test_undivided_dims_lists_what_would_be_replicated():
    """What `state_shardings` silently replicates, named with its size, the mesh axes and the bytes."""
    from spillway.layers.sharding import undivided_dims
    cfg = preset_config("llama", "tiny_odd", d_model=64, num_heads=4, num_kv_heads=2, mlp_hidden=96, vocab_size=130)
    state = nnx.state(nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    assert undivided_dims(state, {"data": 1, "fsdp": 2, "tensor": 2}) == []
    found = {(d.path, d.logical_axis): d for d in undivided_dims(state, {"data": 1, "fsdp": 1, "tensor": 3})}
    assert set(found) == {("layers.blocks.attn.wq", "heads"), ("layers.blocks.attn.wo", "heads"),
                          ("layers.blocks.attn.wk", "kv_heads"), ("layers.blocks.attn.wv", "kv_heads"),
                          ("embed.table", "vocab"), ("head.w", "vocab")}   # mlp_hidden 96 = 3 x 32 splits
    wq = found["layers.blocks.attn.wq", "heads"]
    assert (wq.size, wq.mesh_axes, wq.ways) == (4, ("tensor",), 3)
    assert wq.nbytes == 3 * 64 * 4 * 16 * 4   # layers x d_model x heads x head_dim x fp32
    # The same decision as the specs: what is listed is what logical_to_spec leaves unsplit.
    mesh = jax.sharding.AbstractMesh((1, 1, 3), ("data", "fsdp", "tensor"))
    assert logical_to_spec(("layers", "embed", "heads", "head_dim"), (3, 64, 4, 16), mesh) == P(None, None, None, None)
    with pytest.raises(ValueError, match=r"mesh.tensor=3 does not divide heads \(4\)"):
        logical_to_spec(("layers", "embed", "heads", "head_dim"), (3, 64, 4, 16), mesh, strict=True)
