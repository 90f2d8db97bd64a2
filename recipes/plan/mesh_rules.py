"""The planner's mesh rules: the recipe's mesh for `--devices` GPUs, and the meshes it refuses before compiling.

A mesh whose axes do not divide the batch, a micro-batch or a weight
dimension they shard would make the plan's figures mislead (per-GPU HBM near
the one-GPU figure, compute counted as split): refused with the numbers
(docs/DESIGN.md section 9). With those checks, FLOPs divide by data x fsdp x
tensor (`compute_ways`).
"""

from __future__ import annotations

from spillway.layers.mesh import check_batch_split
from spillway.layers.sharding import undivided_dims
from spillway.recipes.config import Recipe
from spillway.recipes.train.step import abstract_model

GiB = 2**30


def resolve_mesh(recipe: Recipe, devices: int) -> dict[str, int]:
    """The recipe's mesh axes for `devices` GPUs on one host; ValueError when they cannot match.

    The one mesh rule (layers/mesh.py MeshConfig.resolve, which make_mesh uses too), checked here so a
    mismatch fails before any compile; and every micro-batch must split over data x fsdp, since the plan's
    compute figures count on each GPU computing its own rows.
    """
    if devices < 1:
        raise ValueError(f"--devices must be at least 1, got {devices}")
    sizes = recipe.mesh.resolve(devices, unit="GPUs", count_name="--devices",
                                hint=": change --devices or --set mesh.<axis>=...")
    check_batch_split(sizes, recipe.train.global_batch, recipe.train.grad_accum, micro_batches_too=True)
    return sizes


def check_sharding(recipe: Recipe, mesh: dict[str, int]) -> None:
    """ValueError when a mesh axis does not divide a parameter dimension it shards.

    layers/sharding.py replicates such a dimension: every GPU of that axis
    would hold the whole weight (the per-GPU HBM stays near the one-GPU
    figure) and, on the tensor axis, compute all of it, while the plan's
    compute estimate divides the FLOPs by the GPU count. Refused here, before
    any compile, with the dimensions that do not divide.
    """
    undivided = undivided_dims(abstract_model(recipe)[1], mesh)
    if not undivided:
        return
    by_axis: dict[tuple[str, ...], dict[str, int]] = {}
    for dim in undivided:
        by_axis.setdefault(dim.mesh_axes, {})[dim.logical_axis] = dim.size
    problems = "; ".join(
        f"{' x '.join(f'mesh.{a}={mesh[a]}' for a in axes)} does not divide "
        + ", ".join(f"{name} ({size})" for name, size in sorted(dims.items()))
        for axes, dims in sorted(by_axis.items()))
    replicated = sum({dim.path: dim.nbytes for dim in undivided}.values())
    raise ValueError(f"the mesh cannot split this model: {problems}. {len({d.path for d in undivided})} weights "
                     f"({replicated / GiB:.1f} GiB) would be replicated instead of sharded, and their compute not "
                     f"divided; choose --devices / --set mesh.<axis>=... so that each axis divides what it shards")


def compute_ways(mesh: dict[str, int]) -> int:
    """GPUs the step's FLOPs are divided over: data x fsdp split the batch, tensor splits the heads, the
    MLP and the vocabulary. Exact only because resolve_mesh and check_sharding refuse a mesh that would
    replicate a micro-batch or a weight dimension instead."""
    return mesh["data"] * mesh["fsdp"] * mesh["tensor"]
