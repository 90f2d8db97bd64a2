"""Two processes on one CPU machine stand in for two hosts: the same command, jax.distributed, same losses.

Each process holds 2 of 4 global devices (gloo collectives). The two-process run
must give the same per-step losses as one process with 4 devices, since both
read the same global batches.
"""

import json
import socket
import subprocess
import sys

import pytest
from child_env import child_env

STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(run_dir, cache_dir):
    return [sys.executable, "-m", "spillway.recipes.cli", "train", "tiny",
            "--set", "data.source=builtin:stdlib:300000", "--set", f"data.cache_dir={cache_dir}",
            "--set", "data.seq_len=32", "--set", "data.num_proc=1", "--set", "model.vocab_size=512",
            "--set", "model.d_model=32", "--set", "model.num_layers=2", "--set", "model.num_heads=4",
            "--set", "model.num_kv_heads=2", "--set", "model.mlp_hidden=64", "--set", "model.max_seq_len=64",
            "--set", "train.global_batch=8", "--set", f"train.steps={STEPS}", "--set", "train.log_every=1",
            "--set", "train.eval_every=0", "--set", "train.sample_tokens=0",
            "--set", f"checkpoint.dir={run_dir}", "--set", f"checkpoint.every_steps={STEPS}"]


def _env(devices: int, **extra) -> dict:
    return child_env(devices=devices, **extra)


def _losses(run_dir):
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.slow  # in `make test-slow` (CI runs it): minutes on 2 cores
def test_two_processes_match_one(tmp_path):
    cache = tmp_path / "cache"
    single = subprocess.run(_command(tmp_path / "single", cache), env=_env(4), capture_output=True, text=True,
                            timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]

    port = _free_port()
    procs = [subprocess.Popen(_command(tmp_path / "multi", cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True,
                              env=_env(2, SPILLWAY_NUM_PROCESSES="2", SPILLWAY_PROCESS_ID=str(i),
                                       SPILLWAY_COORDINATOR=f"127.0.0.1:{port}"))
             for i in range(2)]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    assert "2 process(es)" in outputs[0][0] and "over 4 cpu device(s)" in outputs[0][0]
    multi, reference = _losses(tmp_path / "multi"), _losses(tmp_path / "single")
    assert len(multi) == STEPS
    assert multi == pytest.approx(reference, rel=1e-5)
    assert (tmp_path / "multi" / "checkpoints" / str(STEPS)).is_dir()


@pytest.mark.slow  # in `make test-slow` (CI runs it): minutes on 2 cores
def test_sigterm_to_one_process_stops_both_after_the_same_step(tmp_path):
    """Preemption notices may reach only some hosts: a save only some processes enter would hang. Both
    processes must agree on the step (recipes/train/preemption.py), save it together and exit 143."""
    import signal
    import time

    from spillway.recipes.train.checkpoint import RunCheckpointer

    run_dir = tmp_path / "run"
    command = _command(run_dir, tmp_path / "cache") + ["--set", "train.steps=100000",
                                                       "--set", "checkpoint.every_steps=100000"]
    port = _free_port()
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env(2, SPILLWAY_NUM_PROCESSES="2", SPILLWAY_PROCESS_ID=str(i),
                                       SPILLWAY_COORDINATOR=f"127.0.0.1:{port}"))
             for i in range(2)]
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.time() + 400
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs]
            time.sleep(0.5)
        procs[1].send_signal(signal.SIGTERM)  # process 1 only
        outputs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 143, err[-3000:]
    with RunCheckpointer(run_dir / "checkpoints", keep=3, every_steps=100000) as ckpt:
        steps = ckpt.all_steps()
    assert len(steps) == 1 and steps[0] >= 3
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert max(logged) == steps[0]  # the step both processes stopped after is the one saved
    assert f"SIGTERM: saved step {steps[0]}" in outputs[0][0] + outputs[0][1]
