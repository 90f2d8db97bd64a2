"""MoE expert weights in pinned host memory (offload.params=experts, and =host with MoE blocks) train exactly
as on device.

The model is a small Llama whose blocks have an MoE MLP (benchmarks/moe_blocks.py:
top-2 of 5 experts, expert hidden 24), float32, gradient accumulation 2 and a
clipping norm that is active. CPU lowers memory-kind moves to no-ops, so these
tests prove the maths and the placement (which leaves live where, across
steps and a checkpoint round trip); tests/recipes/plan/test_host_experts_aot.py
compiles for an H200 to show the HBM saving.

Time: each training here compiles its own step (10-25 s on 2 busy cores), so
the twenty-step comparisons and the resume are slow tests; the placement, the
gradients' memory space (traced, not compiled) and the errors share one setup
and run by default.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from benchmarks.moe_blocks import block_path
from spillway.layers.errors import ConfigError
from spillway.layers.host_weights import is_expert_weight
from spillway.layers.mesh import MeshConfig
from spillway.layers.sharding import make_mesh
from spillway.recipes.train import step as step_lib
from spillway.recipes.train.batch import Batch

from tests.recipes.train.host_training import batches, small_recipe, train, twenty_steps_equal

EXPERTS_ON_HOST = ("offload.params=experts", "offload.optimizer_state=host")
ALL_ON_HOST = ("offload.params=host", "offload.optimizer_state=host")


def moe_recipe(*extra, dispatch: str = "dropless", block: str | None = None):
    """host_training's small recipe with an MoE block (top-2 of 5 experts unless `block` says otherwise)."""
    return small_recipe(f"block={block or block_path('tiny', dispatch)}", *extra)


def one_device():
    return make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1])


def kinds_by_role(params) -> dict[str, set[str]]:
    """Memory kinds of the routed experts' weights, of the other block weights, and of the rest."""
    found = {"experts": set(), "other_blocks": set(), "outside": set()}
    for path, var in jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: hasattr(x, "get_metadata"))[0]:
        role = ("experts" if is_expert_weight(var.get_metadata().get("logical_axes")) else "other_blocks") \
            if "blocks" in jax.tree_util.keystr(path) else "outside"
        found[role].add(var.get_value().sharding.memory_kind)
    return found


@pytest.fixture(scope="module")
def experts_setup():
    """The experts-on-host setup (the model built in its memories; the train step not compiled yet)."""
    recipe = moe_recipe(*EXPERTS_ON_HOST)
    return recipe, step_lib.setup(recipe, one_device())


def test_only_the_experts_and_their_state_live_in_host_memory(experts_setup):
    recipe, s = experts_setup
    assert kinds_by_role(s.params) == {"experts": {"pinned_host"}, "other_blocks": {"device"}, "outside": {"device"}}
    opt_state = s.optimizer.abstract_state(s.params, s.param_shardings)   # with the shardings it will have
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(opt_state.mu)} == {"pinned_host"}
    # The host bytes the run reserves count the experts' weights and gradients (float32 sums read and written).
    experts = [v.get_value() for p, v in jax.tree_util.tree_flatten_with_path(
        step_lib.abstract_model(recipe)[1], is_leaf=lambda x: hasattr(x, "get_metadata"))[0]
        if is_expert_weight(v.get_metadata().get("logical_axes"))]
    pinned = step_lib.pinned_host_bytes(recipe, one_device())
    assert pinned.weights == sum(a.size * a.dtype.itemsize for a in experts) > 0
    assert pinned.gradients == 2 * 4 * sum(a.size for a in experts)


def test_expert_gradients_come_back_in_host_memory_and_the_rest_on_device(experts_setup):
    recipe, s = experts_setup
    loss_fn = step_lib.make_loss_fn(s.graphdef)
    traced = jax.make_jaxpr(jax.grad(loss_fn), return_shape=True)(s.params, Batch(tokens=batches(recipe, 1)[0]))[0]
    variables = jax.tree.leaves(s.params, is_leaf=lambda x: hasattr(x, "get_metadata"))
    spaces = {(is_expert_weight(v.get_metadata().get("logical_axes")), str(aval.memory_space))
              for v, aval in zip(variables, traced.out_avals, strict=True)}
    assert spaces == {(True, "MemorySpace.Host"), (False, "MemorySpace.Device")}


