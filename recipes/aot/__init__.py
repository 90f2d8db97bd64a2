"""Deviceless (ahead-of-time) compiles for GPU targets on machines without a GPU.

The planner compiles the real train step for a target GPU and reads its HBM and
host-memory use from XLA (DESIGN.md section 5). Pieces:

* ``plugin``: where the jax-cuda13 compiler plugin lives, whether it matches
  jaxlib, how to install it; whether ptxas/libdevice are there.
* ``targets``: GPU targets as data (``get_target("h200")``).
* ``subprocess_runner``: ``run_in_compile_process(module, args)`` runs a compile
  program in a child process set up for the plugin and returns its JSON.
* ``compile`` (imports JAX; use it inside the compile process): compile-only
  meshes, abstract arguments in device or host memory, ``compile_report``.
* ``hlo``: host<->device traffic read from compiled HLO text.
* ``selfcheck``: a compile program that shows the whole chain works here.

This package's ``__init__`` imports neither JAX nor the plugin.
"""

import importlib
from typing import Any

# Public names, resolved on first use: importing them eagerly would make
# `python -m recipes.aot.plugin` load its own module twice (runpy warns).
_PUBLIC_NAMES = {
    "find_ptxas": "recipes.aot.plugin",
    "install_command": "recipes.aot.plugin",
    "installed_version": "recipes.aot.plugin",
    "missing_reason": "recipes.aot.plugin",
    "CompileProcessError": "recipes.aot.subprocess_runner",
    "CompileToolchainMissing": "recipes.aot.subprocess_runner",
    "run_in_compile_process": "recipes.aot.subprocess_runner",
    "serve_compile_process": "recipes.aot.subprocess_runner",
    "TARGETS": "recipes.aot.targets",
    "UNSUPPORTED_TARGETS": "recipes.aot.targets",
    "GpuTarget": "recipes.aot.targets",
    "get_target": "recipes.aot.targets",
    "target_names": "recipes.aot.targets",
}
__all__ = sorted(_PUBLIC_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC_NAMES:
        raise AttributeError(f"module 'recipes.aot' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC_NAMES[name]), name)
