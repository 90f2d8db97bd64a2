"""Host memory per phase (recipes/train/host_memory.py): the donated step on CPU, restore into pinned host
memory, checkpoints from before the change, the phase model's arithmetic, and its inputs against the bytes
of the arrays a run builds.

CPU memory kinds are the same RAM, so what a GPU would keep in pinned memory is shown by deviceless
compiles (tests/recipes/train/test_host_memory_aot.py); these tests check values, memory kinds and the
accounting.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spillway.layers.mesh import MeshConfig
from spillway.layers.sharding import make_mesh
from spillway.recipes.registry import get_recipe
from spillway.recipes.train import host_memory
from spillway.recipes.train import step as step_lib
from spillway.recipes.train.checkpoint import RunCheckpointer
from spillway.recipes.train.batch import Batch

GiB = 2**30


def small_recipe(*extra):
    return get_recipe("tiny", [
        "model.vocab_size=128", "model.d_model=32", "model.num_layers=3", "model.num_heads=4",
        "model.num_kv_heads=2", "model.mlp_hidden=64", "model.max_seq_len=32", "data.seq_len=16",
        "train.global_batch=4", "train.steps=20", "optimizer.warmup_steps=2", "optimizer.learning_rate=1e-2",
        *extra])


def tokens(recipe, s, n):
    keys = jax.random.split(jax.random.key(3), n)
    shape = (recipe.train.global_batch, recipe.data.seq_len + 1)
    return [jax.device_put(jax.random.randint(k, shape, 0, recipe.model.vocab_size, jnp.int32), s.batch_sharding)
            for k in keys]


def as_numpy(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.mark.slow  # an end-to-end run of 39 s on 2 cores: `make test-slow` (CI: .venv-jax011's slow step), keeping `make test` near 12 minutes
def test_the_step_donates_host_state_on_cpu_and_matches_the_state_on_device():
    """The state goes into the step donated (its buffers are consumed: the new state is written over
    them) and the numbers equal the state on device's."""
    mesh = make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1])
    results = {}
    for memory in ("device", "host"):
        recipe = small_recipe(f"offload.optimizer_state={memory}")
        s = step_lib.setup(recipe, mesh)
        params, opt_state = s.params, s.optimizer.init(s.params)
        for batch in tokens(recipe, s, 3):
            before = jax.tree.leaves(opt_state)
            params, opt_state, _, _ = s.train_step(params, opt_state, None, Batch(tokens=batch))
            assert all(leaf.is_deleted() for leaf in before), memory
        results[memory] = as_numpy((params, s.optimizer.saved_form(opt_state)))
        if memory == "host":
            assert "pinned_host" in host_memory.leaves_memory_kinds(opt_state.mu)
    for a, b in zip(jax.tree.leaves(results["device"]), jax.tree.leaves(results["host"])):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _trained(recipe, s, n=2):
    params, opt_state = s.params, s.optimizer.init(s.params)
    for batch in tokens(recipe, s, n):
        params, opt_state, _, _ = s.train_step(params, opt_state, None, Batch(tokens=batch))
    return params, opt_state


def test_restore_writes_host_state_into_pinned_host_memory_without_making_it_first(tmp_path):
    recipe = small_recipe("offload.optimizer_state=host")
    s = step_lib.setup(recipe, make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1]))
    params, opt_state = _trained(recipe, s)
    expected = as_numpy((params, s.optimizer.saved_form(opt_state)))
    with RunCheckpointer(tmp_path / "ckpt", keep=2, every_steps=1, async_save=True) as ckpt:
        ckpt.save(2, params=params, opt_state=s.optimizer.saved_form(opt_state), loader_state={},
                  meta={"step": 2}, recipe_json="{}", force=True)
        ckpt.wait()
        restored_params, restored_state = host_memory.restore_state(ckpt, s, s.params)
    host_leaves = [leaf for leaf in jax.tree.leaves((restored_state.mu, restored_state.nu))]
    assert {leaf.sharding.memory_kind for leaf in host_leaves} == {"pinned_host"}
    assert restored_state.count.sharding.memory_kind == "device"
    got = as_numpy((restored_params, s.optimizer.saved_form(restored_state)))
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
        np.testing.assert_array_equal(a, b)


