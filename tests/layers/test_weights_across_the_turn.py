"""layers/host_weights.py and layers/stack.py: a stack of host-resident weights whose last layers keep their
fetched copy for the backward pass (offload.params_keep; tests/recipes/train/test_params_keep.py trains with it).

On CPU memory kinds are no-ops, so this checks the maths (the gradients of the plain stream, bit for bit, for
plain weights and for the running gradient sums of micro-batches) and the program's shape in the jaxpr: the
kept rows come in by one copy outside the scan, and each layer's own fetch is in a conditional's branch that a
kept layer does not take. The compiled ground truth (bytes not moved, HBM) is
tests/recipes/plan/test_params_keep_aot.py.
"""

import contextlib
import io
import re

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from spillway.layers import host_weights
from spillway.layers.block import BlockConfig, BlockContext
from spillway.layers.execution import Execution
from spillway.layers.stack import BlockStack

CFG = BlockConfig(d_model=16, num_heads=2, num_kv_heads=1, head_dim=8, mlp_hidden=24,
                  execution=Execution(dtype="float32"))
LAYERS = 3
X = jax.random.normal(jax.random.key(0), (1, 8, 16))
POSITIONS = jnp.arange(8)[None]


@pytest.fixture(scope="module")
def host_stack():
    """(graphdef, state) of a 3-layer stack whose weights were made in host memory, a layer at a time."""
    with host_weights.initialised_in_host_memory("host"):
        stack = BlockStack(CFG, LAYERS, remat="recompute_all", rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(stack)
    assert all(host_weights.in_host_memory(x) for x in jax.tree.leaves(state))
    return graphdef, state


def _loss(graphdef, keep: int):
    def loss(state):
        with host_weights.keeping_fetched_weights(keep):
            return jnp.sum(nnx.merge(graphdef, state)(X, BlockContext(POSITIONS))[0] ** 2)
    return loss


def fetches(closed_jaxpr) -> list[tuple[str, tuple[int, ...]]]:
    """(where, shape) of every host->device device_put: "cond" inside a conditional's branch, "scan" in a
    scan outside one, "outside" elsewhere."""
    found = []

    def visit(jaxpr, where):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "device_put" and any(
                    getattr(d, "name", None) == "Device" for d in eqn.params.get("devices", ())):
                found.extend((where, tuple(var.aval.shape)) for var in eqn.invars
                             if getattr(getattr(var.aval, "memory_space", None), "name", None) == "Host")
            inner = "cond" if eqn.primitive.name == "cond" or where == "cond" else (
                "scan" if eqn.primitive.name == "scan" else where)
            for sub in jex_core.jaxprs_in_params(eqn.params):
                visit(sub, inner)

    visit(closed_jaxpr.jaxpr, "outside")
    return found


def test_kept_layers_give_the_plain_streams_gradients_and_are_fetched_once(host_stack):
    graphdef, state = host_stack
    plain = jax.jit(jax.grad(_loss(graphdef, 0)))(state)
    kept = jax.jit(jax.grad(_loss(graphdef, 2)))(state)
    jax.tree.map(np.testing.assert_array_equal, kept, plain)
    assert all(host_weights.in_host_memory(g) for g in jax.tree.leaves(kept))   # gradients go back to host
    leaves = len(jax.tree.leaves(state))
    assert {where for where, _ in fetches(jax.make_jaxpr(jax.grad(_loss(graphdef, 0)))(state))} == {"scan"}
    found = fetches(jax.make_jaxpr(jax.grad(_loss(graphdef, 2)))(state))
    assert sorted(shape[0] for where, shape in found if where == "outside") == [2] * leaves   # the kept rows, once
    assert {where for where, _ in found} == {"outside", "cond"}


# Two more gradient compiles (5 s on 2 loaded cores): `make test-slow`, beside the 20 steps at grad_accum 2
# (tests/recipes/train/test_params_keep.py); the plain weights' gradients above in `make test`.
@pytest.mark.slow
def test_kept_layers_add_the_same_running_sums(host_stack):
    """Micro-batches (host_weights.AccumulatingWeight): the gradient is the new running sum, kept or not."""
    graphdef, state = host_stack
    sums = jax.tree.map(lambda w: jax.device_put(jnp.full(w.shape, 0.5, jnp.float32), w.sharding), state)

    def new_sums(keep):
        def loss(sums):
            merged = jax.tree.map(host_weights.AccumulatingWeight, state, sums)
            return _loss(graphdef, keep)(merged)
        return jax.jit(jax.grad(loss))(sums)

    plain, kept = new_sums(0), new_sums(LAYERS)
    jax.tree.map(np.testing.assert_array_equal, kept, plain)
    np.testing.assert_raises(AssertionError, jax.tree.map, np.testing.assert_array_equal, plain, sums)


def _matrix_copies(closed_jaxpr) -> int:
    """Host->device copies of weight matrices (a norm's scale is used broadcast to the activations' shape,
    and save_all saves that product, not a weight)."""
    return sum(1 for _, shape in fetches(closed_jaxpr) if len(shape) > 1)


@pytest.mark.parametrize("remat", ["save_all", "recompute_all"])
def test_no_policy_keeps_the_streamed_weights_for_the_backward_pass(remat):
    """save_all saves every primitive's output: the fetch's own (a device_put, under no name) too, before
    never_save_device_weights looked past the name. Every layer's weights then stayed in HBM until the
    backward pass, which fetched none (the 8B pick at save_all, compiled for an H200, 2026-12-02)."""
    with host_weights.initialised_in_host_memory("host"):
        stack = BlockStack(CFG, LAYERS, remat=remat, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(stack)
    forward = _matrix_copies(jax.make_jaxpr(_loss(graphdef, 0))(state))
    assert forward > 0 and _matrix_copies(jax.make_jaxpr(jax.grad(_loss(graphdef, 0)))(state)) == 2 * forward


def _device_residual_shapes(fn, *args) -> list[tuple[int, ...]]:
    """The shapes of the device-memory residuals jax.checkpoint saves for `fn`'s backward pass."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_saved_residuals(fn, *args)
    shapes = [re.match(r"\w+(<host>)?\[([0-9,]*)\]", line) for line in printed.getvalue().splitlines()]
    return [tuple(int(d) for d in m.group(2).split(",") if d) for m in shapes if m and not m.group(1)]


def test_save_all_keeps_only_the_kept_rows_of_the_weights(host_stack):
    """Under save_all, with the last layer kept: the one HBM copy of its rows is saved, and no residual of
    every layer's weights (the conditional's partial evaluation saved the kept branch's row of every layer,
    zeros where the other branch ran, before never_save_device_weights refused what reads the kept copy)."""
    graphdef, state = host_stack
    planned = nnx.eval_shape(lambda: BlockStack(CFG, LAYERS, remat="save_all", rngs=nnx.Rngs(0)))
    graphdef = nnx.split(planned)[0]
    sums = jax.tree.map(lambda w: jax.device_put(jnp.zeros(w.shape, jnp.float32), w.sharding), state)
    loss = _loss(graphdef, 1)
    shapes = _device_residual_shapes(lambda s: loss(jax.tree.map(host_weights.AccumulatingWeight, state, s)), sums)
    rows = {tuple(w.shape[1:]) for w in jax.tree.leaves(state)}
    assert not [s for s in shapes if s[:1] == (LAYERS,) and s[1:] in rows]
    # The kept layer's matrices, once each (a norm's scale is saved as its product with the activations).
    matrices = sorted((1, *w.shape[1:]) for w in jax.tree.leaves(state) if w.ndim > 2)
    assert sorted(s for s in shapes if s[:1] == (1,) and s[1:] in rows and len(s) > 2) == matrices
