"""The JAX APIs that differ between the JAX versions we test, and which version needs what.

The tested matrix (README, "Tested JAX versions"): jax 0.10.2 (the floor), 0.11.2
(the GPU machine) and the newest release. Everything that must be spelled
differently across it lives here, so no version check sits anywhere else; the
rest of the code uses one spelling for all of them.

compute_on (run a computation on the host CPU, jax.experimental.compute_on):
    jax 0.10.x   `compute_on(compute_type)` is a context manager; the function
                 transform with explicit output memory spaces is `compute_on2`.
    jax >= 0.11  `compute_on(f, *, compute_type, out_memory_spaces)` is that
                 function transform; `compute_on2` is gone and there is no
                 context manager any more.
    The transform (the same in both, read from jax/_src/compute_on.py) is the
    one spelling that works everywhere, so `on_host` uses it under whichever
    name the installed JAX gives it. Which one is told by the signature, not by
    the version string: a 0.10 patch release or a nightly is judged by what it has.

This module imports nothing of spillway's (the `layers` package may not), so
anything may import it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax


def _compute_on_transform() -> Callable[..., Any]:
    """jax.experimental.compute_on's function transform, whatever it is called in this JAX."""
    # Experimental API: imported on first use, so importing spillway never fails on it.
    from jax.experimental import compute_on as module

    candidate = module.compute_on
    if "out_memory_spaces" in inspect.signature(candidate).parameters:
        return candidate                      # jax >= 0.11
    transform = getattr(module, "compute_on2", None)
    if transform is None:                     # neither spelling: a JAX we do not know
        raise ImportError(
            f"jax {jax.__version__}: jax.experimental.compute_on has neither compute_on(f, *, "
            f"compute_type, out_memory_spaces) (jax >= 0.11) nor compute_on2 (jax 0.10); "
            f"see layers/jax_compat.py")
    return transform                          # jax 0.10.x


def on_host(f: Callable[..., Any], *, out_memory_spaces: Any) -> Callable[..., Any]:
    """`f` run by the host CPU (compute type "device_host"), its outputs placed in `out_memory_spaces`.

    `out_memory_spaces`: a `jax.memory.Space` for every output, or one for all
    (a pytree prefix of the outputs). Inputs should already be in host memory
    (`jax.device_put(x, jax.memory.Space.Host)`): a host computation reads host
    buffers.
    """
    return _compute_on_transform()(f, compute_type="device_host", out_memory_spaces=out_memory_spaces)


def varying_mesh_axes(x: Any) -> frozenset[str]:
    """Inside a shard_map: the mesh axes over which `x` differs between devices (empty outside one).

    A custom VJP inside a shard_map must give each cotangent the same varying axes as its primal:
    a cotangent that varies over more (a replicated weight's gradient from split tokens) is summed
    over the extra axes. jax 0.10.2 to 0.12 record them as `aval.manual_axis_type.varying`;
    `aval.vma` is the older spelling.
    """
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))
