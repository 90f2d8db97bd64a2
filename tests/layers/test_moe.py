"""The MoE layer (layers/moe.py, moe_dispatch.py): both dispatches against a dense reference, capacity drops
counted by hand, bad settings refused in one line.

The reference runs every expert on every token and masks the results by the
routing (a [tokens, experts] matrix of combine weights): no sorting, no
grouped matmul, no slots, so it shares nothing with the dispatches but the
router's top-k. Sizes are odd (top-2 of 5 experts, d 6, f 7) and float32.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spillway.layers import aux_outputs, moe_dispatch
from spillway.layers.errors import ConfigError
from spillway.layers.mlp import ACTIVATIONS
from spillway.layers.moe import MoE, MoEConfig, check_expert_sharding

BASE = MoEConfig(d_model=6, num_experts=5, top_k=2, expert_hidden=7)


def dense_reference(model: MoE, x_btd):
    """Every expert on every token, masked by the top-k routing; plus the shared experts."""
    cfg = model.cfg
    b, t, d = x_btd.shape
    x_nd = x_btd.reshape(b * t, d)
    probs_ne = jax.nn.softmax(x_nd @ model.router.w[...], axis=-1)
    top_w, top_e = jax.lax.top_k(probs_ne, cfg.top_k)
    if cfg.renormalize:
        top_w = top_w / top_w.sum(-1, keepdims=True)
    combine_ne = jnp.einsum("nk,nke->ne", top_w, jax.nn.one_hot(top_e, cfg.num_experts))
    act = ACTIVATIONS[cfg.mlp_kind]
    up_enf = jnp.einsum("nd,edf->enf", x_nd, model.w_up[...])
    hidden_enf = act(jnp.einsum("nd,edf->enf", x_nd, model.w_gate[...])) * up_enf if cfg.gated else act(up_enf)
    out_end = jnp.einsum("enf,efd->end", hidden_enf, model.w_down[...])
    y_nd = jnp.einsum("end,ne->nd", out_end, combine_ne)
    if model.shared is not None:
        shared = model.shared(x_nd[None])[0]
        if model.w_shared_gate is not None:
            shared = jax.nn.sigmoid(x_nd @ model.w_shared_gate[...]) * shared
        y_nd = y_nd + shared
    return y_nd.reshape(b, t, d)


def inputs(shape=(3, 7, 6), seed=1):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def values_and_grads(fn, model, x_btd, cotangent_btd):
    """fn(model, x) and the gradients of <fn(model, x), cotangent> with respect to the parameters and x."""
    graphdef, state = nnx.split(model)

    def objective(state, x_btd):
        y_btd = fn(nnx.merge(graphdef, state), x_btd)
        return jnp.sum(y_btd * cotangent_btd), y_btd

    # One compile instead of hundreds of eager dispatches.
    grads, y_btd = jax.jit(jax.grad(objective, argnums=(0, 1), has_aux=True))(state, x_btd)
    return y_btd, grads


def assert_trees_close(a, b, **tolerance):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v), **tolerance), a, b)


VARIANTS = {
    "swiglu_renormalised": BASE,
    "gelu_not_renormalised": dataclasses.replace(BASE, mlp_kind="gelu", renormalize=False),
    "geglu_shared_gated": dataclasses.replace(BASE, mlp_kind="geglu", shared_expert_hidden=5,
                                              shared_expert_gate=True),
    # Blocks of 4 rows: groups of 0 to 21 copies pad to different block counts.
    "swiglu_blocked": dataclasses.replace(BASE, grouped_matmul="blocked", grouped_matmul_block=4),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_dropless_equals_the_dense_reference_in_values_and_gradients(variant):
    model = MoE(VARIANTS[variant], rngs=nnx.Rngs(0))
    x_btd = inputs()
    cotangent = inputs(seed=2)
    got, got_grads = values_and_grads(lambda m, x: m.apply(x)[0], model, x_btd, cotangent)
    want, want_grads = values_and_grads(dense_reference, model, x_btd, cotangent)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_grads, want_grads, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_capacity_that_drops_nothing_equals_dropless(variant):
    """A factor of E / k gives every expert a slot per token of the sequence: nothing can drop."""
    cfg = VARIANTS[variant]
    dropless = MoE(cfg, rngs=nnx.Rngs(0))
    capacity = MoE(dataclasses.replace(cfg, dispatch="capacity", capacity_factor=cfg.num_experts / cfg.top_k),
                   rngs=nnx.Rngs(0))
    x_btd, cotangent = inputs(), inputs(seed=2)
    want, want_grads = values_and_grads(lambda m, x: m.apply(x)[0], dropless, x_btd, cotangent)
    got, got_grads = values_and_grads(lambda m, x: m.apply(x)[0], capacity, x_btd, cotangent)
    assert float(capacity.apply(x_btd)[1].dropped) == 0.0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_grads, want_grads, rtol=1e-5, atol=1e-6)


# One sequence of 4 tokens, top-2 of 3 experts, 2 slots per expert (factor 0.75: ceil(0.75 * 2 * 4 / 3) = 2).
HAND_EXPERTS = [[0, 1], [0, 2], [0, 1], [1, 0]]
# Choice-major: the first choices claim e0 slots 0, 1, 2 (t0, t1, t2) and e1 slot 0 (t3); then the second
# choices: e1 slot 1 (t0), e2 slot 0 (t1), e1 slot 2 (t2), e0 slot 3 (t3). Slots 2 and 3 are over capacity.
HAND_SLOTS = [[0, 1], [1, 0], [2, 2], [0, 3]]
HAND_KEPT = [[True, True], [True, True], [False, False], [True, False]]


def test_capacity_slots_follow_choice_major_priority():
    assert moe_dispatch.expert_capacity(4, 3, 2, 0.75) == 2
    slot, kept = moe_dispatch.capacity_slots(jnp.asarray([HAND_EXPERTS], jnp.int32), 3, 2)
    assert slot[0].tolist() == HAND_SLOTS
    assert kept[0].tolist() == HAND_KEPT


def test_small_capacity_drops_and_counts_the_copies_over_it():
    """Output = each token's kept copies only (t2 gets nothing: the residual stream carries it); 3 dropped."""
    d, f = 4, 5
    keys = jax.random.split(jax.random.key(3), 4)
    weights = moe_dispatch.ExpertWeights(jax.random.normal(keys[0], (3, d, f)), jax.random.normal(keys[1], (3, f, d)),
                                         jax.random.normal(keys[2], (3, d, f)))
    x_btd = jax.random.normal(keys[3], (1, 4, d))
    combine_btk = jnp.asarray([[[0.7, 0.3], [0.6, 0.4], [0.9, 0.1], [0.5, 0.5]]])
    experts_btk = jnp.asarray([HAND_EXPERTS], jnp.int32)
    y_btd, dropped = moe_dispatch.capacity(x_btd, experts_btk, combine_btk, weights, jax.nn.silu, 0.75)
    assert float(dropped) == 3.0

    def expert(e, x_d):
        return (jax.nn.silu(x_d @ weights.gate[e]) * (x_d @ weights.up[e])) @ weights.down[e]
    want = np.zeros((4, d), np.float32)
    for token, (chosen, kept) in enumerate(zip(HAND_EXPERTS, HAND_KEPT)):
        for choice, e in enumerate(chosen):
            if kept[choice]:
                want[token] += float(combine_btk[0, token, choice]) * np.asarray(expert(e, x_btd[0, token]))
    np.testing.assert_allclose(np.asarray(y_btd[0]), want, rtol=1e-5, atol=1e-6)
    assert not want[2].any()


