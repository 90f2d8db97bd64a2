"""The mesh rule: the ("data", "fsdp", "tensor") axis sizes, resolved against a device count, and what they divide.

One definition for everything that needs it: a recipe's `mesh` section is a
`MeshConfig` (checked when it is built), `layers/sharding.make_mesh` builds a
JAX mesh from one, training checks its batch against it
(recipes/train/step.py) and the planner resolves it for `--devices` before
any compile (recipes/plan/mesh_rules.py).

* One axis may be -1: it takes the devices the others leave (`resolve`).
* The batch is split over data x fsdp (`batch_ways`): the global batch must
  divide over them, and, where the caller counts on every device computing
  its own rows (the planner's compute figures), each micro-batch too;
  training replicates a micro-batch the axes do not divide.
"""

from __future__ import annotations

import dataclasses
import math

from spillway.layers.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    fsdp: int = -1                        # -1: all remaining devices
    tensor: int = 1

    def __post_init__(self):
        sizes = self.sizes()
        for name, size in sizes.items():
            if isinstance(size, bool) or not isinstance(size, int) or not (size >= 1 or size == -1):
                raise ConfigError(f"mesh.{name} must be a positive number of devices or -1 (the rest), got {size!r}")
        if list(sizes.values()).count(-1) > 1:
            raise ConfigError("at most one mesh axis may be -1, got "
                              + " ".join(f"mesh.{k}={v}" for k, v in sizes.items()))

    def sizes(self) -> dict[str, int]:
        """{axis: size} as set, -1 included."""
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    def resolve(self, device_count: int, *, unit: str = "devices", count_name: str = "the device count",
                hint: str = "") -> dict[str, int]:
        """{axis: size} for `device_count` devices, the -1 axis filled; ValueError when they cannot match.

        The message names the devices `unit` ("GPUs") and their count `count_name` ("--devices"); `hint`
        (what to change) is appended to it.
        """
        sizes = self.sizes()
        described = " x ".join(f"{k}={v}" for k, v in sizes.items())
        known = math.prod(v for v in sizes.values() if v != -1)
        for axis, size in sizes.items():
            if size == -1:
                if device_count % known:
                    raise ValueError(f"mesh {described} does not fit {device_count} {unit}: "
                                     f"{device_count} is not a multiple of {known}{hint}")
                sizes[axis] = device_count // known
        if math.prod(sizes.values()) != device_count:
            raise ValueError(f"mesh {described} needs {math.prod(sizes.values())} {unit}, "
                             f"but {count_name} is {device_count}{hint}")
        return sizes


def batch_ways(sizes: dict[str, int]) -> int:
    """How many ways a batch is split: over data x fsdp (layers/sharding.py DEFAULT_RULES)."""
    return sizes["data"] * sizes["fsdp"]


def replicated_micro_batch(sizes: dict[str, int], global_batch: int, grad_accum: int) -> str | None:
    """The warning for a micro-batch the batch axes do not divide (which a run allows: it is replicated over
    them, every device computing the same rows); None when they divide it."""
    ways, micro_batch = batch_ways(sizes), global_batch // grad_accum
    if math.prod(sizes.values()) == 1 or micro_batch % ways == 0:
        return None
    return (f"warning: a micro-batch of {micro_batch} sequences (train.global_batch {global_batch} / "
            f"train.grad_accum {grad_accum}) is not split over the data x fsdp mesh size ({ways}): it is replicated, "
            f"every device computing the same rows; raise train.global_batch or lower train.grad_accum to split it")


def check_batch_split(sizes: dict[str, int], global_batch: int, grad_accum: int, *,
                      micro_batches_too: bool) -> None:
    """ValueError when the global batch (and, with `micro_batches_too`, each micro-batch) does not divide
    over data x fsdp. A single device takes any batch."""
    if math.prod(sizes.values()) == 1:
        return
    ways = batch_ways(sizes)
    if global_batch % ways:
        raise ValueError(f"train.global_batch ({global_batch}) must be divisible by the data x fsdp mesh size "
                         f"({ways}) on {math.prod(sizes.values())} devices: --set train.global_batch=...")
    micro_batch = global_batch // grad_accum
    if micro_batches_too and micro_batch % ways:
        # A micro-batch the batch axes do not divide is replicated over them (layers/sharding.py):
        # every device would compute the same rows.
        raise ValueError(f"a micro-batch of {micro_batch} sequences (train.global_batch {global_batch} / "
                         f"train.grad_accum {grad_accum}) cannot be split over the data x fsdp mesh size "
                         f"({ways}): raise train.global_batch or lower train.grad_accum")
