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

* xla_gpu_enable_highest_priority_async_stream: async copies and collectives
  on a high-priority stream, so compute kernels do not starve them (the same
  guide).
* xla_gpu_experimental_parallel_async_compute_limit: how many async
  "compute" operations the latency hiding scheduler lets be in flight at
  once. XLA counts the host-memory slicing copies of the streamed optimizer
  state (dynamic-slice / dynamic-update-slice fusions on S(5) buffers) as
  such, and its default, 2, is why a layer's state copies ran one after
  another with the layer's matmuls after the last of them. Raised, the
  copies go beside the matmuls (deviceless H200, Llama 3.2 1B at 8,192
  tokens, the update in the next forward pass: 13.37 of 24.24 GiB of the
  forward pass's copies beside a matmul, against 0.00 at 2; the same at 64
  and 256; docs/DESIGN.md section 6).

The latency hiding scheduler itself runs in every GPU compile of jaxlib
0.10.2, whatever xla_gpu_enable_latency_hiding_scheduler says (its pass
runs and reorders the same with the flag true, false or unset:
xla_dump_hlo_pass_re=.* shows the latency-hiding-scheduler pass, and its
output, identical in the three, for the stand-in of benchmarks/update_in_forward.py). The flag is not set here: with it,
jaxlib 0.10.2 failed the step with host weights on a 1x2x2 mesh (below).

Measured on a one-H200 step with host state and offloaded activations
(jax 0.10.2): xla_gpu_enable_latency_hiding_scheduler,
xla_gpu_enable_highest_priority_async_stream and
xla_gpu_enable_host_memory_offloading leave HBM, host temp, host traffic and
the bytes moved with both link directions busy exactly as with all of them
off. xla_gpu_enable_while_loop_double_buffering unrolls every loop by two
(twice the fusions, 4 MiB more HBM) with the same traffic and overlap; it is
not set.
"""

from __future__ import annotations

GPU_PLATFORMS = ("gpu", "cuda")

STEP_OPTIONS: dict[str, bool | int] = {
    # xla_gpu_enable_latency_hiding_scheduler is not set: with it, jaxlib 0.10.2's GPU compiler fails the
    # step with block weights in host memory on a 1x2x2 (fsdp x tensor) mesh ("IndexError:
    # absl::container_internal::raw_hash_map<>::at", tests/recipes/plan/test_host_params_aot.py
    # test_sharded_weights_stream_one_gpu_share; it passes without it). On one GPU it changed nothing
    # deviceless (above).
    "xla_gpu_enable_highest_priority_async_stream": True,
    # A layer's streamed state is up to ~9 leaves x (3 state rows in + the gradient in + 3 rows out);
    # 64 and 256 gave the same schedule for Llama 3.2 1B.
    "xla_gpu_experimental_parallel_async_compute_limit": 128,
}


def step_compiler_options(platform: str) -> dict[str, bool | int] | None:
    """The train step's XLA options for `platform` (the runtime's, or a deviceless target's); None off a GPU
    (these are GPU compiler options)."""
    return dict(STEP_OPTIONS) if platform in GPU_PLATFORMS else None


# XLA's command buffers (CUDA graphs) and the host copies (docs/DESIGN.md section 6): in XLA's default graph
# scheduling a copy captured in a graph is chained after the command before it, so the streamed state's
# copies in the update's loops run beside nothing. The alternatives the GPU session measures against the
# step's settings above (not the step's yet: none has run on a GPU); each is a set of compile options:
COMMAND_BUFFER_ALTERNATIVES: dict[str, dict[str, str]] = {
    # graphs kept, their edges the data dependencies alone
    "command buffers concurrent": {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"},
    # graphs kept for everything but the dynamic-slice memcpys (XLA's default list less DYNAMIC_SLICE_FUSION):
    # the streamed rows' memcpys then run on their own streams, as the activation offload's do
    "memcpys outside command buffers": {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"},
    # no graphs at all
    "command buffers off": {"xla_gpu_enable_command_buffer": ""},
}


def as_xla_flags(options: dict[str, str]) -> tuple[str, ...]:
    """Compile options as XLA_FLAGS words (for a process whose every compile should take them)."""
    return tuple(f"--{name}={value}" for name, value in options.items())

