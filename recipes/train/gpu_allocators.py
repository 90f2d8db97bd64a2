"""JAX's GPU memory allocators, set for a training run before the GPU backend starts.

Two defaults of JAX's GPU client break plans that `spillway plan` says fit
(both measured on one H200 with jax 0.11.2; BENCHMARKS.md, "On a GPU"):

* XLA_PYTHON_CLIENT_MEM_FRACTION: the client reserves 75% of HBM. The
  planner's capacity line is its headroom (0.9) x HBM, so a plan between the
  two fits on paper and runs out of memory: Llama 3.1 8B, recompute_all, state
  on device, 122.86 GiB predicted, stopped with "Out of memory while trying to
  allocate 240.00MiB" on the 143.8 GB GPU.
* XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB: pinned host memory is capped at 64 GB.
  Llama 3.1 8B with its optimizer state on the host needs 89.74 GiB of it and
  stopped with "Out of host memory ... larger host memory than the default
  64 GB".

`configure()` sets each to match what the planner assumes, unless the user
set it: the pinned-host limit from the run's pinned peak over its phases
(recipes/train/host_memory.pinned_need_of_recipe, with a margin) when the
train loop passes it, else 90% of the RAM; a limit the user set below that
need is refused before anything is allocated (`check_pinned_limit`). Both are read once, when JAX starts its GPU backend, so it must run
before anything touches a device; on CPU they are ignored. The pinned bytes a
run needs are checked against the host's RAM separately, before anything is
allocated (recipes/optim/host_memory.py check_host_memory).
"""

from __future__ import annotations

import math
import os

from spillway.recipes.optim.host_memory import host_ram_bytes
from spillway.recipes.targets import HBM_HEADROOM

HBM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
HOST_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
# The planner's default headroom: a plan it says fits must fit what the client reserves.
HBM_FRACTION = HBM_HEADROOM
# Of the host's RAM, what pinned buffers may take: the rest stays for the
# process itself (the data loader, checkpoint writes) and the OS.
HOST_RAM_FRACTION = 0.9


# Above the plan's pinned need (recipes/train/host_memory.py): what XLA pins besides the counted buffers.
PINNED_MARGIN = 1.1
PINNED_SLACK_BYTES = 2 * 10**9


def configure(environ=os.environ, ram_bytes: int | None = None, pinned_need_bytes: int | None = None
              ) -> dict[str, str]:
    """Set the allocator variables the user has not set; returns the ones set here (to report).

    The pinned-host limit: from the plan's pinned need when given (host_memory.pinned_need_of_recipe:
    the peak over the run's phases, plus a margin), else 90% of the host's RAM.
    """
    chosen: dict[str, str] = {}
    if HBM_FRACTION_ENV not in environ:
        chosen[HBM_FRACTION_ENV] = str(HBM_FRACTION)
    ram = host_ram_bytes() if ram_bytes is None else ram_bytes
    if HOST_LIMIT_ENV not in environ:
        if pinned_need_bytes is not None:
            chosen[HOST_LIMIT_ENV] = str(math.ceil(round((PINNED_MARGIN * pinned_need_bytes + PINNED_SLACK_BYTES) / 1e9, 6)))
        elif ram:
            chosen[HOST_LIMIT_ENV] = str(max(1, int(HOST_RAM_FRACTION * ram / 1e9)))
    environ.update(chosen)
    return chosen


def check_pinned_limit(pinned_need_bytes: int, environ=os.environ) -> None:
    """HostMemoryError (one line) when XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB is below the run's pinned need."""
    from spillway.layers.errors import ConfigError
    from spillway.recipes.optim.host_memory import HostMemoryError

    value = environ.get(HOST_LIMIT_ENV)
    if value is None:
        return
    try:
        limit_gb = float(value)
    except ValueError:
        raise ConfigError(f"{HOST_LIMIT_ENV}={value!r} is not a number of GB") from None
    if limit_gb * 1e9 < pinned_need_bytes:
        raise HostMemoryError(
            f"{HOST_LIMIT_ENV}={value} caps pinned host memory at {limit_gb:g} GB, but this run pins "
            f"{pinned_need_bytes / 1e9:.1f} GB at its peak (recipes/train/host_memory.py): raise it to at least "
            f"{math.ceil(pinned_need_bytes / 1e9)} or unset it (training then sets it from the plan)")
