#!/usr/bin/env python
"""What JAX's persistent compilation cache saves the test suite: the micro recipe trained three times in one process.

Each `train()` builds its jitted step afresh, so JAX's in-memory cache cannot
serve the second run, and the suite trains the micro recipe
(tests/micro_recipe.py) dozens of times. With the persistent cache (a new,
empty folder; every program compiled in over `--min-compile-s` is written) the
second and later runs read their programs back. The first run's time includes
preparing the data (about 2 s) and the imports. Run it once with and once
without the cache, in separate processes, and compare the second and third
runs:

    .venv/bin/python -m benchmarks.compile_cache_effect           # no cache
    .venv/bin/python -m benchmarks.compile_cache_effect --cache   # the cache tests/conftest.py sets up

8 fake CPU devices, as in the tests.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--cache", action="store_true", help="use a new persistent compilation cache")
    parser.add_argument("--min-compile-s", type=float, default=0.2, help="cache programs compiled in over this")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    work = Path(tempfile.mkdtemp(prefix="compile-cache-effect-"))
    import jax

    if args.cache:
        jax.config.update("jax_compilation_cache_dir", str(work / "jax-cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", args.min_compile_s)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from micro_recipe import micro
    from spillway.recipes.train.loop import train

    for run in range(args.runs):
        started = time.perf_counter()
        train(micro(work / "data", work / f"run{run}", f"train.steps={args.steps}"), progress=False)
        print(f"{'cache' if args.cache else 'no cache'}: run {run + 1} took {time.perf_counter() - started:.1f} s",
              flush=True)


if __name__ == "__main__":
    main()
