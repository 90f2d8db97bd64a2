"""Offload plans against the no-remat run: a model's loss and gradients under a plan equal those under save_all.

Not a test module: a helper for the layer tests (custom policies on a Llama)
and the family tests (every preset on each family's tiny config).

    reference = NoRematReference(model_cls, config, tokens_bt)   # one init, one save_all compile
    reference.check("offload_dots")                               # same parameters, plan applied

`check` builds the model under the plan abstractly, gives it the reference's
parameters (a plan never changes the weights) and compares float32 loss and
gradients at a tight tolerance. `PLANS` is every preset plus a two-segment plan.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from spillway.layers.offload import PRESETS
from spillway.layers.sharding import create_sharded

# Every preset, plus a two-segment plan (offload the first layer's matmul outputs, keep the next).
PLANS = sorted(PRESETS) + ["offload_dots:1,save_dots:1,recompute_all"]
# What a family's or a block's own sweep runs in the default suite: a preset that moves activations to host
# and back, and the two-segment plan (host, device and recompute in one program). Every preset on the plain
# Llama stack runs there too (tests/layers/test_offload_policy.py); each family's other presets run with the
# slow tests (each is one compile of the model's gradient: about 10 s of a worker on 2 cores).
DEFAULT_PLANS = ("offload_dots", "offload_dots:1,save_dots:1,recompute_all")


def plan_params(plans=PLANS) -> list:
    """`plans` as pytest parameters, those outside DEFAULT_PLANS marked slow."""
    return [plan if plan in DEFAULT_PLANS else pytest.param(plan, marks=pytest.mark.slow) for plan in plans]


class NoRematReference:
    """The save_all loss and gradients of `model_cls(config)` on `tokens_bt`, to check plans against."""

    def __init__(self, model_cls, config, tokens_bt: np.ndarray):
        self._build = lambda remat: model_cls(config, rngs=nnx.Rngs(0), remat=remat)
        self._inputs_bt, self._targets_bt = jnp.asarray(tokens_bt[:, :-1]), jnp.asarray(tokens_bt[:, 1:])
        base = create_sharded(lambda: self._build("save_all"))
        self.params = nnx.state(base)
        self.loss, self.grads = self._loss_and_grads(base)
        assert np.isfinite(self.loss)

    def _loss_and_grads(self, model) -> tuple[float, dict]:
        def loss_fn(model):
            logits_btv = model(self._inputs_bt).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits_btv, self._targets_bt).mean()

        graphdef, state = nnx.split(model)
        step = jax.jit(lambda state: nnx.value_and_grad(loss_fn)(nnx.merge(graphdef, state)))
        # What a plan saves, recomputes or offloads is decided by XLA's HLO passes, which run
        # at every level; LLVM's optimisation of the CPU code (two thirds of each compile
        # here) does not change it, so it is switched off to keep the many compiles quick.
        loss, grads = step.lower(state).compile(compiler_options={"xla_backend_optimization_level": 0})(state)
        return float(loss), jax.tree.map(np.asarray, nnx.state(grads))

    def check(self, plan, *, rtol: float = 1e-5, atol: float = 1e-7) -> None:
        """Loss (rtol 1e-6) and every gradient (rtol, atol) under `plan` equal the save_all run's."""
        model = nnx.eval_shape(lambda: self._build(plan))
        nnx.update(model, self.params)
        loss, grads = self._loss_and_grads(model)
        np.testing.assert_allclose(loss, self.loss, rtol=1e-6, err_msg=str(plan))
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=str(plan)),
                     grads, self.grads)


def assert_every_plan_matches_no_remat(model_cls, config, tokens_bt: np.ndarray, **tolerance) -> None:
    """`NoRematReference(...).check(plan)` for each of PLANS."""
    reference = NoRematReference(model_cls, config, tokens_bt)
    for plan in PLANS:
        reference.check(plan, **tolerance)
