#!/usr/bin/env python
"""What it costs every process to agree, every step, on whether to stop (recipes/train/preemption.py).

Two processes on this machine stand in for two hosts (gloo collectives, two
CPU devices each, as tests/recipes/train/test_multiprocess.py). Each runs a jitted
stand-in for a train step (a chain of matmuls over a batch sharded on all four
devices, with a cross-process reduction like a gradient all-reduce) and reads
its "loss" one step late, as the train loop does, in three ways:

    none        no agreement (what a single process does)
    vote        distributed.StopVote: a max-reduction cast after step N and read
                after step N + 1 (what the train loop does)
    allgather   multihost_utils.process_allgather of the flag after every step,
                read at once (the obvious alternative: it waits for the step)

and prints the mean step time of each (best of three interleaved runs) and
the difference to `none`.

Run:  .venv/bin/python benchmarks/stop_vote_cost.py [--steps 200] [--size 512]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time


def _worker(process_id: int, port: int, steps: int, size: int) -> None:
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec

    from spillway.layers.mesh import MeshConfig
    from spillway.layers.sharding import make_mesh
    from spillway.recipes.train.distributed import StopVote

    mesh = make_mesh(MeshConfig(1, -1, 1))
    batch_sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    local = np.ones((4 // jax.process_count() * 8, size), np.float32)
    x = jax.make_array_from_process_local_data(batch_sharding, local)
    w = jax.device_put(jnp.eye(size, dtype=jnp.float32) * 0.5, NamedSharding(mesh, PartitionSpec()))

    @jax.jit
    def step(w, x):
        h = x
        for _ in range(4):
            h = jnp.tanh(h @ w)
        loss = h.mean()  # a reduction over every process's rows, like the gradient all-reduce
        return w + 1e-6 * loss, loss

    vote = StopVote(mesh)

    def run(mode: str) -> float:
        nonlocal w
        pending_loss, cast = None, None
        for i in range(steps + 10):
            if i == 10:  # after warm-up and compiles
                multihost_utils.sync_global_devices(f"start-{mode}")
                start = time.perf_counter()
            w, loss = step(w, x)
            if pending_loss is not None:
                float(pending_loss)
            pending_loss = loss
            if mode == "vote":
                if cast is not None:
                    int(cast)
                cast = vote.cast(0)
            elif mode == "allgather":
                multihost_utils.process_allgather(np.int32(0))
        float(pending_loss)
        return (time.perf_counter() - start) / steps

    results = {}
    for mode in ("none", "vote", "allgather") * 3:  # interleaved, best of three: load on the machine varies
        results[mode] = min(results.get(mode, float("inf")), run(mode))
    if process_id == 0:
        print(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--size", type=int, default=512, help="matmul size: sets the stand-in step's time")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        _worker(args.worker, args.port, args.steps, args.size)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(i), "--port", str(port),
                               "--steps", str(args.steps), "--size", str(args.size)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(2)]
    outputs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        if p.returncode != 0:
            sys.exit(f"worker failed:\n{err[-3000:]}")
    times = json.loads(outputs[0][0].strip().splitlines()[-1])
    base = times["none"]
    print(f"2 processes x 2 CPU devices, {args.steps} steps, stand-in step of 4 matmuls {args.size}^2 per row block")
    print(f"{'mode':10s} {'ms/step':>9s} {'vs none':>9s}")
    for mode in ("none", "vote", "allgather"):
        print(f"{mode:10s} {times[mode] * 1e3:9.3f} {(times[mode] - base) * 1e3:+9.3f}")


if __name__ == "__main__":
    main()
