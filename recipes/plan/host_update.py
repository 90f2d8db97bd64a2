"""The host CPU's optimizer-update rate, for the planner's host-update plans.

A host-update plan (OptimizerConfig.update_on_host: state in pinned host
memory, AdamW computed by the host CPU) spends host CPU time on every
parameter each step. The planner prices it as

    parameters / (rate per core x host cores per GPU)

The rate comes, first found first: from `--host-update-rate` (parameters per
second per core); from the JSON file benchmarks/host_update_rate.py writes
(DEFAULT_RATE_FILE, or the file SPILLWAY_HOST_UPDATE_RATE_FILE names); else
DEFAULT_PARAMS_PER_S_PER_CORE, measured with that benchmark on the CPU
machine this project is developed on (2026-11-30, BENCHMARKS.md): one
machine's figure, so measure the training host before trusting the plan.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

RATE_FILE_ENV = "SPILLWAY_HOST_UPDATE_RATE_FILE"
DEFAULT_RATE_FILE = Path(os.path.expanduser("~")) / ".cache" / "spillway" / "host_update_rate.json"
# benchmarks/host_update_rate.py on the development machine: 87.8 M params per CPU-second
# (bf16 params + fp32 master, 33.6 M params, jax 0.10.2 CPU backend, 2026-11-30).
DEFAULT_PARAMS_PER_S_PER_CORE = 88e6
# Host CPU cores the update may use per GPU: a DGX H100 has 2 x 56 cores for 8 GPUs (14),
# cloud L4 / L40S machines 12 to 24; 8 leaves the rest for data loading and the runtime.
DEFAULT_HOST_CORES_PER_GPU = 8


def rate_file() -> Path:
    return Path(os.environ.get(RATE_FILE_ENV) or DEFAULT_RATE_FILE)


def host_update_rate(override: float | None = None) -> tuple[float, str]:
    """(parameters per second per core, where the figure came from)."""
    if override is not None:
        if not 0 < override < math.inf:
            raise ValueError(f"--host-update-rate must be a positive finite number (parameters/s per core), got "
                             f"{override}")
        return float(override), "--host-update-rate"
    path = rate_file()
    if path.exists():
        try:
            rate = float(json.loads(path.read_text())["params_per_s_per_core"])
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path}: not a host update rate written by benchmarks/host_update_rate.py "
                             f"({type(error).__name__}: {error}); rerun the benchmark or delete the file") from None
        if not 0 < rate < math.inf:
            raise ValueError(f"{path}: params_per_s_per_core must be a positive finite number, got {rate}")
        return rate, str(path)
    return DEFAULT_PARAMS_PER_S_PER_CORE, "default (benchmarks/host_update_rate.py not run on this machine)"
