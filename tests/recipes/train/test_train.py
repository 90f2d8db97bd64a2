"""The train loop end to end on a micro recipe with the real step: loss drops, exact resume, fine-tune onto
another mesh, gradient accumulation, SIGTERM, sampling from a checkpoint, CLI errors. The loop's host-side
policy with a stub step (the NaN stop, a profile range, saving, resuming): test_loop.py."""

import json

import jax
import numpy as np
import pytest

from spillway.recipes import cli
from spillway.recipes.train.checkpoint import RunCheckpointer
from spillway.recipes.registry import get_recipe
from spillway.recipes.train.loop import train
from spillway.recipes.train.run_identity import run_identity
from child_env import child_env


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("spillway-cache")


def micro(data_cache, run_dir, *extra):
    return get_recipe("tiny", [
        "data.source=builtin:stdlib:400000", f"data.cache_dir={data_cache}", "data.seq_len=32", "data.num_proc=1",
        "model.vocab_size=512", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
        "model.num_kv_heads=2", "model.mlp_hidden=64", "model.max_seq_len=64",
        "train.global_batch=8", "train.steps=6", "train.log_every=1", "train.eval_every=3", "train.eval_batches=1",
        "train.sample_tokens=0", "optimizer.warmup_steps=2", "optimizer.learning_rate=1e-2",
        f"checkpoint.dir={run_dir}", "checkpoint.every_steps=3", *extra])


def losses(result):
    return {row["step"]: row["loss"] for row in result.history if "loss" in row}


@pytest.fixture(scope="module")
def full_run(data_cache, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("full") / "run"
    return train(micro(data_cache, run_dir, "train.steps=30", "train.eval_every=10", "checkpoint.every_steps=10"),
                 progress=False)


def test_micro_recipe_trains_and_writes_what_a_person_expects(full_run):
    per_step = losses(full_run)
    assert sorted(per_step) == list(range(1, 31))
    assert per_step[30] < per_step[1] - 1.0, per_step
    run_dir = full_run.run_dir
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert {"loss", "tokens_per_s", "mfu", "step_time_s", "grad_norm", "learning_rate"} <= set(rows[0])
    assert any("val_loss" in r for r in rows)
    assert (run_dir / "loss.png").stat().st_size > 1000
    assert list((run_dir / "tb").glob("events.out.tfevents*"))
    assert RunCheckpointer(run_dir / "checkpoints", keep=3, every_steps=10).latest_step() == 30
    saved = json.loads(open(run_dir / "checkpoints" / "30" / "recipe" / "recipe.json").read())
    assert saved["train"]["steps"] == 30 and saved["name"] == "tiny"
    assert run_identity(run_dir) is not None   # what its exports record of it (recipes/train/run_identity.py)


@pytest.mark.slow  # in `make test-slow` (CI runs it): minutes on 2 cores
def test_interrupted_and_resumed_run_equals_uninterrupted(data_cache, tmp_path):
    straight = train(micro(data_cache, tmp_path / "straight"), progress=False)
    first = train(micro(data_cache, tmp_path / "resumed"), progress=False, stop_after=4)
    assert first.final_step == 4
    second = train(micro(data_cache, tmp_path / "resumed"), progress=False)
    assert second.final_step == 6
    expected = losses(straight)
    got = {**losses(first), **losses(second)}
    assert got == expected  # bit-identical: same data position, optimizer state and schedule
    for a, b in zip(jax.tree.leaves(straight.model), jax.tree.leaves(second.model)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))



@pytest.mark.slow  # in `make test-slow` (CI runs it): minutes on 2 cores
def test_resume_moves_optimizer_state_between_device_and_host(data_cache, tmp_path):
    """Checkpoints hold one array per state leaf whatever the placement (Optimizer.saved_form):
    a run that saved its state on device resumes with it in host memory (on a GPU the stacked
    leaves' state is split into two buffers there; on CPU it stays one), and goes on as a run on
    host throughout."""
    on_host = "offload.optimizer_state=host"
    straight = train(micro(data_cache, tmp_path / "straight", on_host), progress=False)
    first = train(micro(data_cache, tmp_path / "moved"), progress=False, stop_after=4)
    second = train(micro(data_cache, tmp_path / "moved", on_host), progress=False)
    assert second.final_step == 6
    expected, got = losses(straight), {**losses(first), **losses(second)}
    assert sorted(got) == sorted(expected)
    np.testing.assert_allclose([got[k] for k in sorted(got)], [expected[k] for k in sorted(expected)], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(straight.model), jax.tree.leaves(second.model)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-4, atol=1e-6)

