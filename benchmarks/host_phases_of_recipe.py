"""One GPU's host memory per phase of a recipe, from shapes alone (recipes/train/host_memory.phases_of_recipe,
the process's assumed 6 GiB added): the save in pieces beside orbax's whole save. No compile, no device.

    python -m benchmarks.host_phases_of_recipe llama3_8b_offload [A.B=VALUE ...]
"""

from __future__ import annotations

import dataclasses
import sys


def main(argv: list[str]) -> int:
    from spillway.recipes.registry import get_recipe
    from spillway.recipes.train.host_memory import ASSUMED_GPU_FOOTPRINT_BYTES, GiB, phases_of_recipe

    phases = dataclasses.replace(phases_of_recipe(get_recipe(argv[0], argv[1:])),
                                 footprint=ASSUMED_GPU_FOOTPRINT_BYTES)
    for in_pieces in (True, False):
        by_phase = dataclasses.replace(phases, save_in_pieces=in_pieces).by_phase()
        print(f"{'save in pieces' if in_pieces else 'whole save    '}  "
              + "  ".join(f"{phase} {n / GiB:.1f}" for phase, n in by_phase.items()) + "  (GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
