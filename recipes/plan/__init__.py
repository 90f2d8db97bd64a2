"""`spillway plan`: what a recipe costs on a GPU, from deviceless (ahead-of-time) compiles.

The planner compiles the real train step for a target GPU and reads its HBM and
host-memory use from XLA (docs/DESIGN.md section 5). Pieces:

* ``planner``: ``plan()``, which drives the rest; ``commands``: the entry points
  (``spillway plan``, ``spillway train --plan auto``, the benchmarks' ``predict_cases``).
* ``candidates``: the plans tried, each an ``OffloadConfig`` (and ``update_on_host``).
* ``mesh_rules``: the recipe's mesh for ``--devices``; the meshes refused before compiling.
* ``workers`` and ``child``: the compile processes; ``toolchain``: XLA options and the
  ptxas stand-in that make a plan's compile fast.
* ``cost_model``: a compiled candidate's step time and parameter traffic; ``pruning``:
  the compile order and the candidates not compiled; ``result``: rows, verdicts, the pick.
* ``render`` (the table) and ``chart`` (``--png``).
* ``host_update``: the host CPU's optimizer-update rate for host-compute plans
  (measured by benchmarks/host_update_rate.py, or a default).
* ``plugin``: where the jax-cuda13 compiler plugin lives, whether it matches
  jaxlib, how to install it; whether ptxas/libdevice are there.
* ``subprocess_runner``: ``run_in_compile_process(module, args)`` runs a compile
  program in a child process set up for the plugin and returns its JSON.
* ``compile`` (imports JAX; use it inside the compile process): compile-only
  meshes, abstract arguments in device or host memory, ``compile_report``.
* ``hlo``: host<->device traffic read from compiled HLO text, and which async
  copies of the two link directions are in flight together.
* ``selfcheck``: a compile program that shows the whole chain works here.

FLOPs are counted in models/flops.py and the GPU targets are recipes/targets.py
(both read by the train loop too).

This package's ``__init__`` imports neither JAX nor the plugin.
"""

import importlib
from typing import Any

# Public names, resolved on first use: importing them eagerly would make
# `python -m spillway.recipes.plan.plugin` load its own module twice (runpy warns).
_PUBLIC_NAMES = {
    "find_ptxas": "spillway.recipes.plan.plugin",
    "install_command": "spillway.recipes.plan.plugin",
    "installed_version": "spillway.recipes.plan.plugin",
    "missing_reason": "spillway.recipes.plan.plugin",
    "CompileProcessError": "spillway.recipes.plan.subprocess_runner",
    "CompileToolchainMissing": "spillway.recipes.plan.subprocess_runner",
    "run_in_compile_process": "spillway.recipes.plan.subprocess_runner",
    "serve_compile_process": "spillway.recipes.plan.subprocess_runner",
}
__all__ = sorted(_PUBLIC_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC_NAMES:
        raise AttributeError(f"module 'spillway.recipes.plan' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC_NAMES[name]), name)
