"""offload.params_keep=K (the weights across the turn): the last K streamed block layers' weights come into HBM
once, before the forward scan, and the backward pass uses them again instead of fetching them a second time.

The maths must not change: the gradients are those of the same run without the setting, bit for bit, on CPU
(where memory-kind moves are no-ops, so this proves the maths and the program's shape: the kept copy holds K
rows, and every per-layer fetch of the scan sits in a conditional's branch that a kept layer does not take).
The bytes not moved and the HBM they take are for a GPU compile to show (tests/recipes/plan/test_params_keep_aot.py).
Bad settings are one ConfigError each, when the recipe is made.
"""

from __future__ import annotations

import jax
import jax.extend.core as jex_core
import numpy as np
import pytest

from spillway.layers.errors import ConfigError
from spillway.recipes.optim import param_placement as placement
from spillway.recipes.train import step as step_lib
from spillway.recipes.train.batch import Batch
from tests.recipes.train.host_training import LAYERS, batches, small_recipe, train_steps
from tests.recipes.train.test_params_split import split_settings
from tests.recipes.train.test_state_split import assert_trees_equal, one_device

HOST = ("offload.params=host", "offload.optimizer_state=host")


def _is_to(memory: str):
    return lambda eqn: eqn.primitive.name == "device_put" and any(
        getattr(d, "name", None) == memory for d in eqn.params.get("devices", ()))


def weight_fetches(closed_jaxpr) -> list[tuple[str, tuple[int, ...]]]:
    """Every device_put of a host array into device memory in a jaxpr, sub-jaxprs included, with where it is:
    "scan" (in a scan, outside any conditional), "cond" (in a conditional's branch) or "outside"; and its shape."""
    found = []

    def visit(jaxpr, where):
        for eqn in jaxpr.eqns:
            if _is_to("Device")(eqn):
                for var in eqn.invars:
                    if getattr(getattr(var.aval, "memory_space", None), "name", None) == "Host":
                        found.append((where, tuple(var.aval.shape)))
            inner = {"scan": "scan" if where != "cond" else "cond", "cond": "cond"}.get(eqn.primitive.name, where)
            for sub in jex_core.jaxprs_in_params(eqn.params):
                visit(sub, inner)

    visit(closed_jaxpr.jaxpr, "outside")
    return found


@pytest.mark.parametrize("extra,message", [
    (("offload.params_keep=-1",), "offload.params_keep must be a whole number of block layers, zero or more"),
    (("offload.params_keep=1",), "offload.params=device streams none"),
    ((*HOST, f"offload.params_keep={LAYERS + 1}"), f"offload.params=host streams {LAYERS} of the {LAYERS} block"),
    ((*split_settings(2), "offload.params_keep=3"), r"offload.params=host:2 streams 2 of the 3 .* \(0 to 2\)"),
    (("offload.params=host", "offload.params_keep=1", "lora.rank=4", "checkpoint.init_from=/nonexistent"),
     "not written for LoRA runs"),
])
def test_a_bad_params_keep_is_one_config_error(extra, message):
    with pytest.raises(ConfigError, match=message):
        small_recipe("train.grad_accum=1", *extra)


# 40 s on 2 loaded cores (a recipe's model, two gradient compiles): `make test-slow`; the stack's own check,
# tests/layers/test_weights_across_the_turn.py, in `make test`.
@pytest.mark.slow
def test_kept_weights_give_the_same_gradients_and_are_fetched_once():
    """All the streamed layers but the first keep their weights (K = 2 of 3): the gradients are the plain
    stream's bit for bit, and the program brings the kept rows in by one copy of K rows outside the scan,
    each layer's own fetch being in the branch a kept layer does not take."""
    keep = LAYERS - 1
    recipe = small_recipe("train.grad_accum=1", *HOST)
    s = step_lib.setup(recipe, one_device())
    batch = Batch(jax.device_put(batches(recipe, 1)[0], s.batch_sharding))

    def gradients(params_keep):
        objective = step_lib.make_objective(s.graphdef, recipe.train.loss_chunk, s.mesh, recipe.aux_loss, params_keep)
        grad = jax.grad(lambda p, b: objective(p, b)[0])
        return jax.tree.map(np.asarray, placement.saved_params(jax.jit(grad)(s.params, batch))), \
            weight_fetches(jax.make_jaxpr(grad)(s.params, batch))

    plain, plain_fetches = gradients(0)
    kept, kept_fetches = gradients(keep)
    assert_trees_equal(kept, plain)
    host_leaves = len([x for x in jax.tree.leaves(s.params) if x.sharding.memory_kind == "pinned_host"])
    assert {where for where, _ in plain_fetches} == {"scan"}    # without the setting: the stream as it was
    outside = [shape for where, shape in kept_fetches if where == "outside"]
    assert len(outside) == host_leaves and {shape[0] for shape in outside} == {keep}
    assert {where for where, _ in kept_fetches} == {"outside", "cond"}


# 20 steps each: `make test-slow`; the gradients above in `make test`.
@pytest.mark.slow
@pytest.mark.parametrize("settings,keep", [
    (split_settings(2), 2),    # the split's two host layers both kept; grad_accum 2: the running sums' rule
    (HOST, 1),
])
def test_twenty_steps_with_kept_weights_equal_the_plain_stream_bit_for_bit(settings, keep):
    _, plain_norms, _, plain, _ = train_steps(small_recipe(*settings), one_device())
    _, kept_norms, _, kept, _ = train_steps(small_recipe(*settings, f"offload.params_keep={keep}"), one_device())
    assert min(plain_norms) > 0.5, "clipping must be active for the test to cover it"
    assert kept_norms == plain_norms
    assert_trees_equal(jax.tree.map(np.asarray, placement.saved_params(kept)),
                       jax.tree.map(np.asarray, placement.saved_params(plain)))
