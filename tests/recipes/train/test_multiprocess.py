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


def _two_processes(command_of, port: int) -> list[subprocess.Popen]:
    """Processes 0 and 1 of one run (2 devices each, process 0 at `port`), process i running `command_of(i)`."""
    return [subprocess.Popen(command_of(i), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=_env(2, SPILLWAY_NUM_PROCESSES="2", SPILLWAY_PROCESS_ID=str(i),
                                      SPILLWAY_COORDINATOR=f"127.0.0.1:{port}"))
            for i in range(2)]


def _until_logged(procs, metrics, rows: int) -> None:
    """Waits (400 s at most) until `metrics` holds `rows` rows, every process still running."""
    import time

    deadline = time.time() + 400
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= rows):
        assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs]
        time.sleep(0.5)


@pytest.mark.slow  # in `make test-slow` (CI runs it): minutes on 2 cores
def test_two_processes_match_one(tmp_path):
    cache = tmp_path / "cache"
    single = subprocess.run(_command(tmp_path / "single", cache), env=_env(4), capture_output=True, text=True,
                            timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]

    # with the closing sample asked for (the default): process 0 sampled alone from weights sharded over both
    # processes and waited forever, the other at the end barrier; it says how to sample instead now
    multi_command = _command(tmp_path / "multi", cache) + ["--set", "train.sample_tokens=8"]
    port = _free_port()
    procs = _two_processes(lambda i: multi_command, port)
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    assert "2 process(es)" in outputs[0][0] and "over 4 cpu device(s)" in outputs[0][0]
    assert f"sample: none in a run of 2 processes; one process samples the saved step: spillway generate " \
           f"{tmp_path / 'multi'}" in outputs[0][0]
    assert f"process 1 of 2: joining the others at 127.0.0.1:{port}" in outputs[1][1]
    multi, reference = _losses(tmp_path / "multi"), _losses(tmp_path / "single")
    assert len(multi) == STEPS
    assert multi == pytest.approx(reference, rel=1e-5)
    assert (tmp_path / "multi" / "checkpoints" / str(STEPS)).is_dir()


@pytest.mark.slow  # in `make test-slow` (CI runs it): minutes on 2 cores
def test_sigterm_to_one_process_stops_both_after_the_same_step(tmp_path):
    """Preemption notices may reach only some hosts: a save only some processes enter would hang. Both
    processes must agree on the step (recipes/train/preemption.py), save it together and exit 143."""
    import signal

    from spillway.recipes.train.checkpoint import RunCheckpointer

    run_dir = tmp_path / "run"
    command = _command(run_dir, tmp_path / "cache") + ["--set", "train.steps=100000",
                                                       "--set", "checkpoint.every_steps=100000"]
    procs = _two_processes(lambda i: command, _free_port())
    metrics = run_dir / "metrics.jsonl"
    try:
        _until_logged(procs, metrics, 3)
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


@pytest.mark.slow  # in `make test-slow` (CI runs it): minutes on 2 cores
def test_a_killed_process_ends_the_other_at_once_in_one_line(tmp_path):
    """The survivor's step failed at once (gloo: connection reset by peer), but it said "internal error, please
    report it", then waited out jax.distributed's shutdown for the dead process (its 100 s heartbeat) and
    aborted with pages of C++ log and a stack trace."""
    import signal
    import time

    run_dir = tmp_path / "run"
    command = _command(run_dir, tmp_path / "cache") + ["--set", "train.steps=100000",
                                                       "--set", "checkpoint.every_steps=100000"]
    procs = _two_processes(lambda i: command, _free_port())
    try:
        # in steady training: a kill in the first steps can find the other inside jax's C++, setting up a
        # collective's first use, where only jax's heartbeat (100 s, then an abort) ends it
        _until_logged(procs, run_dir / "metrics.jsonl", 10)
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.time()
        _, err = procs[0].communicate(timeout=300)
        took = time.time() - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    lines = [line for line in err.replace("\r", "\n").splitlines() if "spillway train:" in line or " F1" in line
             or "Check failure" in line]
    assert procs[0].returncode == 2 and took < 60, (procs[0].returncode, took, err[-3000:])
    assert lines == ["spillway train: error: another process of this run stopped (killed, crashed or its host "
                     "lost: " + lines[0].split("its host lost: ", 1)[1]], err[-3000:]
    assert "start every process again to resume" in lines[0]


