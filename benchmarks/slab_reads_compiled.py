"""The save's device reads of host memory (recipes/train/piece_take.py), compiled for a GPU without one: each
slab program, for the leaf shapes a TPU refused to merge and a plain stacked one, in both ways ("rows": the
leading axes merged; "layer": none merged), compiled deviceless for the target, its host argument read in place
(S(5) in the entry layout) with one dynamic-slice.

    python benchmarks/slab_reads_compiled.py [--target h200] [--json]

--json prints the rows as one JSON document (a compile process: tests/recipes/plan/test_slab_reads_aot.py).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from spillway.recipes.plan.subprocess_runner import served_or_measured  # noqa: E402
from spillway.recipes.targets import DEFAULT_GPU  # noqa: E402

# (shape, dtype, the chunk a save takes): a stacked MLP weight's state, the four leaf shapes whose merged rows a
# TPU v5e refused (BENCHMARKS.md, "A save in pieces read through the device"), bfloat16 moments
CASES = (((4, 2048, 8192), "float32", ((1, 2), (0, 2048), (0, 4096))),
         ((2, 2048), "float32", ((1, 2), (0, 1024))),
         ((2, 2048, 8, 64), "float32", ((1, 2), (0, 1024), (0, 8), (0, 64))),
         ((2, 32, 64, 2048), "float32", ((0, 1), (0, 32), (0, 64), (0, 1024))),
         ((4, 2048, 8192), "bfloat16", ((2, 3), (0, 512), (0, 8192))))


def measure(args) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from spillway.recipes.plan import compile as aot
    from spillway.recipes.plan import hlo
    from spillway.recipes.train import piece_take

    mesh = aot.compile_only_mesh(args.target, {"data": 1})
    device = NamedSharding(mesh, PartitionSpec(), memory_kind="device")
    rows = []
    for shape, dtype, chunk in CASES:
        index = tuple(slice(start, stop) for start, stop in chunk)
        for way in piece_take.SLAB_WAYS:
            axis, _, count = piece_take.slab_of(shape, index, way)
            read = piece_take._slab_reader(shape, jnp.dtype(dtype), axis, count, device)
            host = aot.abstract_array(shape, jnp.dtype(dtype), mesh, memory_kind="pinned_host")
            row = {"shape": list(shape), "dtype": dtype, "way": way}
            try:
                text = read.lower(host, jax.ShapeDtypeStruct((), jnp.int32)).compile().as_text()
            except Exception as error:   # noqa: BLE001 (a refused compile is the finding)
                rows.append({**row, "error": str(error).splitlines()[0][:300]})
                continue
            entry = next(line for line in text.splitlines() if "entry_computation_layout" in line)
            argument = entry.split("entry_computation_layout={(", 1)[1].split(", s32[]", 1)[0]
            rows.append({**row, "host_argument": argument.endswith(hlo.HOST_MEMORY_SPACE + "}"),
                         "dynamic_slices": text.count("dynamic-slice(")})
    return {"target": args.target, "jax": jax.__version__, "rows": rows}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=DEFAULT_GPU)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (a compile process)")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    result = served_or_measured(args, parse_args, measure)
    print(f"the save's slab reads, compiled for {result['target']} without one (jax {result['jax']})")
    for row in result["rows"]:
        what = row.get("error") or (f"compiled; host argument in place: {row['host_argument']}; "
                                    f"{row['dynamic_slices']} dynamic-slice")
        print(f"{str(tuple(row['shape'])):20s} {row['dtype']:9s} {row['way']:6s} {what}")


if __name__ == "__main__":
    main()
