"""How a TPU runtime holds host memory: what the process's resident size and the machine's available memory
do when a pinned_host array is made, written a row at a time, and rewritten whole (donated, on the device and
on the host CPU).

Run on the TPU machine, jax only (BENCHMARKS.md, "On a TPU", the host peaks). Each line is the process's
VmRSS and the machine's MemAvailable after one operation on a 4 GiB float32 array in pinned host memory:

    python -m benchmarks.tpu_host_buffers
"""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.compute_on import compute_on

GiB = 2**30


def _kib(text: str, key: str) -> int:
    return int(re.search(key + r":\s+(\d+)", text).group(1)) * 1024


def memory_now() -> str:
    """The process's resident size and the machine's available memory, in GiB."""
    with open("/proc/self/status") as status, open("/proc/meminfo") as meminfo:
        rss, available = _kib(status.read(), "VmRSS"), _kib(meminfo.read(), "MemAvailable")
    return f"VmRSS {rss / GiB:.2f} GiB, MemAvailable {available / GiB:.2f} GiB"


def report(what: str) -> None:
    time.sleep(1)   # let freed buffers go back before reading
    print(f"{what}: {memory_now()}", flush=True)


def main() -> None:
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    report("after the runtime started")
    array = jax.jit(lambda: jnp.zeros((1024, 1024, 1024), jnp.float32), out_shardings=host)().block_until_ready()
    report("4 GiB of zeros in pinned host memory")
    row = jnp.ones((1, 1024, 1024), jnp.float32)
    write_row = jax.jit(lambda x, r: lax.dynamic_update_slice_in_dim(x, r, 3, 0), out_shardings=host,
                        donate_argnums=0)
    for attempt in ("", " again"):
        array = write_row(array, row).block_until_ready()
        report(f"a row written into it, donated{attempt}")

    def add_one_on_host(x):
        with compute_on("device_host"):
            return x + 1
    for name, add_one in (("on the host CPU", add_one_on_host), ("on the device", lambda x: x + 1)):
        rewrite = jax.jit(add_one, out_shardings=host, donate_argnums=0)
        for attempt in ("", " again"):
            array = rewrite(array).block_until_ready()
            report(f"all of it rewritten {name}, donated{attempt}")


if __name__ == "__main__":
    main()
