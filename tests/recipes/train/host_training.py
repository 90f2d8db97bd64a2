"""What the host-placement tests (test_host_params.py, test_host_experts.py) share: their small recipe, its
batches, and the 20-step comparison of a run with weights in host memory against one with everything on device
(imported as tests.recipes.train.host_training, as the suite's files import each other).

The oracle is the same recipe trained on device: CPU lowers memory-kind moves to no-ops, so the host run must
compute the same numbers, bit for bit where both programs sum in the same order, else to float32 rounding
(each caller that allows a tolerance says by how much, and why).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from spillway.recipes.registry import get_recipe
from spillway.recipes.train import step as step_lib
from spillway.recipes.train.batch import Batch

STEPS = 20
LAYERS = 3


def small_recipe(*extra):
    """`tiny` at 3 layers of d_model 32, two micro-batches a step, clipping at 0.5 (active in every step)."""
    return get_recipe("tiny", [
        "model.vocab_size=128", "model.d_model=32", f"model.num_layers={LAYERS}", "model.num_heads=4",
        "model.num_kv_heads=2", "model.mlp_hidden=64", "model.max_seq_len=32", "data.seq_len=16",
        "train.global_batch=8", "train.grad_accum=2", f"train.steps={STEPS}", "optimizer.warmup_steps=2",
        "optimizer.learning_rate=1e-2", "optimizer.clip_norm=0.5", *extra])


def batches(recipe, count: int = STEPS):
    shape = (recipe.train.global_batch, recipe.data.seq_len + 1)
    return [jax.random.randint(k, shape, 0, recipe.model.vocab_size, jnp.int32)
            for k in jax.random.split(jax.random.key(7), count)]


def train(s, params, opt_state, tokens):
    """The setup's train step over `tokens`; (params, opt_state, the grad norms)."""
    norms = []
    for t in tokens:
        batch = Batch(tokens=jax.device_put(t, s.batch_sharding))
        params, opt_state, _, stats = s.train_step(params, opt_state, None, batch)
        norms.append(float(stats["grad_norm"]))
    return params, opt_state, norms


def train_steps(recipe, mesh):
    """STEPS train steps of setup(recipe) on `mesh`: (final params as NumPy, grad norms, the TrainSetup, the
    final params and optimizer state as they lie)."""
    s = step_lib.setup(recipe, mesh)
    params, opt_state, norms = train(s, s.params, s.optimizer.init(s.params), batches(recipe))
    # Host and device arrays cannot meet in one op (docs/DESIGN.md section 4): compare as NumPy.
    return jax.tree.map(np.asarray, params), norms, s, params, opt_state


def assert_same_params(on_host, on_device, rtol=1e-5, atol=1e-6):
    # Host and device arrays cannot meet in one op (docs/DESIGN.md section 4): compare as NumPy.
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(on_host)[0], jax.tree.leaves(on_device), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))


def twenty_steps_equal(device_recipe, host_recipe, mesh, *, norms_rtol: float | None = None,
                       params_tol: tuple[float, float] | None = None):
    """Trains both recipes STEPS steps from their own (equal) initial weights on `mesh`; asserts that clipping
    was active, that the grad norms agree to `norms_rtol` and the final parameters to (rtol, atol)
    `params_tol` (None: bit for bit). Returns the host run's (params, opt_state) for the caller's placement
    checks."""
    device_params, device_norms, *_ = train_steps(device_recipe, mesh)
    _, host_norms, _, host_params, host_opt_state = train_steps(host_recipe, mesh)
    assert min(device_norms) > device_recipe.optimizer.clip_norm, "clipping must be active for the test to cover it"
    if norms_rtol is None:
        assert host_norms == device_norms
    else:
        np.testing.assert_allclose(host_norms, device_norms, rtol=norms_rtol)
    if params_tol is None:
        assert_same_params(host_params, device_params, 0, 0)
    else:
        assert_same_params(host_params, device_params, *params_tol)
    return host_params, host_opt_state
