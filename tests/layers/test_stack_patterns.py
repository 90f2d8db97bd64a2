"""Block stacks whose layers differ (layers/layer_pattern.py, layers/stack.py).

* Per-layer values (window, RoPE base) scanned beside one weight stack give
  what each layer's block computes with those values as its static config
  (the independent reference: the same weights, merged into blocks built from
  per-layer BlockConfigs and run one after another in Python).
* Runs of another structure (here another MLP width) are stacks of their own;
  the stack equals the layer-by-layer reference, remat segments cut across
  runs and inside them, and every plan gives the no-remat gradients.
* Two traps of scanned stacks, checked in the jaxpr: the scan body hands back
  the residual stream only (a body that returned the module state would make
  the scan stack every weight a second time), and an offloading plan still
  copies its names to host memory when the layers carry scanned values.
  The compiled ground truth for both is tests/recipes/test_gemma_aot.py.
* One compiled body however deep: an 8-period Gemma compiles in about the time
  of a 2-period one.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spillway.layers import layer_hook
from spillway.layers.block import BlockConfig, BlockContext, TransformerBlock
from spillway.layers.errors import ConfigError
from spillway.layers.execution import Execution
from spillway.layers.layer_pattern import LayerSettings, StackRun
from spillway.layers.stack import BlockStack, host_offloaded_names
from spillway.models.decoder import DecoderLM
from spillway.models.registry import preset_config

F32 = Execution(dtype="float32")
CFG = BlockConfig(d_model=24, num_heads=4, num_kv_heads=2, head_dim=6, mlp_hidden=40, execution=F32)
WIDE = dataclasses.replace(CFG, mlp_hidden=56)
X = jax.random.normal(jax.random.key(0), (2, 12, 24))
POSITIONS = jnp.broadcast_to(jnp.arange(12), (2, 12))
SETTINGS = (LayerSettings(sliding_window=3, rope_theta=100.0), LayerSettings(None, 10000.0),
            LayerSettings(sliding_window=5, rope_theta=500.0), LayerSettings(sliding_window=3, rope_theta=100.0),
            LayerSettings(None, 10000.0))


def layer_by_layer(stack: BlockStack, configs, x_btd):
    """The stack's layers run one at a time in Python, each merged into a block of its own static config."""
    return nnx.jit(lambda stack, x_btd: _layer_by_layer(stack, configs, x_btd))(stack, x_btd)


def run(stack: BlockStack, x_btd):
    return nnx.jit(lambda stack, x_btd: stack(x_btd, BlockContext(POSITIONS))[0])(stack, x_btd)


def _layer_by_layer(stack: BlockStack, configs, x_btd):
    for (start, stop), blocks in zip(stack.run_bounds, stack.run_stacks()):
        _, state = nnx.split(blocks)
        for i in range(stop - start):
            cfg = configs[start + i]
            block = nnx.eval_shape(lambda cfg=cfg: TransformerBlock(cfg, rngs=nnx.Rngs(0)))
            nnx.update(block, jax.tree.map(lambda a, i=i: a[i], state))
            x_btd = block(x_btd, BlockContext(POSITIONS))[0]
    return x_btd


def with_settings(cfg: BlockConfig, s: LayerSettings) -> BlockConfig:
    return dataclasses.replace(cfg, sliding_window=s.sliding_window, rope_theta=s.rope_theta)


@pytest.mark.parametrize("impl", ["xla", "flash"])
def test_scanned_layer_values_give_each_layers_static_block(impl):
    cfg = dataclasses.replace(CFG, execution=dataclasses.replace(F32, attention_impl=impl, flash_block_size=4))
    stack = BlockStack(cfg, 5, remat="save_all", rngs=nnx.Rngs(1), layer_settings=SETTINGS)
    assert stack.layer_settings == SETTINGS
    expected = layer_by_layer(stack, [with_settings(cfg, s) for s in SETTINGS], X)
    np.testing.assert_allclose(run(stack, X), expected, rtol=2e-5, atol=2e-5)
    # The values matter: the same weights with every layer global give something else.
    uniform = layer_by_layer(stack, [cfg] * 5, X)
    assert float(jnp.abs(uniform - expected).max()) > 1e-2


