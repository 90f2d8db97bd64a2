"""The XLA flags every process of the test suite compiles under (the suite's own, tests/conftest.py, and those
the tests start, tests/child_env.py): code generation made cheap for the tests' tiny CPU programs.

Compiling is most of the suite's time, and of a compile most is XLA's CPU code generation, not the HLO
passes that decide what a program computes, where its arrays live and what the planner reads; those run as
before under every flag here. Measured side by side (README, "Tests and benchmarks"):

- `--xla_backend_optimization_level=0`: LLVM's optimisation of the generated code costs more than it saves
  on programs this small (about 40% of the XLA compile time, every jaxlib).
- jaxlib 0.10 only, `--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1`: the
  fusion emitters (MLIR code generation of each fusion) and the module's split into parallel LLVM jobs cost
  far more than they save here; off, tests/recipes/optim/test_optimizer.py and
  tests/layers/test_offload_policy.py compiled in 9-11 s instead of 34 s (the whole default suite: README).
  jaxlib 0.11 and 0.12 no longer know the first flag (XLA aborts the process on an unknown flag), and the
  second alone, or the thunk runtime off, gained nothing there; so those versions get level 0 alone.
- With those, `--xla_cpu_max_isa=AVX` (no FMA instructions): the older emitters contract a multiply feeding
  an add into a fused multiply-add even at level 0, and which pairs they contract follows the fusions, which
  differ between programs that compute the same update (the flush before a checkpoint and the next step's
  forward pass were a few ulps apart in the embedding's update). The tests' claims of bit-identity between
  such programs are about what each HLO op computes, IEEE-rounded, as the fusion emitters at level 0 give it
  (docs/DESIGN.md section 6 says why a GPU, which contracts, is not promised it); without FMA instructions
  the older emitters give it too.

The version is read from the installed package's metadata, not by importing jax: XLA reads XLA_FLAGS once,
when its backend starts, so the flags must be set before anything imports jax.
"""

from __future__ import annotations

from importlib import metadata

OPTIMIZATION_LEVEL_0 = "--xla_backend_optimization_level=0"
JAXLIB_010_CODEGEN = ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1",
                      "--xla_cpu_max_isa=AVX")


def _jaxlib_minor() -> tuple[int, int] | None:
    try:
        major, minor = metadata.version("jaxlib").split(".")[:2]
        return int(major), int(minor)
    except (metadata.PackageNotFoundError, ValueError):
        return None


def fast_compile_flags() -> list[str]:
    """The flags for the installed jaxlib, in XLA_FLAGS spelling."""
    flags = [OPTIMIZATION_LEVEL_0]
    if _jaxlib_minor() == (0, 10):
        flags += JAXLIB_010_CODEGEN
    return flags


def with_fast_compile_flags(xla_flags: str) -> str:
    """`xla_flags` with each of the fast-compile flags it does not already set (by name) appended."""
    for flag in fast_compile_flags():
        if flag.split("=")[0] not in xla_flags:
            xla_flags = f"{xla_flags} {flag}".strip()
    return xla_flags
