"""The planner's compile toolchain: whether it is there, and the XLA options that make a plan's compile fast.

The plan only needs XLA's buffer assignment and the optimised HLO, both
settled before machine code is generated. So by default the compile process
runs LLVM without optimisations and hands PTX to a stand-in for ptxas that
writes no machine code (about half of every compile saved, docs/DESIGN.md
section 5). Set SPILLWAY_PLAN_FULL_CODEGEN=1 to compile exactly as for a run;
the memory figures are the same (a slow test checks it).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from spillway.recipes.plan import plugin

FULL_CODEGEN_ENV = "SPILLWAY_PLAN_FULL_CODEGEN"


def check_toolchain() -> None:
    reason = plugin.missing_reason()
    if reason is not None:
        raise ValueError("planning compiles the train step for the GPU without one, which needs the GPU "
                         f"compiler plugin and the CUDA toolkit's ptxas: {reason}")


def compiler_options() -> dict | None:
    """XLA options for the planner's compiles: fast code generation, unless SPILLWAY_PLAN_FULL_CODEGEN=1.

    Memory figures come from buffer assignment and the optimised HLO, which
    precede code generation; these options only make LLVM skip optimisations
    and replace ptxas by a stand-in that writes no machine code, and keep the
    autotuner off (it has no GPU to time kernels on anyway).

    xla_gpu_autotune_level=0: jaxlib 0.12's autotuner pass (renamed
    config-assigner) works through candidate kernel configs even deviceless,
    where it cannot time them: 40 of the 56 s of HLO passes of one Llama 3.1
    8B candidate (0.10.2's autotuner: 0.3 s of 8.5 s). At level 0 it does not
    autotune: 6.5 s there, the same memory figures (BENCHMARKS.md).
    """
    if os.environ.get(FULL_CODEGEN_ENV, "") not in ("", "0"):
        return None
    options = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
               "xla_gpu_disable_gpuasm_optimizations": True, "xla_gpu_autotune_level": 0}
    stand_in = ptxas_stand_in(plugin.find_ptxas(), plugin.find_cuda_root())
    if stand_in is not None:
        options["xla_gpu_cuda_data_dir"] = str(stand_in)
    return options


def ptxas_stand_in(real_ptxas: Path | None, cuda_root: Path | None) -> Path | None:
    """A CUDA folder whose bin/ptxas answers version queries with the real one and writes no code.

    XLA looks for ptxas and libdevice under --xla_gpu_cuda_data_dir first. The
    folder links the real toolkit's nvvm/ (libdevice) and holds a script that
    passes `--version` through (XLA picks PTX features by it) and otherwise
    writes a placeholder to the `-o` file: a deviceless compile never loads it.
    """
    if real_ptxas is None or cuda_root is None:
        return None
    folder = Path(tempfile.gettempdir()) / f"spillway-ptxas-stand-in-{os.getuid()}"
    script = folder / "bin" / "ptxas"
    text = f"""#!/bin/sh
# spillway plan: placeholder ptxas (see recipes/plan/toolchain.py). Version queries go to the real one.
for arg in "$@"; do
  case "$arg" in --version|-V|--help) exec "{real_ptxas}" "$@";; esac
done
out=""; previous=""
for arg in "$@"; do
  [ "$previous" = "-o" ] && out="$arg"
  case "$arg" in --output-file=*) out="${{arg#--output-file=}}";; esac
  previous="$arg"
done
[ -n "$out" ] && printf 'spillway-plan: no machine code' > "$out"
exit 0
"""
    try:
        (folder / "bin").mkdir(parents=True, exist_ok=True)
        if not script.exists() or script.read_text() != text:
            temporary = script.with_suffix(f".{os.getpid()}")
            temporary.write_text(text)
            temporary.chmod(0o755)
            temporary.replace(script)
        nvvm = folder / "nvvm"
        if not nvvm.exists():
            try:
                nvvm.symlink_to(cuda_root / "nvvm")
            except FileExistsError:
                pass
    except OSError:
        return None   # fall back to the real toolchain
    return folder
