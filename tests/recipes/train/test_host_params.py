"""Stacked block weights in pinned host memory (offload.params=host) train bit for bit as on device.

CPU lowers memory-kind moves to no-ops, so these tests prove the maths and the
placement (shardings' memory kinds, the gradients' memory space in the traced
step, checkpoints); tests/recipes/plan/test_host_params_aot.py compiles for an
H200 to show the HBM saving.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from spillway.layers.errors import ConfigError
from spillway.layers.mesh import MeshConfig
from spillway.layers.sharding import make_mesh
from spillway.recipes.train import step as step_lib
from spillway.recipes.train.batch import Batch

from tests.recipes.train.host_training import batches, small_recipe, twenty_steps_equal



def stacked_kinds(params):
    """Memory kind of every stacked (block) parameter, and of every other one."""
    stacked, other = set(), set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        (stacked if "blocks" in jax.tree_util.keystr(path) else other).add(leaf.sharding.memory_kind)
    return stacked, other


MESHES = {"one_device": lambda: make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1]),
          "fsdp8": lambda: make_mesh(MeshConfig(1, 8, 1))}
UPDATES = {"streamed": "optimizer.update_on_host=false", "host_cpu": "optimizer.update_on_host=true"}


# One combination in `make test`, every one in `make test-slow` (CI runs both): 15-30 s each on 2 cores.
@pytest.mark.parametrize("mesh_name,update", [
    pytest.param(mesh, update, marks=() if (mesh, update) == ("one_device", "host_cpu") else pytest.mark.slow)
    for mesh in MESHES for update in UPDATES])
def test_twenty_steps_with_host_params_equal_everything_on_device(mesh_name, update):
    mesh = MESHES[mesh_name]()
    # Bit for bit: the same sums in the same order. Under FSDP the micro-batches are 8 rows, one per
    # device, as the planner requires: a micro-batch of 4 the mesh does not divide is replicated, and
    # the host weights then change how the partitioner shards the blocks' activations (one all-gather
    # and one all-reduce of a norm's sum over d_model more in the blocks' forward), ~1e-7 apart from
    # the first step (docs/DESIGN.md section 6).
    batch = ("train.global_batch=16", "optimizer.clip_norm=0.4") if mesh_name == "fsdp8" else ()   # smaller norms
    # The one tolerance: the host CPU's update under FSDP. Its gradients cross to the host flat
    # (recipes/optim/host_streaming.update_on_host), and for the embedding's flat gradient the partitioner
    # adds the devices' partial scatter-adds in an all-reduce (then all-gathers it for the reshape), which
    # the streamed update's program does not have: the embedding's state differs from the first step, the
    # norm from the fourth (measured: norms 1.7e-5 relative, weights 2.2e-6 absolute at most, 20 steps).
    tolerance = dict(norms_rtol=5e-5, params_tol=(1e-4, 1e-5)) if (mesh_name, update) == ("fsdp8", "host_cpu") else {}
    params, opt_state = twenty_steps_equal(
        small_recipe(*batch),
        small_recipe("offload.params=host", "offload.optimizer_state=host", UPDATES[update], *batch), mesh,
        **tolerance)
    # The block weights stayed in host memory across 20 steps; embedding, norm and head on device.
    assert stacked_kinds(params) == ({"pinned_host"}, {"device"})
    assert all(leaf.sharding.memory_kind == "pinned_host" for leaf in jax.tree.leaves(opt_state.mu))
    if mesh_name == "fsdp8":
        w_up = params["layers"]["blocks"]["mlp"]["w_up"].get_value()
        assert "fsdp" in tuple(w_up.sharding.spec)


def test_host_weights_are_created_in_host_memory_with_the_device_values():
    """Start-up makes host-resident layers one by one in host memory (a scan, not a vmap): same values."""
    mesh = make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1])
    on_device = step_lib.setup(small_recipe(), mesh).params
    on_host = step_lib.setup(small_recipe("offload.params=host", "offload.optimizer_state=host"), mesh).params
    assert stacked_kinds(on_host) == ({"pinned_host"}, {"device"})
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(on_host)[0], jax.tree.leaves(on_device)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_pinned_host_bytes_count_state_weights_and_gradients_before_anything_exists(grad_accum):
    recipe = small_recipe("offload.params=host", "offload.optimizer_state=host", f"train.grad_accum={grad_accum}")
    mesh = make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1])
    pinned = step_lib.pinned_host_bytes(recipe, mesh)
    _, state = step_lib.abstract_model(recipe)
    stacked = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
               if "blocks" in jax.tree_util.keystr(path)]
    weights = sum(leaf.size * leaf.dtype.itemsize for leaf in stacked)
    assert pinned.weights == weights
    # grad_accum 1: one gradient like the weights; more: the float32 sum read and the one written.
    assert pinned.gradients == (weights if grad_accum == 1 else 2 * 4 * sum(leaf.size for leaf in stacked))
    s = step_lib.setup(recipe, mesh)
    assert pinned.optimizer_state == s.optimizer.host_bytes(s.optimizer.init(s.params)) > 0
    assert pinned.total == pinned.optimizer_state + pinned.weights + pinned.gradients


@pytest.mark.parametrize("extra", [
    ("offload.params=host", "train.grad_accum=2", "execution.param_dtype=bfloat16"),   # float32 sums of bf16
    ("offload.params=host", "train.grad_accum=1"),
    ("offload.update=next_forward", "train.grad_accum=1"),
    ("offload.update=next_forward", "offload.pending_gradients=device", "train.grad_accum=2")])
def test_the_shapes_only_step_bytes_are_what_the_setup_counts(extra):
    """recipes/train/host_memory.phases_of_recipe (before any backend starts: the loop's pinned limit) counts the
    step's pinned bytes by the setup's rule, from the arrays' shapes alone."""
    from spillway.recipes.train import host_memory

    recipe = small_recipe("offload.optimizer_state=host", *extra)
    mesh = make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1])
    assert host_memory.phases_of_recipe(recipe).step_host == step_lib.pinned_host_bytes(recipe, mesh).total > 0