def test_settings_equal_to_the_static_block_scan_nothing():
    """A pattern that changes nothing (every layer its block's values) compiles to the uniform stack's program."""
    same = (LayerSettings.of_block(CFG),) * 3
    stack = BlockStack(CFG, 3, remat="save_all", rngs=nnx.Rngs(1), layer_settings=same)
    assert stack.layer_settings is None


def test_runs_of_another_structure_are_stacks_of_their_own():
    runs = (StackRun(CFG, 2), StackRun(WIDE, 3))
    stack = BlockStack(CFG, 5, remat="save_all", rngs=nnx.Rngs(1), runs=runs, layer_settings=SETTINGS)
    shapes = [blocks.mlp.w_up.get_value().shape for blocks in stack.run_stacks()]
    assert shapes == [(2, 24, 40), (3, 24, 56)]
    configs = [with_settings(CFG if i < 2 else WIDE, s) for i, s in enumerate(SETTINGS)]
    np.testing.assert_allclose(run(stack, X), layer_by_layer(stack, configs, X), rtol=2e-5, atol=2e-5)
    assert [p[:3] for p in stack.pieces()] == [(0, 0, 2), (1, 2, 5)]


def test_segments_cut_runs_anywhere():
    runs = (StackRun(CFG, 2), StackRun(WIDE, 3))
    stack = BlockStack(CFG, 5, remat="offload_dots:1,save_dots:2,recompute_all", rngs=nnx.Rngs(1), runs=runs)
    assert [p[:3] for p in stack.pieces()] == [(0, 0, 1), (0, 1, 2), (1, 2, 3), (1, 3, 5)]


def _loss_and_grads(stack: BlockStack):
    graphdef, state = nnx.split(stack)

    def loss(state):
        return jnp.sum(nnx.merge(graphdef, state)(X, BlockContext(POSITIONS))[0] ** 2)

    return jax.jit(jax.value_and_grad(loss))(state)


RUNS = (StackRun(CFG, 2), StackRun(WIDE, 3))


@pytest.fixture(scope="module")
def no_remat():
    """(stack, loss, gradients) of two runs with per-layer values, without remat."""
    stack = BlockStack(CFG, 5, remat="save_all", rngs=nnx.Rngs(1), runs=RUNS, layer_settings=SETTINGS)
    return (stack, *_loss_and_grads(stack))


@pytest.mark.parametrize("plan", ["recompute_all", "offload_dots:1,save_dots:2,recompute_all"])
def test_plans_over_runs_and_values_give_the_no_remat_gradients(plan, no_remat):
    reference, loss, grads = no_remat
    runs = RUNS
    planned = nnx.eval_shape(lambda: BlockStack(CFG, 5, remat=plan, rngs=nnx.Rngs(1), runs=runs,
                                                layer_settings=SETTINGS))
    nnx.update(planned, nnx.state(reference))
    loss2, grads2 = _loss_and_grads(planned)
    np.testing.assert_allclose(loss2, loss, rtol=1e-6)
    largest = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * largest), grads2, grads)


def test_bad_runs_and_settings_are_config_errors():
    with pytest.raises(ConfigError, match=r"cover 4 layers \(\[2, 2\]\), but the stack has 5"):
        BlockStack(CFG, 5, rngs=nnx.Rngs(0), runs=(StackRun(CFG, 2), StackRun(WIDE, 2)))
    with pytest.raises(ConfigError, match="3 per-layer settings for a stack of 5 layers"):
        BlockStack(CFG, 5, rngs=nnx.Rngs(0), layer_settings=SETTINGS[:3])
    with pytest.raises(ConfigError, match="sliding_window must be positive"):
        LayerSettings(sliding_window=0)
    with pytest.raises(ConfigError, match="rope_scale must be positive"):
        LayerSettings(rope_scale=0.0)


