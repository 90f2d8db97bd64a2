"""recipes/train/checkpoint.py on 8 fake CPU devices (tests/conftest.py).

The state saved here looks like a run's: a params tree sharded over a
("data", "model") mesh, and an AdamW-like state dataclass whose moments live in
pinned_host memory and whose master copy is None for some leaves. Host-memory
and device-memory arrays cannot meet in one op, so values are compared as NumPy
copies. The crash test (SIGKILL mid-save) runs a real child process; SIGTERM is the
train loop's (tests/recipes/train/test_train.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from spillway.recipes.train import checkpoint_items
from spillway.recipes.train.checkpoint import (CheckpointError, CheckpointMismatchError, CorruptCheckpointError,
                                               RunCheckpointer, read_recipe_json, resolve_step_dir,
                                               restore_params_only)
from spillway.recipes.train.errors import RunError
from child_env import child_env

REPO_ROOT = Path(__file__).resolve().parents[3]
PINNED_HOST = "pinned_host"
RECIPE_JSON = '{\n  "model": "llama_tiny",\n  "lr": 0.0003\n}\n'


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdamLikeState:
    """The shape of recipes.optimizer.OptState, kept local so this test does not follow its edits."""
    count: jax.Array
    mu: Any
    nu: Any
    master: Any  # None where a parameter keeps no fp32 copy


def mesh_of(shape: tuple[int, int]) -> jax.sharding.Mesh:
    devices = np.array(jax.devices()[: shape[0] * shape[1]]).reshape(shape)
    return jax.sharding.Mesh(devices, ("data", "model"))


PARAM_SPECS = {"embed": P("data", "model"), "blocks": {"w_in": P(None, "data", "model"), "norm": P()}}


def param_shardings(mesh) -> dict:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), PARAM_SPECS)


def make_state(mesh, seed: int = 0):
    """params + AdamLike state on `mesh`; mu and nu in pinned_host memory, master only for `embed`."""
    rng = np.random.default_rng(seed)  # NumPy: jax.random would compile for seconds on 8 CPU devices
    normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
    # embed is large enough that OCDBT stores it in a data file of its own rather than inline
    host = {"embed": normal(64, 64), "blocks": {"w_in": normal(2, 8, 12), "norm": normal(8)}}
    shardings = param_shardings(mesh)
    params = jax.tree.map(jax.device_put, host, shardings)
    on_host = jax.tree.map(lambda s: s.with_memory_kind(PINNED_HOST), shardings)
    opt_state = AdamLikeState(
        count=jax.device_put(np.int32(7), NamedSharding(mesh, P())),
        mu=jax.tree.map(lambda x, s: jax.device_put(x * 0.5, s), host, on_host),
        nu=jax.tree.map(lambda x, s: jax.device_put(x * x, s), host, on_host),
        master={"embed": jax.device_put(host["embed"] + 1.0, shardings["embed"]),
                "blocks": {"w_in": None, "norm": None}},
    )
    return params, opt_state


def abstract_like(tree, mesh):
    """The restore target for `tree` on another mesh: same specs and memory kinds."""
    def one(x):
        spec = x.sharding.spec
        return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                    sharding=NamedSharding(mesh, spec, memory_kind=x.sharding.memory_kind))
    return jax.tree.map(one, tree)


def to_numpy(tree):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def assert_trees_equal(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(to_numpy(actual)), jax.tree.leaves(to_numpy(expected))):
        np.testing.assert_array_equal(a, e)


def save_step(ckpt: RunCheckpointer, step: int, params, opt_state, **overrides):
    kwargs = dict(params=params, opt_state=opt_state, loader_state={"shard": 3, "offset": step * 10},
                  meta={"step": step, "rng": [0, step], "tokens_seen": step * 4096},
                  recipe_json=RECIPE_JSON, force=True)
    kwargs.update(overrides)
    ckpt.save(step, **kwargs)


@pytest.fixture
def saved_run(tmp_path):
    """A run directory with step 10 saved from a 2x4 mesh; returns (dir, params, opt_state)."""
    params, opt_state = make_state(mesh_of((2, 4)))
    with RunCheckpointer(tmp_path / "run", keep=3, every_steps=10) as ckpt:
        save_step(ckpt, 10, params, opt_state)
    return tmp_path / "run", params, opt_state


# -- round trip, layout, retention ---------------------------------------------------------------


def test_round_trip_restores_every_part(saved_run):
    run_dir, params, opt_state = saved_run
    mesh = mesh_of((2, 4))
    with RunCheckpointer(run_dir, keep=3, every_steps=10) as ckpt:
        assert ckpt.latest_step() == 10
        restored = ckpt.restore(None, abstract_params=abstract_like(params, mesh),
                                abstract_opt_state=abstract_like(opt_state, mesh))
    assert_trees_equal(restored["params"], params)
    assert isinstance(restored["opt_state"], AdamLikeState)
    assert restored["opt_state"].master["blocks"]["w_in"] is None
    assert_trees_equal(restored["opt_state"], opt_state)
    assert restored["loader_state"] == {"shard": 3, "offset": 100}
    assert restored["meta"] == {"step": 10, "rng": [0, 10], "tokens_seen": 40960}
    assert restored["recipe_json"] == RECIPE_JSON


def test_recipe_json_is_a_plain_file_beside_each_step(tmp_path):
    params, opt_state = make_state(mesh_of((2, 4)))
    with RunCheckpointer(tmp_path, keep=5, every_steps=1) as ckpt:
        save_step(ckpt, 1, params, opt_state, recipe_json='{"lr": 1}')
        save_step(ckpt, 2, params, opt_state)
    assert (tmp_path / "1" / "recipe" / "recipe.json").read_text() == '{"lr": 1}'
    assert (tmp_path / "2" / "recipe" / "recipe.json").read_text() == RECIPE_JSON
    assert read_recipe_json(tmp_path) == RECIPE_JSON  # run dir: the latest step
    assert read_recipe_json(tmp_path / "1") == '{"lr": 1}'


def test_keep_removes_older_steps(tmp_path):
    params, opt_state = make_state(mesh_of((2, 4)))
    with RunCheckpointer(tmp_path, keep=2, every_steps=5) as ckpt:
        for step in (5, 10, 15, 20):
            save_step(ckpt, step, params, opt_state)
        ckpt.wait()
        assert ckpt.all_steps() == [15, 20]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["15", "20"]


def test_retention_moves_a_step_aside_whole_and_what_a_kill_left_there_goes_at_the_next_open(tmp_path, monkeypatch):
    """Orbax deleted an old step in place: a SIGKILL meanwhile left `<step>` half deleted under its step's name.
    Now it is renamed into .deleting in one step and removed there; a kill before that removal (emulated: the
    removal does nothing) leaves it only there, never listed as a step, and the next open removes it."""
    from spillway.recipes.train import deleted_steps

    params, opt_state = make_state(mesh_of((2, 4)))
    monkeypatch.setattr(deleted_steps, "_remove", lambda steps: None)
    with RunCheckpointer(tmp_path, keep=1, every_steps=5) as ckpt:
        for step in (5, 10, 15):
            save_step(ckpt, step, params, opt_state)
        ckpt.wait()
        assert ckpt.all_steps() == [15]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".deleting", "15"]
    assert sorted(p.name for p in (tmp_path / ".deleting").iterdir()) == ["10", "5"]
    monkeypatch.undo()
    with RunCheckpointer(tmp_path, keep=1, every_steps=5) as ckpt:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["15"]
        assert ckpt.all_steps() == [15] and ckpt.latest_step() == 15


def test_save_policy_every_steps_force_and_repeats(tmp_path):
    params, opt_state = make_state(mesh_of((2, 4)))
    with RunCheckpointer(tmp_path, keep=5, every_steps=10, async_save=False) as ckpt:
        assert [s for s in range(25) if ckpt.should_save(s)] == [0, 10, 20]
        save_step(ckpt, 7, params, opt_state, force=False)  # not due: nothing written
        assert ckpt.latest_step() is None
        save_step(ckpt, 10, params, opt_state, force=False)
        save_step(ckpt, 10, params, opt_state)  # same step again (e.g. SIGTERM right after): no-op
        save_step(ckpt, 13, params, opt_state)  # forced off-period save
        assert ckpt.all_steps() == [10, 13]
        with pytest.raises(CheckpointError, match="refusing to save step 12: step 13 is newer"):
            save_step(ckpt, 12, params, opt_state)


def test_non_json_meta_or_recipe_is_refused_before_saving(tmp_path):
    params, opt_state = make_state(mesh_of((2, 4)))
    with RunCheckpointer(tmp_path, keep=2, every_steps=1) as ckpt:
        with pytest.raises(CheckpointError, match="meta must be JSON-serialisable"):
            save_step(ckpt, 1, params, opt_state, meta={"rng": {1, 2}})
        with pytest.raises(CheckpointError, match="recipe_json is not valid JSON"):
            save_step(ckpt, 1, params, opt_state, recipe_json="{not json")
        assert ckpt.latest_step() is None


# -- shardings, memory kinds ----------------------------------------------------------------------


@pytest.mark.parametrize("target_mesh_shape", [(8, 1), (1, 1)], ids=["8x1", "single-device"])
def test_restore_onto_another_mesh(saved_run, target_mesh_shape):
    run_dir, params, opt_state = saved_run
    mesh = mesh_of(target_mesh_shape)
    abstract_params, abstract_opt = abstract_like(params, mesh), abstract_like(opt_state, mesh)
    with RunCheckpointer(run_dir, keep=3, every_steps=10) as ckpt:
        restored = ckpt.restore(10, abstract_params=abstract_params, abstract_opt_state=abstract_opt)
    assert_trees_equal(restored["params"], params)
    assert_trees_equal(restored["opt_state"], opt_state)
    for got, want in zip(jax.tree.leaves((restored["params"], restored["opt_state"])),
                         jax.tree.leaves((abstract_params, abstract_opt))):
        assert got.sharding == want.sharding


def test_pinned_host_leaves_come_back_in_host_memory(saved_run):
    run_dir, params, opt_state = saved_run
    mesh = mesh_of((8, 1))
    with RunCheckpointer(run_dir, keep=3, every_steps=10) as ckpt:
        restored = ckpt.restore(None, abstract_params=abstract_like(params, mesh),
                                abstract_opt_state=abstract_like(opt_state, mesh))["opt_state"]
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves((restored.mu, restored.nu))}
    assert kinds == {PINNED_HOST}
    assert restored.master["embed"].sharding.memory_kind == "device"
    assert_trees_equal(restored.mu, opt_state.mu)


def test_restore_params_only_from_run_dir_or_step_dir(saved_run):
    run_dir, params, opt_state = saved_run
    mesh = mesh_of((1, 1))
    with RunCheckpointer(run_dir, keep=3, every_steps=10) as ckpt:
        save_step(ckpt, 20, jax.tree.map(lambda x: x * 2, params), opt_state)
    for path, factor, step in ((run_dir, 2, 20), (run_dir / "10", 1, 10)):
        restored, meta = restore_params_only(path, abstract_like(params, mesh))
        assert meta["step"] == step
        assert_trees_equal(restored, jax.tree.map(lambda x: x * factor, params))
        assert {leaf.sharding.mesh.devices.size for leaf in jax.tree.leaves(restored)} == {1}


def test_a_training_run_directory_is_accepted_wherever_a_checkpoint_is_read(tmp_path):
    # <run>/checkpoints/<step>: the run directory (what the README's fine-tune example passes), the
    # checkpoints directory and the step folder all name the same weights
    params, opt_state = make_state(mesh_of((2, 4)))
    with RunCheckpointer(tmp_path / "run" / "checkpoints", keep=3, every_steps=1) as ckpt:
        save_step(ckpt, 1, params, opt_state, recipe_json='{"lr": 1}')
        save_step(ckpt, 2, jax.tree.map(lambda x: x * 2, params), opt_state)
    step_2 = tmp_path / "run" / "checkpoints" / "2"
    for path in (tmp_path / "run", tmp_path / "run" / "checkpoints", step_2):
        assert resolve_step_dir(path) == step_2
        restored, meta = restore_params_only(path, abstract_like(params, mesh_of((1, 1))))
        assert meta["step"] == 2
        assert_trees_equal(restored, jax.tree.map(lambda x: x * 2, params))
    assert read_recipe_json(tmp_path / "run") == RECIPE_JSON
    assert read_recipe_json(tmp_path / "run" / "checkpoints" / "1") == '{"lr": 1}'


def test_set_aside_renames_a_step_that_can_then_be_saved_again(tmp_path):
    params, opt_state = make_state(mesh_of((2, 4)))
    mesh = mesh_of((2, 4))
    with RunCheckpointer(tmp_path, keep=3, every_steps=1) as ckpt:
        save_step(ckpt, 1, params, opt_state)
        save_step(ckpt, 2, params, opt_state)
        assert ckpt.set_aside(2, "corrupt") == tmp_path / "2.corrupt"
        assert ckpt.all_steps() == [1] and ckpt.latest_step() == 1
        save_step(ckpt, 2, jax.tree.map(lambda x: x + 1, params), opt_state)  # refused while "2" was listed
        ckpt.wait()
        assert ckpt.set_aside(2, "corrupt") == tmp_path / "2.corrupt2"  # never overwrites one set aside
    with RunCheckpointer(tmp_path, keep=3, every_steps=1) as reopened:  # orbax neither lists nor cleans them
        assert reopened.all_steps() == [1]
        restored = reopened.restore(None, abstract_params=abstract_like(params, mesh),
                                    abstract_opt_state=abstract_like(opt_state, mesh))
    assert_trees_equal(restored["params"], params)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2.corrupt", "2.corrupt2"]


# -- failures a user can cause ------------------------------------------------------------------------


def test_no_checkpoint_is_a_clear_error(tmp_path):
    params, opt_state = make_state(mesh_of((2, 4)))
    abstract_params = abstract_like(params, mesh_of((2, 4)))
    with RunCheckpointer(tmp_path / "fresh", keep=2, every_steps=1) as ckpt:
        assert ckpt.latest_step() is None
        with pytest.raises(CheckpointError, match="no checkpoint found"):
            ckpt.restore(None, abstract_params=abstract_params,
                         abstract_opt_state=abstract_like(opt_state, mesh_of((2, 4))))
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        restore_params_only(tmp_path / "missing", abstract_params)
    with pytest.raises(CheckpointError, match="no checkpoint found"):
        restore_params_only(tmp_path / "fresh", abstract_params)
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        read_recipe_json(tmp_path / "missing")


def test_missing_step_names_the_steps_present(saved_run):
    run_dir, params, opt_state = saved_run
    mesh = mesh_of((2, 4))
    with RunCheckpointer(run_dir, keep=3, every_steps=10) as ckpt:
        with pytest.raises(CheckpointError, match=r"no checkpoint for step 30 \(steps present: \[10\]\)"):
            ckpt.restore(30, abstract_params=abstract_like(params, mesh),
                         abstract_opt_state=abstract_like(opt_state, mesh))


def test_incompatible_tree_names_keys_and_shapes(saved_run):
    run_dir, params, opt_state = saved_run
    mesh = mesh_of((2, 4))
    target = abstract_like(params, mesh)
    target["embed"] = jax.ShapeDtypeStruct((64, 4), jnp.float32, sharding=target["embed"].sharding)
    del target["blocks"]["norm"]
    with pytest.raises(CheckpointMismatchError) as excinfo:  # not corrupt: a resume must not skip past it
        restore_params_only(run_dir, target)
    message = str(excinfo.value)
    assert "\n" not in message
    assert str(run_dir / "10" / "params") in message
    assert "shape differs at 'embed': checkpoint (64, 64), target (64, 4)" in message
    assert "only in the checkpoint: 'blocks/norm' (checkpoint shape (8,))" in message

    # and the other way round, in the optimizer state, through RunCheckpointer.restore
    abstract_opt = abstract_like(opt_state, mesh)
    abstract_opt.mu["extra"] = abstract_opt.mu["embed"]
    with RunCheckpointer(run_dir, keep=3, every_steps=10) as ckpt:
        missing = r"missing from the checkpoint: 'mu/extra' \(target shape \(64, 64\)\)"
        with pytest.raises(CheckpointError, match=missing):
            ckpt.restore(10, abstract_params=abstract_like(params, mesh), abstract_opt_state=abstract_opt)


def test_target_without_sharding_is_refused(saved_run):
    run_dir, params, _ = saved_run
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    with pytest.raises(CheckpointError, match="needs a jax.ShapeDtypeStruct with a sharding"):
        restore_params_only(run_dir, target)


# a failed tensorstore read can leave a callback for an event loop orbax already closed
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["truncate_arrays", "delete_arrays", "garbage_metadata", "garbage_json"])
def test_corrupt_checkpoint_names_the_step(saved_run, damage):
    run_dir, params, opt_state = saved_run
    step_dir = run_dir / "10"
    array_files = glob.glob(str(step_dir / "params" / "**" / "d" / "*"), recursive=True)
    assert array_files
    if damage == "truncate_arrays":
        for name in array_files:
            os.truncate(name, os.path.getsize(name) // 2)
    elif damage == "delete_arrays":
        for name in array_files:
            os.remove(name)
    elif damage == "garbage_metadata":
        (step_dir / "params" / "_METADATA").write_text("\x00 not json")
    else:
        (step_dir / "meta" / "metadata").write_text("{truncated")
    mesh = mesh_of((2, 4))
    with RunCheckpointer(run_dir, keep=3, every_steps=10) as ckpt:
        with pytest.raises(CorruptCheckpointError, match="corrupt") as excinfo:
            ckpt.restore(10, abstract_params=abstract_like(params, mesh),
                         abstract_opt_state=abstract_like(opt_state, mesh))
    assert str(step_dir) in str(excinfo.value)
    assert "\n" not in str(excinfo.value)  # the command line prints it as one line


def test_async_save_failure_surfaces_at_wait(tmp_path, monkeypatch):
    params, opt_state = make_state(mesh_of((2, 4)))
    mesh = mesh_of((2, 4))
    ckpt = RunCheckpointer(tmp_path, keep=3, every_steps=1)
    save_step(ckpt, 1, params, opt_state)
    ckpt.wait()

    def disk_full(path, text):
        raise OSError(28, "No space left on device")

    # the recipe file is written in orbax's background commit, like the arrays
    monkeypatch.setattr(checkpoint_items, "_write_text", disk_full)
    save_step(ckpt, 2, params, opt_state)  # returns: the failure happens in the background
    with pytest.raises(CheckpointError, match=r"/2: the async save failed .*\(step 1 is intact\).*No space left"):
        ckpt.wait()
    assert ckpt.latest_step() == 1
    assert not (tmp_path / "2").exists()

    monkeypatch.undo()  # the run carries on: the next save works and the failed step can be saved again
    save_step(ckpt, 2, params, opt_state)
    ckpt.close()
    with RunCheckpointer(tmp_path, keep=3, every_steps=1) as reopened:
        assert reopened.all_steps() == [1, 2]
        restored = reopened.restore(2, abstract_params=abstract_like(params, mesh),
                                    abstract_opt_state=abstract_like(opt_state, mesh))
    assert_trees_equal(restored["params"], params)


def test_an_unwritable_directory_fails_when_opened_in_one_line():
    # /sys refuses mkdir even to root (a chmod'ed folder would not stop root)
    with pytest.raises(CheckpointError, match=r"^/sys/spillway-test/checkpoints: cannot write checkpoints here: ") \
            as excinfo:
        RunCheckpointer("/sys/spillway-test/checkpoints", keep=2, every_steps=1)
    assert "\n" not in str(excinfo.value) and isinstance(excinfo.value, RunError)


def test_a_failed_async_save_is_reported_by_polling_without_waiting(tmp_path, monkeypatch):
    params, opt_state = make_state(mesh_of((2, 4)))
    ckpt = RunCheckpointer(tmp_path, keep=3, every_steps=1)
    save_step(ckpt, 1, params, opt_state)
    ckpt.raise_if_save_failed()  # in flight or done, not failed: nothing to report
    ckpt.wait()
    ckpt.raise_if_save_failed()  # nothing in flight

    def disk_full(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_items, "_write_text", disk_full)
    save_step(ckpt, 2, params, opt_state)
    deadline = time.monotonic() + 60
    with pytest.raises(CheckpointError, match=r"/2: the async save failed .*\(step 1 is intact\).*No space left"):
        while time.monotonic() < deadline:  # what the train loop does once per step
            ckpt.raise_if_save_failed()
            time.sleep(0.01)
    monkeypatch.undo()
    ckpt.close()
    with RunCheckpointer(tmp_path, keep=3, every_steps=1) as reopened:
        assert reopened.all_steps() == [1]


def test_a_save_failed_twice_over_is_not_raised_again_by_close(tmp_path, monkeypatch):
    """A full disk fails the step's metadata write and its commit alike: orbax's manager reports the first, and
    its async checkpointer kept the second and raised it from close(), in the train loop's `finally`, where it
    replaced the run's one line naming the intact step with orbax's own error."""
    from orbax.checkpoint._src.metadata import checkpoint as orbax_metadata

    params, opt_state = make_state(mesh_of((2, 4)))
    ckpt = RunCheckpointer(tmp_path, keep=3, every_steps=1)
    save_step(ckpt, 1, params, opt_state)
    ckpt.wait()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    write_metadata = orbax_metadata._MetadataStoreImpl.write
    monkeypatch.setattr(checkpoint_items, "_write_text", disk_full)
    monkeypatch.setattr(orbax_metadata._MetadataStoreImpl, "write", lambda self, path, metadata: (
        disk_full() if "/2." in str(path) else write_metadata(self, path, metadata)))
    save_step(ckpt, 2, params, opt_state)
    with pytest.raises(CheckpointError, match=r"/2: the async save failed .*\(step 1 is intact\).*No space left"):
        ckpt.wait()
    ckpt.close()   # the failure was reported above
    monkeypatch.undo()
    with RunCheckpointer(tmp_path, keep=3, every_steps=1) as reopened:
        assert reopened.all_steps() == [1]


def test_a_ctrl_c_while_waiting_for_a_save_leaves_close_waiting_for_it(tmp_path, monkeypatch):
    """A Ctrl-C that interrupts Thread.join (Python 3.11, 3.12) marks the joined thread as finished while it still
    runs: a Ctrl-C while the run waited for its last async save left orbax's finalize thread looking done, close()
    returned at once and the command left mid-save (the old step it was deleting half deleted, or the new one
    never finalised). The wait is polled, so close() waits for the save."""
    import orbax.checkpoint as ocp

    finalize = ocp.CheckpointManager._finalize_checkpoint

    def slow_finalize(self, *args, **kwargs):
        time.sleep(1.5)   # a large save's commit: long enough for the Ctrl-C below to land while it runs
        return finalize(self, *args, **kwargs)

    params, opt_state = make_state(mesh_of((2, 4)))
    ckpt = RunCheckpointer(tmp_path, keep=1, every_steps=1)
    save_step(ckpt, 1, params, opt_state)
    ckpt.wait()
    monkeypatch.setattr(ocp.CheckpointManager, "_finalize_checkpoint", slow_finalize)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        save_step(ckpt, 2, params, opt_state)   # keep=1: step 1 is deleted once step 2 is finalised
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            ckpt.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    ckpt.close()   # what the train loop's `finally` does before the command leaves
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["2"]


def test_a_corrupt_newest_step_read_through_its_directory_names_the_older_steps(saved_run):
    run_dir, params, opt_state = saved_run
    with RunCheckpointer(run_dir, keep=3, every_steps=10) as ckpt:
        save_step(ckpt, 20, params, opt_state)
    for name in glob.glob(str(run_dir / "20" / "params" / "**" / "d" / "*"), recursive=True):
        os.remove(name)
    target = abstract_like(params, mesh_of((1, 1)))
    with pytest.raises(CorruptCheckpointError, match=rf"older steps \[10\]: pass one of their folders, e.g. "
                                                     rf"{run_dir}/10\)$"):
        restore_params_only(run_dir, target)
    restored, meta = restore_params_only(run_dir / "10", target)  # which works
    assert meta["step"] == 10


def test_a_numbered_folder_holding_no_step_is_not_a_step(saved_run):
    """An empty `25/` beside real steps (made by hand, or emptied) was taken as the newest step: generate and
    export then said "no checkpoint found (no finalised step folder)" for the whole run."""
    from spillway.recipes.train.checkpoint import finalised_step_dirs, resolve_step_dir

    run_dir, _, _ = saved_run
    (run_dir / "25").mkdir()
    assert [d.name for d in finalised_step_dirs(run_dir)] == ["10"]
    assert resolve_step_dir(run_dir).name == "10"


# -- crashes: real child processes --------------------------------------------------------------------


CHILD_PRELUDE = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import jax, jax.numpy as jnp
    from spillway.recipes.train.checkpoint import RunCheckpointer

    run_dir = sys.argv[1]

    def small_params(scale):
        return {"w": jnp.arange(12.0).reshape(3, 4) * scale, "b": jnp.ones(4) * scale}
    def small_opt(scale):
        return {"count": jnp.asarray(scale, jnp.int32), "mu": small_params(scale * 10)}
""")