def test_a_checkpoint_saved_with_the_halved_state_restores_into_todays_cpu_run(tmp_path):
    """Before this change a CPU run kept streamed host state as LayerHalves (as a GPU run still does)
    and saved it joined; that checkpoint restores into today's CPU run (one buffer per leaf) and the
    next steps equal those of the run that saved it."""
    from spillway.recipes.optim.host_streaming import LayerHalves
    from spillway.recipes.optim.optimizer import Optimizer

    recipe = small_recipe("offload.optimizer_state=host")
    mesh = make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1])
    today = step_lib.setup(recipe, mesh)
    old_optimizer = Optimizer(recipe.optimizer, today.optimizer.layout_tree, total_steps=recipe.schedule_steps,
                              halve_stacked_state=True)
    old_state = old_optimizer.init(today.params)
    assert any(isinstance(x, LayerHalves) for x in jax.tree.leaves(
        old_state.mu, is_leaf=lambda x: isinstance(x, LayerHalves)))
    with RunCheckpointer(tmp_path / "ckpt", keep=2, every_steps=1, async_save=False) as ckpt:
        ckpt.save(1, params=today.params, opt_state=old_optimizer.saved_form(old_state), loader_state={},
                  meta={"step": 1}, recipe_json="{}", force=True)
        params, opt_state = host_memory.restore_state(ckpt, today, today.params)
    reference_params, reference_state = today.params, today.optimizer.init(today.params)
    for batch in tokens(recipe, today, 2):
        params, opt_state, _, _ = today.train_step(params, opt_state, None, Batch(tokens=batch))
        reference_params, reference_state, _, _ = today.train_step(reference_params, reference_state, None,
                                                                   Batch(tokens=batch))
    for a, b in zip(jax.tree.leaves(as_numpy(params)), jax.tree.leaves(as_numpy(reference_params))):
        np.testing.assert_array_equal(a, b)


def test_from_saved_form_consuming_frees_each_restored_array():
    from spillway.recipes.optim.optimizer import Optimizer

    recipe = small_recipe("offload.optimizer_state=host")
    s = step_lib.setup(recipe, make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1]))
    opt = Optimizer(recipe.optimizer, s.optimizer.layout_tree, total_steps=recipe.schedule_steps)
    saved = opt.saved_form(opt.init(s.params))
    kept = as_numpy(saved)
    back = opt.from_saved_form(saved, consume=True)
    stacked = [leaf for leaf in jax.tree.leaves(saved.mu) if leaf.ndim >= 3]
    assert stacked and all(leaf.is_deleted() for leaf in stacked)
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(as_numpy(opt.saved_form(back)))):
        np.testing.assert_array_equal(a, b)


# --- the phase model ------------------------------------------------------------------------------------

def phases(**overrides):
    base = dict(footprint=4 * GiB, state=90 * GiB, halved=80 * GiB, weights=0, pending=0, step_host=90 * GiB,
                saved_device=15 * GiB, saved_host=90 * GiB)
    return host_memory.HostPhases(**{**base, **overrides})


def test_phases_add_up_as_the_model_says():
    whole = phases(save_in_pieces=False)
    by_phase = whole.by_phase()
    assert by_phase["state creation"] == 94 * GiB
    assert by_phase["step"] == 94 * GiB
    # live 90 + halves joined 80 + orbax: 2 x 15 (device arrays staged pinned, then NumPy) + 90 (NumPy)
    assert by_phase["checkpoint save"] == (4 + 90 + 80 + 30 + 90) * GiB
    assert by_phase["restore"] == 94 * GiB + host_memory.RESTORE_STAGING_BYTES
    assert whole.peak() == ("checkpoint save", 294 * GiB)
    assert whole.pinned_by_phase()["checkpoint save"] == (90 + 80 + 15) * GiB
    # on CPU: tensorstore's transaction holds the encoded arrays (the bytes saved), after the join
    assert phases(gpu=False, save_in_pieces=False).by_phase()["checkpoint save"] == (4 + 90 + 80 + 105) * GiB
    # in pieces: the live state and the pieces in flight, no join, no copy of what is saved
    in_pieces = phases()
    assert in_pieces.by_phase()["checkpoint save"] == 94 * GiB + host_memory.PIECES_STAGING_BYTES
    # the restore reads in pieces too: the same pieces in flight beside the live state (the tie: the save)
    assert in_pieces.by_phase()["restore"] == in_pieces.by_phase()["checkpoint save"]
    assert in_pieces.peak() == ("checkpoint save", 94 * GiB + host_memory.RESTORE_STAGING_BYTES)
    assert in_pieces.pinned_by_phase()["checkpoint save"] == 90 * GiB
    assert not whole.whole_save_fits(290 * GiB) and whole.whole_save_fits(294 * GiB)