def test_block_gradients_come_back_in_host_memory():
    """In the traced step the stacked gradients are host arrays (the transpose of the per-layer device_put)."""
    recipe = small_recipe("offload.params=host", "offload.optimizer_state=host", "train.grad_accum=1")
    s = step_lib.setup(recipe, make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1]))
    loss_fn = step_lib.make_loss_fn(s.graphdef)
    tokens = batches(recipe)[0]
    traced = jax.make_jaxpr(jax.grad(loss_fn), return_shape=True)(s.params, Batch(tokens=tokens))[0]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(s.params)[0]]
    spaces = {p: str(aval.memory_space) for p, aval in zip(paths, traced.out_avals)}
    assert {v for k, v in spaces.items() if "blocks" in k} == {"MemorySpace.Host"}, spaces
    assert {v for k, v in spaces.items() if "blocks" not in k} == {"MemorySpace.Device"}, spaces


def test_host_params_need_host_optimizer_state():
    with pytest.raises(ConfigError, match="offload.params=host needs offload.optimizer_state=host"):
        small_recipe("offload.params=host")
    with pytest.raises(ConfigError, match="offload.params must be one of"):
        small_recipe("offload.params=gpu")


def test_host_params_without_pinned_host_memory_is_one_config_error(monkeypatch):
    from spillway.recipes.optim import param_placement
    monkeypatch.setattr(param_placement, "host_memory_available", lambda device=None: False)
    recipe = small_recipe("offload.params=host", "offload.optimizer_state=host")
    with pytest.raises(ConfigError, match=r"offload.params=host.*no 'pinned_host' memory"):
        step_lib.setup(recipe, make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1]))


def test_checkpoint_restores_host_params_into_host_memory_and_resumes_exactly(tmp_path):
    """orbax saves host-resident weights and restores them into pinned_host (the restore target's memory
    kind); two more steps from the restored state equal two more steps without the round trip."""
    from spillway.recipes.train.checkpoint import RunCheckpointer

    recipe = small_recipe("offload.params=host", "offload.optimizer_state=host", "train.grad_accum=1")
    s = step_lib.setup(recipe, make_mesh(MeshConfig(1, 8, 1)))
    params, opt_state = s.params, s.optimizer.init(s.params)
    tokens = [jax.device_put(t, s.batch_sharding) for t in batches(recipe)[:4]]
    for t in tokens[:2]:
        params, opt_state, _, _ = s.train_step(params, opt_state, None, Batch(tokens=t))
    with RunCheckpointer(tmp_path / "run", keep=2, every_steps=1, async_save=False) as ckpt:
        ckpt.save(2, params=params, opt_state=s.optimizer.saved_form(opt_state), loader_state={}, meta={"step": 2},
                  recipe_json="{}", force=True)
        restored = ckpt.restore(2, abstract_params=step_lib.abstract_with_shardings(params, s.param_shardings),
                                abstract_opt_state=s.optimizer.saved_abstract_state(params, s.param_shardings))
    restored_params = restored["params"]
    restored_state = s.optimizer.from_saved_form(restored["opt_state"])
    assert stacked_kinds(restored_params) == ({"pinned_host"}, {"device"})
    for t in tokens[2:]:
        params, opt_state, _, _ = s.train_step(params, opt_state, None, Batch(tokens=t))
        restored_params, restored_state, _, _ = s.train_step(restored_params, restored_state, None, Batch(tokens=t))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(restored_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