def run_child(body: str, run_dir: Path) -> subprocess.Popen:
    env = child_env(devices=1, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-c", CHILD_PRELUDE + textwrap.dedent(body), str(run_dir)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def single_device_target(tree):
    sharding = NamedSharding(mesh_of((1, 1)), P())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype, sharding=sharding), tree)


def expected_small_state(scale):
    params = {"w": np.arange(12.0, dtype=np.float32).reshape(3, 4) * scale, "b": np.ones(4, np.float32) * scale}
    opt = {"count": np.asarray(scale, np.int32),
           "mu": {"w": np.arange(12.0, dtype=np.float32).reshape(3, 4) * scale * 10,
                  "b": np.ones(4, np.float32) * scale * 10}}
    return params, opt


def test_opening_removes_unfinished_saves_before_it_returns_and_leaves_no_thread_behind(tmp_path, monkeypatch):
    # orbax's own cleanup (cleanup_tmp_directories) deleted in a thread that only a save joined: slowed down
    # here, as on a busy machine, it was still deleting after the RunCheckpointer had closed, beside whatever
    # opened the directory next
    from orbax.checkpoint._src.path import async_path
    real_rmtree = async_path.rmtree

    async def slow_rmtree(path):
        await asyncio.sleep(5.0)
        return await real_rmtree(path)

    monkeypatch.setattr(async_path, "rmtree", slow_rmtree)
    (tmp_path / "5.orbax-checkpoint-tmp" / "params").mkdir(parents=True)
    (tmp_path / "4").mkdir()   # a finalised step's name: left alone
    before = set(threading.enumerate())
    ckpt = RunCheckpointer(tmp_path, keep=2, every_steps=1)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["4"]
    ckpt.close()
    # A thread still working a second after close() (a slowed deletion takes 5 s) is what this guards against;
    # an idle executor thread orbax's file operations started may still be ending its shutdown at close().
    started = [t for t in threading.enumerate() if t not in before and not t.daemon]
    for thread in started:
        thread.join(timeout=1.0)
    assert [t.name for t in started if t.is_alive()] == []