def test_a_layer_hook_needs_one_run():
    class Hook:
        def start(self):
            return ()

        def before_layer(self, carry, index, layer_state):
            return carry, layer_state, ()

        def collect(self, outputs, carry):
            pass

    stack = BlockStack(CFG, 5, remat="recompute_all", rngs=nnx.Rngs(0), runs=(StackRun(CFG, 2), StackRun(WIDE, 3)))
    with layer_hook.running_before_layers(Hook()), pytest.raises(ConfigError, match="one run of layers"):
        stack(X, BlockContext(POSITIONS))
    # One run with per-layer values: the hook's scan carries the values too.
    single = BlockStack(CFG, 5, remat="recompute_all", rngs=nnx.Rngs(0), layer_settings=SETTINGS)
    with layer_hook.running_before_layers(Hook()):
        hooked = single(X, BlockContext(POSITIONS))[0]
    np.testing.assert_allclose(hooked, single(X, BlockContext(POSITIONS))[0], rtol=1e-6)


# --- the two traps -------------------------------------------------------------------------

def _scan_outputs(closed_jaxpr) -> list[tuple[int, ...]]:
    shapes = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "scan":
                shapes.extend(tuple(v.aval.shape) for v in eqn.outvars)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                visit(sub)

    visit(closed_jaxpr.jaxpr)
    return shapes


@pytest.mark.parametrize("plan", ["save_all", "recompute_all", "offload_dots"])
def test_the_scan_never_stacks_the_weights_a_second_time(plan):
    """No scan of the forward and backward pass outputs an array shaped like a stacked weight, except the
    backward scan's gradients (one per weight, no more)."""
    stack = BlockStack(CFG, 5, remat=plan, rngs=nnx.Rngs(1), layer_settings=SETTINGS)
    graphdef, state = nnx.split(stack)
    weight_shapes = [tuple(a.shape) for a in jax.tree.leaves(state)]

    def loss(state):
        return jnp.sum(nnx.merge(graphdef, state)(X, BlockContext(POSITIONS))[0] ** 2)

    outputs = _scan_outputs(jax.make_jaxpr(jax.grad(loss))(state))
    for shape in set(weight_shapes):
        # the gradient of each weight of that shape, made once by the backward scan
        assert outputs.count(shape) == weight_shapes.count(shape), (plan, shape, outputs)


def test_an_offload_inside_the_scan_with_layer_values_still_goes_to_host():
    def offloaded(settings):
        stack = BlockStack(CFG, 5, remat="offload_dots", rngs=nnx.Rngs(1), layer_settings=settings)
        graphdef, state = nnx.split(stack)

        def loss(state):
            return jnp.sum(nnx.merge(graphdef, state)(X, BlockContext(POSITIONS))[0] ** 2)

        return host_offloaded_names(jax.make_jaxpr(jax.grad(loss))(state))

    with_values, uniform = offloaded(SETTINGS), offloaded(None)
    assert with_values == uniform and sum(with_values.values()) > 0, with_values


# --- the program does not grow with depth ----------------------------------------------------

def _lowered_lines(num_layers: int) -> int:
    """Lines of the gradient program's StableHLO for a Gemma 3 stack of `num_layers` layers (shapes only)."""
    cfg = preset_config("gemma3", "tiny_odd", num_layers=num_layers)
    model = nnx.eval_shape(lambda: DecoderLM(cfg, F32, rngs=nnx.Rngs(0), remat="recompute_all"))
    graphdef, state = nnx.split(model)   # shapes only: nothing to initialise
    tokens = jnp.zeros((1, 16), jnp.int32)

    def loss(state):
        return jnp.mean(nnx.merge(graphdef, state)(tokens) ** 2)

    return jax.jit(jax.value_and_grad(loss)).lower(state).as_text().count("\n")


def test_the_program_does_not_grow_with_depth():
    """2 and 8 periods of "LLLLLG" lower to programs of about one size: the runs are scanned, so what XLA
    compiles (and its compile time) does not grow with the layer count; a Python loop over the layers would
    make the program (and the compile) about 4x larger. Counted in the lowered program, not timed."""
    two, eight = _lowered_lines(12), _lowered_lines(48)
    assert eight < 1.1 * two, (two, eight)
