"""optimizer.moment_dtype=bfloat16 against optax, on CPU: the moments stored in bfloat16 on every placement.

The reference is optax's own `mu_dtype` (adamw(..., mu_dtype=bfloat16)), which rounds the first moment
after each update; optax leaves the second moment in the parameters' dtype, so the reference wraps
that chain to round nu the same way (the one thing optax does not do). Device, streamed host and
host-CPU updates must all track it for 20 steps, and the stored moments must be bfloat16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

from spillway.layers.errors import ConfigError
from spillway.recipes.optim import schedule as schedule_lib
from spillway.recipes.optim.config import OptimizerConfig
from spillway.recipes.optim.optimizer import Optimizer
from tests.recipes.optim.test_optimizer import DECAY, STEPS, assert_tree_close, host_leaves, toy_grads, \
    toy_layouts, toy_params


def nu_rounded_to(dtype, inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` (a chain whose second element is adamw's) with the Adam state's nu stored in `dtype`."""
    def cast(state):
        adam = state[1][0]
        rounded = adam._replace(nu=jax.tree.map(lambda v: v.astype(dtype), adam.nu))
        return (state[0], (rounded, *state[1][1:]), *state[2:])

    def init(params):
        return cast(inner.init(params))

    def update(updates, state, params=None):
        updates, state = inner.update(updates, state, params)
        return updates, cast(state)
    return optax.GradientTransformation(init, update)


def reference(cfg: OptimizerConfig):
    chain = optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(schedule_lib.make_schedule(cfg, STEPS), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                    weight_decay=cfg.weight_decay, mask=DECAY, mu_dtype=jnp.bfloat16))
    return nu_rounded_to(jnp.bfloat16, chain)


@pytest.mark.parametrize("memory,on_host", [("device", False), ("host", False), ("host", True)])
def test_bfloat16_moments_match_optax_mu_dtype_with_nu_rounded_too(memory, on_host):
    cfg = OptimizerConfig(learning_rate=1e-2, warmup_steps=5, update_on_host=on_host, moment_dtype="bfloat16")
    layouts = toy_layouts(memory, master=False)
    opt, tx = Optimizer(cfg, layouts, total_steps=STEPS), reference(cfg)
    params = ref = toy_params()
    state, ref_state = opt.init(params), tx.init(ref)
    step = jax.jit(opt.update)

    @jax.jit
    def ref_step(grads, ref_state, ref):
        updates, ref_state = tx.update(grads, ref_state, ref)
        return optax.apply_updates(ref, updates), ref_state

    for i in range(STEPS):
        grads = toy_grads(params, i, 10.0)
        params, state, _ = step(grads, state, params)
        ref, ref_state = ref_step(grads, ref_state, ref)
    saved, adam = opt.saved_form(state), ref_state[1][0]
    assert {x.dtype for x in jax.tree.leaves((saved.mu, saved.nu))} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(jnp.bfloat16)}
    assert_tree_close(saved.mu, adam.mu, rtol=0, atol=0)
    assert_tree_close(saved.nu, adam.nu, rtol=0, atol=0)
    assert_tree_close(params, ref)
    if memory == "host":
        assert {leaf.sharding.memory_kind for _, leaf in host_leaves(state, layouts)} == {"pinned_host"}


def test_bfloat16_moments_keep_the_float32_master_and_halve_the_host_bytes():
    params = toy_params(jnp.bfloat16)
    sizes = {}
    for dtype in ("float32", "bfloat16"):
        cfg = OptimizerConfig(warmup_steps=5, moment_dtype=dtype)
        opt = Optimizer(cfg, toy_layouts("host", master=True), total_steps=STEPS)
        abstract = opt.abstract_state(params)
        assert {x.dtype for x in jax.tree.leaves(abstract.master)} == {jnp.dtype(jnp.float32)}
        sizes[dtype] = {name: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(getattr(abstract, name)))
                        for name in ("mu", "nu", "master")}
    assert sizes["bfloat16"]["mu"] * 2 == sizes["float32"]["mu"]
    assert sizes["bfloat16"]["nu"] * 2 == sizes["float32"]["nu"]
    assert sizes["bfloat16"]["master"] == sizes["float32"]["master"]


@pytest.mark.parametrize("dtype", ["int8", "float16", "uint8", "bf16"])
def test_a_moment_dtype_the_update_cannot_read_is_one_config_error(dtype):
    with pytest.raises(ConfigError, match=r"optimizer.moment_dtype must be one of \('float32', 'bfloat16'\)"):
        OptimizerConfig(moment_dtype=dtype)


def test_the_byte_model_counts_bfloat16_moments():
    """recipes/train/host_memory.phases_of_recipe (what the planner and the loop's RAM check read) halves mu and nu."""
    from spillway.recipes.registry import get_recipe
    from spillway.recipes.train.host_memory import phases_of_recipe
    host = ["offload.optimizer_state=host"]
    full = phases_of_recipe(get_recipe("tiny", host)).state
    half = phases_of_recipe(get_recipe("tiny", [*host, "optimizer.moment_dtype=bfloat16"])).state
    params = phases_of_recipe(get_recipe("tiny", host)).saved_device   # the state on host: the params alone
    assert full > 0 and params > 0
    # The tiny recipe's parameters are float32, so no master copy: the state is the moments alone.
    assert half * 2 == full
