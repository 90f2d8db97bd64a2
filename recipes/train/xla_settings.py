"""The XLA settings of the train step on a GPU: one definition, read by training and by the planner.

`step._assemble` jits the train step (and the deferred update's flush) with
`compiler_options=step_compiler_options(platform)`. The planner compiles that
same jitted step, and JAX merges a `.compile(compiler_options=...)` into the
jit's own, so the planner's deviceless figures are for these settings plus its
code-generation shortcuts (recipes/plan/planner.compiler_options), which leave
buffer assignment alone.

Chosen as JAX's GPU performance guide and the GPU training stacks (MaxText,
Paxml/Praxis) choose them; each exists in jaxlib 0.10.2's GPU compiler (its
plugin names it; an unknown name fails the compile). What each does to the
compiled step, measured deviceless (benchmarks/xla_settings_effect.py, figures
in docs/DESIGN.md section 5):

* xla_gpu_enable_latency_hiding_scheduler: schedules async copies and
  collectives against an estimate of compute time (JAX's GPU performance
  guide: the first flag it lists); what it does for collectives matters on
  several GPUs.
* xla_gpu_enable_highest_priority_async_stream: async copies and collectives
  on a high-priority stream, so compute kernels do not starve them (the same
  guide).

Measured on a one-H200 step with host state and offloaded activations
(jax 0.10.2): both, and xla_gpu_enable_host_memory_offloading, leave HBM,
host temp, host traffic and the bytes moved with both link directions busy
exactly as with all four off. xla_gpu_enable_while_loop_double_buffering
unrolls every loop by two (twice the fusions, 4 MiB more HBM) with the same
traffic and overlap; it is not set.
"""

from __future__ import annotations

GPU_PLATFORMS = ("gpu", "cuda")

STEP_OPTIONS: dict[str, bool] = {
    # xla_gpu_enable_latency_hiding_scheduler is not set: with it, jaxlib 0.10.2's GPU compiler fails the
    # step with block weights in host memory on a 1x2x2 (fsdp x tensor) mesh ("IndexError:
    # absl::container_internal::raw_hash_map<>::at", tests/recipes/plan/test_host_params_aot.py
    # test_sharded_weights_stream_one_gpu_share; it passes without it). On one GPU it changed nothing
    # deviceless (above).
    "xla_gpu_enable_highest_priority_async_stream": True,
}


def step_compiler_options(platform: str) -> dict[str, bool] | None:
    """The train step's XLA options for `platform` (the runtime's, or a deviceless target's); None off a GPU
    (these are GPU compiler options)."""
    return dict(STEP_OPTIONS) if platform in GPU_PLATFORMS else None