def test_the_layer_emits_its_stats_to_the_collector_and_returns_the_apply_output():
    model = MoE(dataclasses.replace(BASE, dispatch="capacity", capacity_factor=0.5, aux_key="moe_3"),
                rngs=nnx.Rngs(0))
    x_btd = inputs()
    with aux_outputs.collecting() as aux:
        y_btd = model(x_btd)
    want_y, want_stats = model.apply(x_btd)
    np.testing.assert_array_equal(y_btd, want_y)
    assert list(aux.values) == ["moe_3"]
    assert_trees_close(aux.values["moe_3"], want_stats)
    stats = want_stats
    assert float(stats.tokens) == 21 and float(stats.expert_choices.sum()) == 21 * 2
    assert float(stats.dropped) > 0      # 2 slots per expert for 14 copies a sequence over 5 experts
    with pytest.raises(ValueError, match="emitted twice"):
        with aux_outputs.collecting():
            model(x_btd)
            model(x_btd)


@pytest.mark.parametrize("changes, message", [
    ({"num_experts": 0}, "moe.num_experts must be positive, got 0"),
    ({"top_k": 6}, r"moe.top_k \(6\) is more than moe.num_experts \(5\)"),
    ({"capacity_factor": 0.0}, "moe.capacity_factor must be positive, got 0.0"),
    ({"capacity_factor": -1.5}, "moe.capacity_factor must be positive, got -1.5"),
    ({"dispatch": "sorted"}, "moe.dispatch must be one of"),
    ({"shared_expert_gate": True}, "moe.shared_expert_gate needs shared experts"),
    ({"grouped_matmul": "triton"}, "moe.grouped_matmul must be one of"),
    ({"grouped_matmul_block": 0}, "moe.grouped_matmul_block must be positive, got 0"),
])
def test_bad_settings_are_one_line_config_errors(changes, message):
    with pytest.raises(ConfigError, match=message) as error:
        dataclasses.replace(BASE, **changes)
    assert "\n" not in str(error.value)


def test_an_expert_axis_that_does_not_divide_the_expert_count_is_refused_before_tracing_the_experts():
    with pytest.raises(ConfigError, match=r"mesh.fsdp=2 = 2, which does not divide num_experts \(5\)") as error:
        check_expert_sharding(5, {"data": 2, "fsdp": 2, "tensor": 2})
    assert "\n" not in str(error.value)
    check_expert_sharding(6, {"data": 4, "fsdp": 2, "tensor": 1})      # divides: no error
    check_expert_sharding(5, {"data": 8, "fsdp": 1, "tensor": 1})      # experts not split: no error