@pytest.mark.slow   # compiles the train step: 20-30 s on 2 busy cores
def test_resume_from_a_checkpoint_is_exact(experts_setup, tmp_path):
    """orbax saves the host-resident experts and restores them into pinned_host; two more steps from the
    restored state equal two more steps without the round trip, to the bit."""
    from spillway.recipes.train.checkpoint import RunCheckpointer

    recipe, s = experts_setup
    params, opt_state, _ = train(s, s.params, s.optimizer.init(s.params), batches(recipe, 2))
    assert kinds_by_role(params) == kinds_by_role(s.params)   # still where they were after two steps
    with RunCheckpointer(tmp_path / "run", keep=2, every_steps=1, async_save=False) as ckpt:
        ckpt.save(2, params=params, opt_state=s.optimizer.saved_form(opt_state), loader_state={}, meta={"step": 2},
                  recipe_json="{}", force=True)
        restored = ckpt.restore(2, abstract_params=step_lib.abstract_with_shardings(params, s.param_shardings),
                                abstract_opt_state=s.optimizer.saved_abstract_state(params, s.param_shardings))
    restored_params = restored["params"]
    restored_state = s.optimizer.from_saved_form(restored["opt_state"])
    assert kinds_by_role(restored_params) == kinds_by_role(params)
    more = batches(recipe, 4)[2:]
    params, opt_state, norms = train(s, params, opt_state, more)
    restored_params, restored_state, restored_norms = train(s, restored_params, restored_state, more)
    assert restored_norms == norms
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(restored_params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(opt_state), jax.tree.leaves(restored_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_experts_on_host_need_host_optimizer_state_and_an_moe_block():
    with pytest.raises(ConfigError, match="offload.params=experts needs offload.optimizer_state=host"):
        moe_recipe("offload.params=experts")
    with pytest.raises(ConfigError, match=r"offload.params must be one of \('device', 'host', 'experts'\)"):
        moe_recipe("offload.params=expert")
    dense = moe_recipe(*EXPERTS_ON_HOST, block="spillway.layers.block:TransformerBlock")
    with pytest.raises(ConfigError, match="offload.params=experts, but the model has no MoE block"):
        step_lib.setup(dense, one_device())


# (placement, dispatch, mesh): experts on host with each dispatch, every block weight on host, and the
# expert-sharded mesh (4 experts over fsdp 2, the hidden axis over tensor 2, tokens over data x fsdp).
CASES = {
    "experts/dropless": (EXPERTS_ON_HOST, "dropless", "1x1x1"),
    "experts/dropless_blocked": (EXPERTS_ON_HOST, "dropless_blocked", "1x1x1"),
    "experts/capacity": (EXPERTS_ON_HOST, "capacity", "1x1x1"),
    "all/dropless": (ALL_ON_HOST, "dropless", "1x1x1"),
    "experts/dropless/2x2x2": (EXPERTS_ON_HOST, "dropless", "2x2x2"),
    "experts/dropless_blocked/2x2x2": (EXPERTS_ON_HOST, "dropless_blocked", "2x2x2"),
    "experts/capacity/2x2x2": (EXPERTS_ON_HOST, "capacity", "2x2x2"),
}


@pytest.mark.slow   # two trainings, each compiling its own step: 30-60 s on 2 busy cores
@pytest.mark.parametrize("case", list(CASES))
def test_twenty_steps_with_expert_weights_on_host_equal_everything_on_device(case):
    placement, dispatch, mesh_name = CASES[case]
    sharded = mesh_name != "1x1x1"
    mesh = make_mesh(MeshConfig(2, 2, 2)) if sharded else one_device()
    block = block_path("tiny_even" if sharded else "tiny", dispatch)
    # The host weights' gradients are summed inside the backward pass (of the loss divided by the micro-batch
    # count) and the rest on device: float32 rounding in another order, which 20 AdamW steps carry into the
    # norms (measured: at most 1.8e-5 relative, in the last steps; the parameters stay within the bounds below).
    # Under a mesh the host CPU sums a sharded gradient's squares in another order than the device's reduce
    # (tests/recipes/train/test_host_params.py measures the same on the dense model).
    host_params, _ = twenty_steps_equal(moe_recipe(block=block), moe_recipe(*placement, block=block), mesh,
                                        norms_rtol=5e-5, params_tol=(1e-4, 1e-5) if sharded else (1e-5, 1e-6))
    kinds = kinds_by_role(host_params)
    assert kinds["experts"] == {"pinned_host"} and kinds["outside"] == {"device"}
    assert kinds["other_blocks"] == ({"device"} if placement == EXPERTS_ON_HOST else {"pinned_host"})
    if sharded:   # the experts are split over fsdp: each device holds its own experts
        w_up = host_params["layers"]["blocks"]["mlp"]["w_up"].get_value()
        assert tuple(w_up.sharding.spec)[:2] == (None, "fsdp"), w_up.sharding.spec
