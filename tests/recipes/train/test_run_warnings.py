"""What a run warns of that would otherwise go unsaid: a mesh that does not split what it should, a step that
trains nothing, each as a line of the run's own.

New users' findings: weights the mesh cannot divide were a raw Python warning (a file path and a source line
among the run's lines, "0.00 GiB" for a small model), and a micro-batch the batch axes do not divide, which
every device then computes whole, was not said at all.
"""

from __future__ import annotations

import warnings

import jax

from micro_recipe import micro
from spillway.layers.mesh import replicated_micro_batch
from spillway.layers.sharding import make_mesh


def test_a_micro_batch_the_batch_axes_do_not_divide_is_named():
    sizes = {"data": 1, "fsdp": 4, "tensor": 1}
    line = replicated_micro_batch(sizes, global_batch=8, grad_accum=4)
    assert line.startswith("warning: a micro-batch of 2 sequences (train.global_batch 8 / train.grad_accum 4) is "
                           "not split over the data x fsdp mesh size (4): it is replicated")
    assert replicated_micro_batch(sizes, global_batch=8, grad_accum=2) is None
    assert replicated_micro_batch({"data": 1, "fsdp": 1, "tensor": 1}, global_batch=3, grad_accum=3) is None


def test_the_runs_mesh_warnings_are_its_own_lines(tmp_path):
    from spillway.recipes.train.loop import _build_setup

    assert jax.device_count() == 8   # tests/conftest.py
    # tensor=8 divides no KV head count of 2 (replicated); 8 rows in micro-batches of 1 over data x fsdp = 1
    recipe = micro(tmp_path / "cache", tmp_path / "run", "mesh.tensor=8", "mesh.fsdp=1", "train.grad_accum=8")
    said = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a warning left raw fails the test
        _build_setup(recipe, make_mesh(recipe.mesh), said.append, initialise=False)
    replicated = [line for line in said if "does not divide" in line]
    assert len(replicated) == 1 and replicated[0].startswith("warning: the mesh ")
    assert " MiB of weights)" in replicated[0]
    assert not any("micro-batch" in line for line in said)   # data x fsdp = 1: nothing to split
    recipe = micro(tmp_path / "cache", tmp_path / "run", "mesh.fsdp=4", "mesh.data=2", "train.grad_accum=4")
    said.clear()
    _build_setup(recipe, make_mesh(recipe.mesh), said.append, initialise=False)
    assert any(line.startswith("warning: a micro-batch of 2 sequences") for line in said)


def test_a_step_whose_gradient_is_exactly_zero_is_warned_of_once(tmp_path):
    """A new user's finding: LoRA adapters on weights a user's block never calls trained nothing (grad_norm 0.0
    every step, an MFU of 97% as XLA dropped the backward pass), without a word."""
    from types import SimpleNamespace

    from spillway.recipes.train.loop_parts import Progress

    written = []
    recipe = micro(tmp_path / "cache", tmp_path / "run", "lora.rank=4", f"checkpoint.init_from={tmp_path / 'base'}")
    feed = SimpleNamespace(data=SimpleNamespace(seq_len=32, is_mixture=False))
    logger = SimpleNamespace(log=lambda step, row: None)
    bar = SimpleNamespace(write=written.append, set_postfix=lambda values: None)
    progress = Progress(recipe, feed, logger, bar, checkpointer=SimpleNamespace(all_steps=list), main=True)
    for step in (1, 2):
        progress.after_step(step, {"loss": 3.0, "grad_norm": 0.0, "learning_rate": 1e-3})
    assert written == ["warning: step 1's gradient is exactly zero: no trained weight reaches the loss, so nothing "
                       "trains (lora.targets ['q_proj', 'v_proj']: are they weights the blocks' forward uses?)"]
    progress.after_step(3, {"loss": 3.0, "grad_norm": 0.5, "learning_rate": 1e-3})
    assert len(written) == 1