def test_scaling_to_the_gpus_of_a_host_counts_the_process_once():
    p = phases().scaled(8)
    assert p.footprint == 4 * GiB and p.state == 720 * GiB and p.saved_device == 120 * GiB


def test_a_peak_above_the_hosts_ram_names_its_phase():
    with pytest.raises(host_memory.HostPeakError, match=r"peak at 294.0 GiB during the checkpoint save \(process "
                       r"4.0 GiB, state 90.0 GiB.*halves and split leaves joined and orbax's host copies 200.0 GiB \(a whole "
                       r"save\)\), but this host has 128.0 GiB"):
        host_memory.check_host_peak(phases(save_in_pieces=False), 128 * GiB)
    host_memory.check_host_peak(phases(save_in_pieces=False), 300 * GiB)


def test_a_restore_holds_the_weights_once():
    """A resume restores into targets, no initialised weights beside the restored ones (step.setup's
    initialise=False): the restore holds W + S + the pieces, never 2W (measured: test_resume_host_peak.py)."""
    with_weights = phases(weights=30 * GiB)
    assert with_weights.by_phase()["restore"] == (4 + 30 + 90) * GiB + host_memory.RESTORE_STAGING_BYTES
    assert with_weights.pinned_by_phase()["restore"] == (30 + 90) * GiB
    assert "weights 30.0 GiB" in with_weights.describe("restore") and "2 x" not in with_weights.describe("restore")


def test_phases_of_a_setup_count_state_halves_and_pending_gradients():
    mesh = make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1])
    recipe = small_recipe("offload.optimizer_state=host")
    gpu_like = step_lib.abstract_setup(recipe, mesh, platform="cuda")   # halves, as on a GPU
    p = host_memory.phases_of(gpu_like, footprint=0)
    state_bytes = 8 * recipe.num_params()      # float32 mu and nu, no master (float32 weights)
    assert p.state == state_bytes
    assert 0 < p.halved < p.state             # the stacked leaves' state, not the embedding's
    assert p.saved_host == state_bytes and p.saved_device == 4 * recipe.num_params() + 4   # + the step count
    deferred = step_lib.abstract_setup(small_recipe("offload.optimizer_state=host", "offload.update=next_forward"),
                                       mesh, platform="cuda")
    q = host_memory.phases_of(deferred, footprint=0)
    assert q.halved == 0 and q.pending > 0
    assert q.step_host == q.state + q.pending   # the state and the pending gradients written in place


def _bytes_by_memory_kind(tree) -> dict[str, int]:
    """Bytes of the arrays themselves, per memory kind (what this process holds: every addressable shard)."""
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        kind = leaf.sharding.memory_kind
        out[kind] = out.get(kind, 0) + sum(shard.data.nbytes for shard in leaf.addressable_shards)
    return out


def test_the_phase_inputs_are_the_bytes_of_the_arrays_a_run_builds():
    """phases_of counts from shapes and shardings; the independent figure is the arrays setup, init and the
    saved form make (on CPU: no halves), measured."""
    mesh = make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1])
    s = step_lib.setup(small_recipe("offload.optimizer_state=host", "offload.params=host"), mesh)
    opt_state = s.optimizer.init(s.params)
    p = host_memory.phases_of(s, footprint=0, gpu=False)
    held = _bytes_by_memory_kind((s.params, opt_state))
    assert p.state == _bytes_by_memory_kind(opt_state)["pinned_host"] > 0
    assert p.weights == _bytes_by_memory_kind(s.params)["pinned_host"] > 0
    assert p.by_phase()["state creation"] == held["pinned_host"]          # footprint 0: the live host arrays
    saved = _bytes_by_memory_kind((s.params, s.optimizer.saved_form(opt_state)))
    assert p.saved_device == saved.get("device", 0) > 0
    assert p.saved_host == sum(n for kind, n in saved.items() if kind != "device")