def test_sigkill_during_save_leaves_previous_step_usable(tmp_path):
    run_dir = tmp_path / "run"
    # step 1 is small and finished; step 2 is ~128 MiB of incompressible data, so its background
    # write takes far longer than the parent needs to notice the tmp folder and kill the child
    child = run_child("""
        ckpt = RunCheckpointer(run_dir, keep=3, every_steps=1)
        ckpt.save(1, params=small_params(1), opt_state=small_opt(1), loader_state={"pos": 1},
                  meta={"step": 1}, recipe_json="{}")
        ckpt.wait()
        rng = np.random.default_rng(0)
        big = {f"w{i}": jnp.asarray(rng.integers(0, 2**31, (1024, 4096), dtype=np.int32)) for i in range(8)}
        ckpt.save(2, params=big, opt_state=small_opt(2), loader_state={"pos": 2}, meta={"step": 2},
                  recipe_json="{}")
        print("saving step 2", flush=True)
        ckpt.wait()
        print("step 2 finished", flush=True)
    """, run_dir)
    tmp_step = run_dir / "2.orbax-checkpoint-tmp"

    def array_bytes_written() -> bool:  # tensorstore is part-way through step 2's array data
        files = glob.glob(str(tmp_step / "params*" / "**" / "d" / "*"), recursive=True)
        return sum(os.path.getsize(f) for f in files if os.path.exists(f)) >= 2**20

    deadline = time.monotonic() + 60
    while not array_bytes_written() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    child.send_signal(signal.SIGKILL)
    _, stderr = child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL, stderr[-3000:]
    assert tmp_step.exists() and array_bytes_written(), "the child never started writing step 2"
    assert not (run_dir / "2").exists(), "step 2 finished before the kill; the test needs a slower save"

    params, opt = expected_small_state(1)
    with RunCheckpointer(run_dir, keep=3, every_steps=1) as ckpt:
        assert ckpt.latest_step() == 1
        restored = ckpt.restore(None, abstract_params=single_device_target(params),
                                abstract_opt_state=single_device_target(opt))
        assert_trees_equal(restored["params"], params)
        assert_trees_equal(restored["opt_state"], opt)
        assert restored["meta"] == {"step": 1}
        # the run goes on: step 2 saved again, the killed save's tmp folder cleaned away
        ckpt.save(2, params=restored["params"], opt_state=restored["opt_state"], loader_state={},
                  meta={"step": 2}, recipe_json="{}")
    assert sorted(p.name for p in run_dir.iterdir()) == ["1", "2"]
    tmp_step.mkdir()  # as a killed save leaves it: restoring from it directly is refused too
    with pytest.raises(CheckpointError, match="unfinished save"):
        restore_params_only(tmp_step, single_device_target(params))


def test_steps_swapped_by_hand_are_not_read_as_each_other(saved_run):
    """A new user's finding: with two step folders swapped, `spillway generate` sampled and `spillway export`
    exported (as "step 20") step 10's weights without a word; train's resume alone checked the meta record."""
    run_dir, params, opt_state = saved_run
    with RunCheckpointer(run_dir, keep=3, every_steps=10) as ckpt:
        save_step(ckpt, 20, jax.tree.map(lambda x: x * 2, params), opt_state)
    (run_dir / "10").rename(run_dir / "x")
    (run_dir / "20").rename(run_dir / "10")
    (run_dir / "x").rename(run_dir / "20")
    target = abstract_like(params, mesh_of((1, 1)))
    with pytest.raises(CorruptCheckpointError, match=rf"{run_dir}/20: its meta record says step 10, its folder step "
                                                     rf"20: the record is damaged .*older steps \[10\]"):
        restore_params_only(run_dir, target)
    with pytest.raises(CorruptCheckpointError, match=rf"{run_dir}/10: its meta record says step 20"):
        restore_params_only(run_dir / "10", target)
