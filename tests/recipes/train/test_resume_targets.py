"""A resume and a fine-tune restore into targets (recipes/train/run_state.py, step.setup(initialise=False)): no
weights initialised first, split weights (offload.params=host:N) read straight into their parts under any
split or none; in fresh processes, the host peak of a resume holds the weights once (a bound that building the
weights first, then restoring, fails)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types

import jax
import numpy as np
import pytest

from spillway.recipes.optim import param_placement as placement
from spillway.recipes.train import lora_state
from spillway.recipes.train import step as step_lib
from spillway.recipes.train.checkpoint import RunCheckpointer
from spillway.recipes.train.run_state import StepPrograms, initial_state, weights_from_elsewhere
from tests.recipes.train.host_training import small_recipe
from tests.recipes.train.test_params_split import split_settings, weight_parts
from tests.recipes.train.test_state_split import assert_trees_equal, one_device


class _Feed:
    """The loop's BatchFeed as initial_state uses it: put back to a loader position, one batch peeked."""

    def restore(self, state):
        self.position = state

    def peek(self):
        return None


def _sound_weights(params, batch):
    return types.SimpleNamespace(problem=lambda: None)


PROGRAMS = StepPrograms(train_step=None, flush=None, eval_loss=None, check_weights=_sound_weights)


def as_numpy(tree):
    return jax.tree.map(np.asarray, tree)


def filled(structs):
    """Arrays for ShapeDtypeStructs, each a distinct run of numbers, placed in the struct's sharding."""
    leaves, treedef = jax.tree.flatten(structs)
    return treedef.unflatten([jax.device_put(np.arange(leaf.size, dtype=leaf.dtype).reshape(leaf.shape) + k,
                                             leaf.sharding) for k, leaf in enumerate(leaves)])


@pytest.fixture(scope="module")
def split_step(tmp_path_factory):
    """A step saved as the loop saves it (in pieces), with the weights and the state split host:1; the
    weights and state it holds, in NumPy (the split weights joined)."""
    recipe = small_recipe(*split_settings(1))
    s = step_lib.setup(recipe, one_device(), initialise=False)
    # numbers of the right shapes in the right places, made without compiling the model's init
    params, opt_state = filled(s.params), filled(s.optimizer.abstract_state(s.params, s.param_shardings))
    s = step_lib.TrainSetup(**{**vars(s), "params": params})
    directory = tmp_path_factory.mktemp("split-step") / "checkpoints"
    with RunCheckpointer(directory, keep=2, every_steps=1, save_in_pieces=True) as ckpt:
        ckpt.save(2, params=lora_state.checkpointed(recipe, s.params), opt_state=opt_state,
                  loader_state={"position": 2}, meta={"step": 2}, recipe_json=json.dumps(recipe.to_dict()),
                  force=True)
    return directory, as_numpy(placement.saved_params(params)), as_numpy(s.optimizer.saved_form(opt_state))


@pytest.fixture
def no_weights_built(monkeypatch):
    """Building (initialising) the model's weights is refused: the run under test must only restore them."""
    def refused(*args, **kwargs):
        raise AssertionError("the weights were initialised")
    monkeypatch.setattr(step_lib, "build_model", refused)
    monkeypatch.setattr(lora_state, "initial_adapters", refused)


@pytest.mark.parametrize("settings,split", [(split_settings(2), 2), ((), None)], ids=["host:2", "device"])
def test_a_resume_initialises_no_weights_and_reads_each_part_where_it_lives(split_step, no_weights_built,
                                                                            tmp_path, settings, split):
    """Saved with the weights split host:1, resumed under host:2 or with everything on device from a setup
    whose params are ShapeDtypeStructs: the weights and state come back bit for bit, each part in its memory."""
    directory, saved_params, saved_state = split_step
    recipe = small_recipe(*settings)
    assert weights_from_elsewhere(recipe, [2]) and not weights_from_elsewhere(recipe, [])
    s = step_lib.setup(recipe, one_device(), initialise=False)
    assert step_lib.is_abstract(s.params)
    feed = _Feed()
    with RunCheckpointer(directory, keep=2, every_steps=1) as ckpt:
        state = initial_state(s, PROGRAMS, feed, ckpt, [2], run_dir=tmp_path, main=False, say=lambda line: None)
    assert state.step == 2 and feed.position == {"position": 2}
    assert weight_parts(state.params) == (({"device"}, {"pinned_host"}, {split}) if split else (set(), set(), set()))
    assert_trees_equal(as_numpy(placement.saved_params(state.params)), saved_params)
    assert_trees_equal(as_numpy(s.optimizer.saved_form(state.opt_state)), saved_state)


def test_a_fine_tune_from_a_step_initialises_no_weights(split_step, no_weights_built, tmp_path):
    """checkpoint.init_from a step saved with host:1, fine-tuned under host:2: the weights are read into
    their parts (no initialised weights beside them), the optimizer state made fresh from them."""
    directory, saved_params, _ = split_step
    recipe = small_recipe(*split_settings(2), f"checkpoint.init_from={directory / '2'}")
    assert weights_from_elsewhere(recipe, [])
    s = step_lib.setup(recipe, one_device(), initialise=False)
    state = initial_state(s, PROGRAMS, _Feed(), None, [], run_dir=tmp_path, main=False, say=lambda line: None)
    assert state.step == 0 and weight_parts(state.params) == ({"device"}, {"pinned_host"}, {2})
    assert_trees_equal(as_numpy(placement.saved_params(state.params)), saved_params)
    assert int(state.opt_state.count) == 0