def test_pinned_memory_above_the_hosts_ram_stops_the_run_before_anything_is_allocated(
        data_cache, tmp_path, monkeypatch):
    from spillway.recipes.optim import host_memory
    from spillway.recipes.train import loop

    monkeypatch.setattr(host_memory, "_meminfo_total_bytes", lambda: 10_000)
    monkeypatch.setattr(loop, "setup", lambda *args, **kwargs: pytest.fail("setup() ran: the weights were made"))
    recipe = micro(data_cache, tmp_path / "run", "offload.params=host", "offload.optimizer_state=host",
                   "train.grad_accum=2")
    with pytest.raises(host_memory.HostMemoryError, match=r"needs \S+ GiB of pinned host memory \(optimizer state "
                       r"\S+ GiB, weights \S+ GiB, their gradients \S+ GiB\), but this host has 0.00 GiB.*"
                       r"offload.params=device"):
        train(recipe, progress=False)


@pytest.mark.slow  # in `make test-slow` (CI runs it): minutes on 2 cores
def test_finetune_from_checkpoint_onto_another_mesh(full_run, data_cache, tmp_path):
    scratch = train(micro(data_cache, tmp_path / "scratch", "train.steps=1"), progress=False)
    tuned = train(micro(data_cache, tmp_path / "tuned", "train.steps=1", "mesh.data=2", "mesh.fsdp=2",
                        "mesh.tensor=2", f"checkpoint.init_from={full_run.run_dir / 'checkpoints'}"),
                  progress=False)
    # Starts from the trained weights (low loss), with a fresh schedule (warmup's first learning rate).
    assert losses(tuned)[1] < losses(scratch)[1] - 1.0
    assert tuned.history[0]["learning_rate"] == scratch.history[0]["learning_rate"]
    spec = tuned.model.layers.blocks.mlp.w_up.get_value().sharding.spec
    assert tuple(spec) == (None, "fsdp", "tensor")


@pytest.mark.slow  # in `make test-slow` (CI runs it): minutes on 2 cores
def test_gradient_accumulation_matches_one_big_batch(data_cache, tmp_path):
    whole = train(micro(data_cache, tmp_path / "whole", "train.steps=2"), progress=False)
    accumulated = train(micro(data_cache, tmp_path / "accum", "train.steps=2", "train.grad_accum=4"),
                        progress=False)
    assert losses(accumulated) == pytest.approx(losses(whole), rel=1e-5)
    for a, b in zip(jax.tree.leaves(whole.model), jax.tree.leaves(accumulated.model)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_sigterm_saves_and_exits_143(data_cache, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    run_dir = tmp_path / "term"
    recipe = micro(data_cache, run_dir, "train.steps=100000", "checkpoint.every_steps=100000")
    argv = [sys.executable, "-m", "spillway.recipes.cli", "train", "tiny"]
    for key, value in [("data.source", recipe.data.source), ("data.cache_dir", recipe.data.cache_dir),
                       ("data.seq_len", 32), ("data.num_proc", 1), ("model.vocab_size", 512),
                       ("model.d_model", 32), ("model.num_layers", 2), ("model.num_heads", 4),
                       ("model.num_kv_heads", 2), ("model.mlp_hidden", 64), ("model.max_seq_len", 64),
                       ("train.global_batch", 8), ("train.steps", 100000), ("train.log_every", 1),
                       ("train.eval_every", 0), ("checkpoint.dir", run_dir),
                       ("checkpoint.every_steps", 100000)]:
        argv += ["--set", f"{key}={value}"]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=child_env())
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert child.poll() is None, child.communicate()[1][-2000:]
        time.sleep(0.5)
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 143, err[-2000:]
    saved = RunCheckpointer(run_dir / "checkpoints", keep=3, every_steps=100000).latest_step()
    assert saved is not None and saved >= 3


def test_generate_from_a_checkpoint(full_run, capsys):
    assert cli.main(["generate", str(full_run.run_dir), "--prompt", "def ", "--tokens", "8",
                     "--temperature", "0"]) == 0
    text = capsys.readouterr().out
    # The micro model is barely trained (greedy picks indentation); what matters is that new text came.
    assert text.startswith("def ") and len(text.rstrip("\n")) > len("def ")


@pytest.mark.parametrize("argv,message", [
    (["train", "tiny", "--set", "train.stepz=3"], "unknown field 'train.stepz'"),
    (["train", "tiny", "--set", "train.steps=many"], "train.steps: expected an integer, got 'many'"),
    (["train", "nope"], "unknown recipe 'nope'"),
    (["generate", "/no/such/run", "--prompt", "x"], "does not exist"),
])
def test_cli_errors_name_the_problem(argv, message, capsys):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err