def test_a_collective_a_lost_process_broke_is_named_as_such():
    """What gloo raises on the processes left when one dies: not "internal error, please report it"."""
    from jax.errors import JaxRuntimeError

    from spillway.recipes import cli
    from spillway.recipes.train import distributed  # noqa: F401 - loaded by every `spillway train`

    reset = JaxRuntimeError("UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:538] "
                            "Read error [127.0.0.1]:27027: Connection reset by peer")
    assert cli.describe_error(reset) == (
        "another process of this run stopped (killed, crashed or its host lost: Gloo all-reduce failed: "
        "[external/gloo/gloo/transport/tcp/pair.cc:538] Read error [127.0.0.1]:27027: Connection reset by peer); "
        "the saved checkpoints are kept: start every process again to resume", cli.EXIT_USER_ERROR)
    other = JaxRuntimeError("UNKNOWN: Gloo all-reduce failed: some other reason")
    assert cli.describe_error(other)[0].startswith("internal error, please report it")


@pytest.mark.slow  # in `make test-slow` (CI runs it): minutes on 2 cores
def test_processes_given_different_recipes_are_refused_in_one_line(tmp_path):
    """Another checkpoint.dir on process 1 trained apart from process 0 and then hung both at the first save."""
    procs = _two_processes(lambda i: _command(tmp_path / f"run{i}", tmp_path / "cache"), _free_port())
    try:
        outputs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    says = (f"spillway train: error: process 1 was given another recipe than process 0 (checkpoint.dir="
            f"'{tmp_path / 'run0'}' vs '{tmp_path / 'run1'}'; process 0's first): run the same command, with the "
            f"same --set, on every process")
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 2 and err.splitlines()[-1] == says, err[-3000:]
    assert not (tmp_path / "run0").exists() and not (tmp_path / "run1").exists()


def test_the_fields_two_processes_differ_in_are_named(monkeypatch):
    """Each field with process 0's value and the other's: a user sees which --set went astray."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from spillway.recipes.registry import get_recipe
    from spillway.recipes.train import distributed

    mine = get_recipe("tiny").to_dict()
    theirs = {**mine, "model": {**mine["model"], "d_model": 1}, "train": {**mine["train"], "steps": 7},
              # a host's own token cache and cores are not a difference between the runs
              "data": {**mine["data"], "cache_dir": "/local/ssd/cache", "num_proc": 16}}

    def allgather(value):   # what the two processes give, each with its own recipe
        if np.ndim(value) == 0:   # the lengths
            return np.array([len(json.dumps(r, sort_keys=True)) for r in (mine, theirs)], np.int32)
        longest = value.size
        rows = [json.dumps(r, sort_keys=True).encode().ljust(longest, b"\0") for r in (mine, theirs)]
        return np.stack([np.frombuffer(row, np.uint8) for row in rows])

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
    with pytest.raises(ValueError, match=rf"process 1 was given another recipe than process 0 \(model.d_model="
                                         rf"{mine['model']['d_model']} vs 1; train.steps={mine['train']['steps']} "
                                         rf"vs 7; process 0's first\)"):
        distributed.check_same_recipe(mine)


@pytest.mark.parametrize("env, says", [
    ({"SPILLWAY_NUM_PROCESSES": "two"}, r"SPILLWAY_NUM_PROCESSES='two': a whole number from 1 is needed"),
    ({"SPILLWAY_NUM_PROCESSES": "0"}, r"SPILLWAY_NUM_PROCESSES='0': a whole number from 1"),
    ({"SPILLWAY_PROCESS_ID": "abc"}, r"SPILLWAY_PROCESS_ID='abc': a whole number from 0"),
    ({"SPILLWAY_PROCESS_ID": "2"}, r"SPILLWAY_PROCESS_ID=2: the processes of SPILLWAY_NUM_PROCESSES=2 are numbered "
                                   r"0 to 1"),
    ({"SPILLWAY_COORDINATOR": "127.0.0.1"}, r"SPILLWAY_COORDINATOR='127.0.0.1': host:port of process 0 is needed"),
])
def test_a_bad_process_variable_is_named_before_jax_is_asked(monkeypatch, env, says):
    """A coordinator without its port was an IndexError inside jax ("internal error"), "abc" an int() error
    naming no variable, a count of 0 trained as one process without a word."""
    from spillway.recipes.train import distributed

    monkeypatch.setattr(distributed, "_initialized", False)
    for name, value in {"SPILLWAY_NUM_PROCESSES": "2", "SPILLWAY_PROCESS_ID": "0",
                        "SPILLWAY_COORDINATOR": "127.0.0.1:29500", **env}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=says):
        distributed.maybe_initialize()


def test_process_0_names_a_coordinator_port_another_program_holds(monkeypatch):
    """jax's coordination service segfaulted on a port in use (exit 139, one C++ log line)."""
    from spillway.recipes.train import distributed

    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ValueError, match=rf"SPILLWAY_COORDINATOR=127.0.0.1:{port}: port {port} on process "
                                             rf"0's host is in use"):
            distributed._check_port_free(f"127.0.0.1:{port}", port)
    distributed._check_port_free(f"127.0.0.1:{port}", port)   # free again once its holder closed
