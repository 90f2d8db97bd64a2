"""Multi-process start-up: `jax.distributed.initialize()` when the environment describes several processes.

The same `spillway train` command runs on one host or many. Several processes
are recognised from SPILLWAY_NUM_PROCESSES / SPILLWAY_PROCESS_ID /
SPILLWAY_COORDINATOR (explicit, e.g. for tests with several processes on one
CPU machine) or from a cluster JAX detects by itself (SLURM, Open MPI, ...),
which `jax.distributed.initialize()` reads with no arguments.
"""

from __future__ import annotations

import os

import jax

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