# -- the host peak of a resume: measured in fresh processes ----------------------------------------------------

RESUME_PEAK = textwrap.dedent("""
    import json, sys, jax
    from spillway.layers.mesh import MeshConfig
    from spillway.layers.sharding import make_mesh
    from spillway.recipes.registry import get_recipe
    from spillway.recipes.train import lora_state
    from spillway.recipes.train import step as step_lib
    from spillway.recipes.train.checkpoint import RunCheckpointer
    from spillway.recipes.train.host_memory import restore_state
    def high_water():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    role, directory, settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    recipe = get_recipe("tiny", settings)
    mesh = make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1])
    ckpt = RunCheckpointer(directory, keep=2, every_steps=1, async_save=False, save_in_pieces=True)
    if role == "save":
        s = step_lib.setup(recipe, mesh)
        state = jax.jit(s.optimizer.init, out_shardings=s.opt_state_shardings)(s.params)
        ckpt.save(1, params=lora_state.checkpointed(recipe, s.params), opt_state=state, loader_state={},
                  meta={"step": 1}, recipe_json="{}", force=True)
        print(0, 0, 0)
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                                    # VmHWM := VmRSS now
        before = high_water()
        # "targets": as a resume now does; "built": the weights initialised first, then the restore
        s = step_lib.setup(recipe, mesh, initialise=role == "built")
        restored = jax.block_until_ready(restore_state(ckpt, s, s.params))
        print(high_water() - before, sum(leaf.nbytes for leaf in jax.tree.leaves(restored)),
              sum(leaf.nbytes for leaf in jax.tree.leaves(restored[0])))
    ckpt.close()
""")
# 85M float32 parameters (324 MiB: a 32768-token vocabulary of 1024 wide, two layers), the moments in bfloat16
# (324 MiB), the weights and the state split host:1: a checkpoint of 648 MiB
RESUME_SETTINGS = ["model.vocab_size=32768", "model.d_model=1024", "model.num_layers=2", "model.num_heads=8",
                   "model.num_kv_heads=2", "model.mlp_hidden=2048", "optimizer.moment_dtype=bfloat16",
                   *split_settings(1)]


def resume_peak(role: str, directory) -> tuple[int, int, int]:
    """(the rise of the process's peak, the bytes restored, of which the weights) of a fresh process."""
    done = subprocess.run([sys.executable, "-c", RESUME_PEAK, role, str(directory), json.dumps(RESUME_SETTINGS)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rise, restored, weights = map(int, done.stdout.split()[-3:])
    return rise, restored, weights


@pytest.mark.slow   # three fresh processes, 648 MiB written and read twice: about a minute on 2 loaded cores
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's VmHWM reset")
def test_a_resume_holds_the_weights_once(tmp_path):
    """A resume's setup and restore raise the process's peak by the restored weights and state plus what the
    planner counts beside them (host_memory.RESTORE_STAGING_BYTES: the pieces in flight, the reads' compiles,
    allocator slack); building the weights first, as a resume did before, holds them twice, a rise above that
    by most of the weights. Measured (2 loaded cores, jax 0.10.2): 648 MiB restored (324 MiB of weights), into targets
    +892-934 MiB, built first +1318-1381 MiB: the weights held twice, 426-447 MiB more.

    The contrast is drawn against the measured rise, not the planner's bound: that bound grew with the pieces
    in flight (768 MiB beside 648 MiB) past what a second copy of the weights adds."""
    from spillway.recipes.train.host_memory import RESTORE_STAGING_BYTES
    resume_peak("save", tmp_path)
    rise, restored, weights = resume_peak("targets", tmp_path)
    built_rise, _, _ = resume_peak("built", tmp_path)
    print(f"restored {restored / 2**20:.0f} MiB ({weights / 2**20:.0f} MiB of weights): into targets "
          f"+{rise / 2**20:.0f} MiB, built first +{built_rise / 2**20:.0f} MiB")
    assert rise <= restored + RESTORE_STAGING_BYTES, (rise - restored) / 2**20
    # a second copy of the weights, less a quarter for the allocator's reuse between the two runs' setups
    assert built_rise - rise > 0.75 * weights, (built_rise - rise) / 2**20


@pytest.mark.slow   # two compiles of the model's initialisation: 5 s on 2 loaded cores
def test_a_fresh_lora_runs_adapters_are_the_whole_models_made_alone():
    """A fresh LoRA run initialises its adapters alone (the base is loaded next, never initialised): the
    same numbers, bit for bit, as the adapters of the whole model that setup() builds."""
    from spillway.recipes.train.lora_step import adapters_of
    from tests.recipes.test_lora import lora_recipe
    recipe = lora_recipe()
    whole = adapters_of(step_lib.setup(recipe, one_device()).params)
    alone = lora_state.initial_adapters(recipe, step_lib.setup(recipe, one_device(), initialise=False).param_shardings)
    leaves = jax.tree.leaves(whole)
    assert leaves and any(np.abs(np.asarray(leaf)).sum() > 0 for leaf in leaves)   # A random, B zero
    assert_trees_equal(as_numpy(alone), as_numpy(whole))
