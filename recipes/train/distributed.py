"""Multi-process start-up: `jax.distributed.initialize()` when the environment describes several processes.

The same `spillway train` command runs on one host or many. Several processes
are recognised from SPILLWAY_NUM_PROCESSES / SPILLWAY_PROCESS_ID /
SPILLWAY_COORDINATOR (explicit, e.g. for tests with several processes on one
CPU machine) or from a cluster JAX detects by itself (SLURM, Open MPI, ...),
which `jax.distributed.initialize()` reads with no arguments.

It also holds the two ways processes agree on a decision: `all_processes_ok`
(synchronous, for rare decisions: the run's lock, a restore that failed on one
host) and `StopVote` (asynchronous, every step: whether any process was asked
to stop, read one step late so it never stalls the device pipeline).
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

_initialized = False


def _cluster_size_from_environment() -> int:
    for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def maybe_initialize() -> None:
    """Initialise jax.distributed if this is one process of several; no-op otherwise (idempotent)."""
    global _initialized
    if _initialized:
        return
    num = os.environ.get("SPILLWAY_NUM_PROCESSES")
    if num is not None:
        pid = os.environ.get("SPILLWAY_PROCESS_ID")
        coordinator = os.environ.get("SPILLWAY_COORDINATOR")
        if pid is None or coordinator is None:
            raise ValueError("SPILLWAY_NUM_PROCESSES is set: SPILLWAY_PROCESS_ID and SPILLWAY_COORDINATOR "
                             "(host:port of process 0) must be set too")
        if int(num) > 1:
            if jax.config.jax_platforms in ("cpu",) or os.environ.get("JAX_PLATFORMS") == "cpu":
                # CPU collectives across processes need gloo (docs/DESIGN.md section 4).
                jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(coordinator_address=coordinator, num_processes=int(num),
                                       process_id=int(pid))
    elif _cluster_size_from_environment() > 1:
        jax.distributed.initialize()
    _initialized = True


def is_main_process() -> bool:
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """All processes reach this point before any continues (no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def all_processes_ok(ok: bool) -> bool:
    """True on every process if `ok` is True on every process (a blocking all-gather; one process: `ok`)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils
    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


class StopVote:
    """The largest of one small integer per process (an exit status, 0 for "go on"), over all processes.

    `cast(value)` dispatches a max-reduction over the mesh and returns at once;
    the result is a replicated scalar that every process reads identically. The
    train loop casts after dispatching step N and reads the vote after
    dispatching step N + 1, when it already waits for step N's loss: the vote
    is queued behind step N on the devices and costs no extra wait, and every
    process, signalled or not, stops after the same step N + 1.

    Measured (benchmarks/stop_vote_cost.py, two CPU processes with gloo on a
    shared 2-core machine): +4.6 to +5.4 ms per step, about what a
    synchronous process_allgather costs there (+2.7 to +4.9 ms): on CPU the
    "devices" are the host's own cores, so nothing overlaps, and the figure is
    gloo's latency. On GPUs the 4-byte reduction is one small collective
    queued behind the step. It runs every step because a preemption grace
    period (often 30 s) must cover the steps until the vote plus the save.
    """

    def __init__(self, mesh: jax.sharding.Mesh):
        self._sharding = NamedSharding(mesh, PartitionSpec(mesh.axis_names))  # one element per device
        self._global_shape = (mesh.devices.size,)
        self._local_count = len(self._sharding.addressable_devices)
        self._max = jax.jit(lambda votes: votes.max(), out_shardings=NamedSharding(mesh, PartitionSpec()))
        self._votes: dict[int, jax.Array] = {}  # the input for each value cast so far: almost always just 0

    def cast(self, value: int) -> jax.Array:
        votes = self._votes.get(value)
        if votes is None:
            local = np.full((self._local_count,), value, np.int32)
            votes = self._votes[value] = jax.make_array_from_process_local_data(self._sharding, local,
                                                                                self._global_shape)
        return self._max(votes)
