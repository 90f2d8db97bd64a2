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

import json
import os
import socket
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

_initialized = False
JOIN_TIMEOUT_S = 300   # how long jax.distributed waits for every process to start (its default)


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
        count, index, port = _checked_environment(num, pid, coordinator)
        if count > 1:
            if jax.config.jax_platforms in ("cpu",) or os.environ.get("JAX_PLATFORMS") == "cpu":
                # CPU collectives across processes need gloo (docs/DESIGN.md section 4).
                jax.config.update("jax_cpu_collectives_implementation", "gloo")
            if index == 0:
                _check_port_free(coordinator, port)
            # jax waits silently, then ends the process from C++ ("another task died") if one never comes
            print(f"spillway: process {index} of {count}: joining the others at {coordinator} (waits up to "
                  f"{JOIN_TIMEOUT_S} s for all {count} processes to start)", file=sys.stderr, flush=True)
            jax.distributed.initialize(coordinator_address=coordinator, num_processes=count, process_id=index,
                                       initialization_timeout=JOIN_TIMEOUT_S)
            if jax.process_count() != count:
                raise ValueError(f"SPILLWAY_NUM_PROCESSES={count} here, but the group process 0 started has "
                                 f"{jax.process_count()} processes: give every process the same count")
    elif _cluster_size_from_environment() > 1:
        jax.distributed.initialize()
    _initialized = True


def _checked_environment(num: str, pid: str, coordinator: str) -> tuple[int, int, int]:
    """(process count, this process's index, the coordinator's port) from the SPILLWAY_* variables; a
    ValueError naming the variable that is not one (an IndexError inside jax for a coordinator without
    its port, "invalid literal for int()" naming none)."""
    def whole(name: str, text: str, least: int) -> int:
        if not text.strip().isdigit() or int(text) < least:
            raise ValueError(f"{name}={text!r}: a whole number from {least} is needed")
        return int(text)

    count = whole("SPILLWAY_NUM_PROCESSES", num, 1)
    index = whole("SPILLWAY_PROCESS_ID", pid, 0)
    if index >= count:
        raise ValueError(f"SPILLWAY_PROCESS_ID={index}: the processes of SPILLWAY_NUM_PROCESSES={count} are "
                         f"numbered 0 to {count - 1}")
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"SPILLWAY_COORDINATOR={coordinator!r}: host:port of process 0 is needed "
                         f"(e.g. 10.0.0.1:29500)")
    return count, index, int(port)


def _check_port_free(coordinator: str, port: int) -> None:
    """Process 0 serves the group on `port`: one taken by another program ended it with a segfault."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # a closed run's TIME_WAIT is no owner
        try:
            probe.bind(("", port))
        except OSError as error:
            raise ValueError(f"SPILLWAY_COORDINATOR={coordinator}: port {port} on process 0's host is in use "
                             f"({error.strerror}): pick a free port for every process") from None


# Recipe fields that are each host's own: a token cache on the host's local disk, the host's cores for
# tokenizing. The rows they make are the same wherever they are made.
MAY_DIFFER_PER_PROCESS = frozenset({"data.cache_dir", "data.num_proc"})


def check_same_recipe(recipe: dict) -> None:
    """Every process runs the recipe process 0 runs (`Recipe.to_dict()`; but MAY_DIFFER_PER_PROCESS), else a
    ValueError naming the fields that differ, on every process alike. Another checkpoint.dir trained one step apart and then hung every
    process at the first save; another model would compile collectives that never meet."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils
    mine = np.frombuffer(json.dumps(recipe, sort_keys=True).encode(), np.uint8)
    longest = int(np.max(multihost_utils.process_allgather(np.int32(mine.size))))
    padded = np.zeros(longest, np.uint8)
    padded[:mine.size] = mine
    every = [json.loads(bytes(row).rstrip(b"\0")) for row in multihost_utils.process_allgather(padded)]
    first = _flat(every[0])
    for index, other in enumerate(map(_flat, every)):
        differing = [f"{name}={first.get(name)!r} vs {other.get(name)!r}"
                     for name in sorted(set(first) | set(other))
                     if name not in MAY_DIFFER_PER_PROCESS and first.get(name) != other.get(name)]
        if differing:
            shown = "; ".join(differing[:4]) + (f"; {len(differing) - 4} more" if len(differing) > 4 else "")
            raise ValueError(f"process {index} was given another recipe than process 0 ({shown}; process 0's "
                             f"first): run the same command, with the same --set, on every process")


def _flat(tree: dict, prefix: str = "") -> dict:
    """{"train.steps": 6, ...} from the nested recipe dict."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# What a CPU collective (gloo) says when the process across the connection is gone: killed, crashed, its host
# lost. It says so at once; the step fails on every process still there.
_PEER_GONE = ("by peer", "Broken pipe")


def lost_another_process(error: BaseException) -> str | None:
    """The line for a collective that failed because another process of the run went away, else None.

    The failure is not this process's own, and nothing of it is lost: the run's checkpoints stay as saved."""
    text = " ".join(str(error).split())
    gloo = text.find("Gloo ")
    if gloo < 0 or not any(sign in text for sign in _PEER_GONE):
        return None
    return (f"another process of this run stopped (killed, crashed or its host lost: {text[gloo:]}); "
            f"the saved checkpoints are kept: start every process again to resume")


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
