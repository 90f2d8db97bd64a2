"""Logical-axis sharding: rules that map logical axis names to mesh axes.

Parameters carry `logical_axes` metadata (one logical name per dimension, see
layers/names.py). A mesh has the axes ("data", "fsdp", "tensor"). The rules say
which mesh axis (or axes) shards each logical axis; a dimension whose size the
mesh axes do not divide is replicated instead, so odd test sizes and MQA
(one KV head) work on any mesh. That fallback costs memory (every device of
those axes holds the whole dimension) and, on the tensor axis, compute (every
device computes it): `undivided_dims` lists where it happens, `setup()` of a
training run warns with the bytes, and the planner refuses such a mesh
(`logical_to_spec(..., strict=True)` raises instead of replicating).

Activations are pinned too: layers call `constrain(x, logical_axes)` on the
residual stream, attention heads, MLP hidden and logits. Without it XLA's
sharding propagation copies the weights' layout (embed split over "fsdp") onto
the activations, and every device then holds a d_model slice of the whole
global batch: measured on an 8-GPU deviceless compile, per-device temp grew
with the device count instead of staying flat. `constrain` only acts inside
`activation_sharding(mesh)` (the train step enters it while tracing), so
single-device code and tests never need a mesh.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spillway.layers import names
from spillway.layers.mesh import MESH_AXES, MeshConfig

# logical axis -> mesh axes. Batch is split over data and fsdp (FSDP is data
# parallel for activations); weights are split over fsdp on their embed axis
# and over tensor on heads / MLP / vocab (Megatron-style).
DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    names.BATCH: ("data", "fsdp"),
    names.SEQ: (),
    names.EMBED: ("fsdp",),
    names.VOCAB: ("tensor",),
    names.HEADS: ("tensor",),
    names.KV_HEADS: ("tensor",),
    names.HEAD_DIM: (),
    names.MLP: ("tensor",),
    names.LAYERS: (),
    names.NORM: (),
    # Expert parallelism over the fsdp axis (docs/DESIGN.md section 12): each device holds
    # whole experts instead of a d_model slice of every expert, and tokens travel to them.
    # An expert weight's embed axis then finds fsdp taken and stays whole.
    names.EXPERT: ("fsdp",),
    names.ACT_EMBED: (),
    names.ACT_HEADS: ("tensor",),
    names.ACT_KV_HEADS: ("tensor",),
    names.ACT_MLP: ("tensor",),
    names.ACT_VOCAB: ("tensor",),
}


def make_mesh(config: MeshConfig = MeshConfig(), devices=None) -> Mesh:
    """The ("data", "fsdp", "tensor") mesh of `config` (a recipe's `mesh`) over `devices` (default: all);
    one axis may be -1, filled from the device count (layers/mesh.py)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = config.resolve(len(devices))
    return Mesh(np.asarray(devices).reshape([sizes[axis] for axis in MESH_AXES]), MESH_AXES)


def _mesh_sizes(mesh) -> Mapping[str, int]:
    """Axis sizes of a Mesh, an AbstractMesh, or a plain {axis: size} mapping."""
    return dict(mesh) if isinstance(mesh, Mapping) else dict(mesh.shape)


def _split_dims(logical_axes: Sequence[str | None], shape: Sequence[int] | None, mesh_sizes, rules):
    """Per dimension: (mesh axes that shard it, mesh axes its rule asks for that do not divide it)."""
    used: set[str] = set()
    out = []
    for dim, axis in enumerate(logical_axes):
        if axis is None:
            out.append(((), ()))
            continue
        if axis not in rules:
            raise ValueError(f"no sharding rule for logical axis {axis!r}; rules cover {sorted(rules)}")
        mesh_axes = tuple(a for a in rules[axis] if a not in used)
        dropped: tuple[str, ...] = ()
        if mesh_sizes is not None:
            mesh_axes = tuple(a for a in mesh_axes if mesh_sizes[a] > 1)
            if shape is not None and shape[dim] % int(np.prod([mesh_sizes[a] for a in mesh_axes])):
                mesh_axes, dropped = (), mesh_axes
        used.update(mesh_axes)
        out.append((mesh_axes, dropped))
    return out


def logical_to_spec(logical_axes: Sequence[str | None], shape: Sequence[int] | None = None,
                    mesh: Mesh | None = None, rules: Mapping[str, Sequence[str]] = DEFAULT_RULES,
                    *, strict: bool = False) -> PartitionSpec:
    """PartitionSpec for one array. With `shape` and `mesh`, undividable dims are replicated
    (or, with `strict`, a ValueError names the dimension and the mesh axes)."""
    spec = []
    split = _split_dims(logical_axes, shape, None if mesh is None else _mesh_sizes(mesh), rules)
    for dim, (mesh_axes, dropped) in enumerate(split):
        if dropped and strict:
            sizes = _mesh_sizes(mesh)
            raise ValueError(f"{' x '.join(f'mesh.{a}={sizes[a]}' for a in dropped)} does not divide "
                             f"{logical_axes[dim]} ({shape[dim]})")
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else (mesh_axes or None))
    return PartitionSpec(*spec)


@dataclasses.dataclass(frozen=True)
class UndividedDim:
    """A parameter dimension its sharding rule gives to mesh axes that do not divide it: replicated there."""

    path: str                   # the parameter, e.g. "layers.blocks.attn.wq"
    logical_axis: str           # e.g. "heads"
    size: int                   # the dimension's length
    mesh_axes: tuple[str, ...]  # the axes that should have split it
    ways: int                   # their product
    nbytes: int                 # the parameter's bytes: each device of those axes holds ways x its share

    def describe(self) -> str:
        return f"{self.path} {self.logical_axis} ({self.size}) by {' x '.join(self.mesh_axes)}={self.ways}"


def undivided_dims(state: nnx.State, mesh, rules=DEFAULT_RULES) -> list[UndividedDim]:
    """Every parameter dimension of `state` that `mesh` (a Mesh, AbstractMesh or {axis: size}) cannot
    split as the rules ask, so that `state_shardings` replicates it."""
    sizes = _mesh_sizes(mesh)
    found = []
    for path, var in nnx.to_flat_state(state):
        if not isinstance(var, nnx.Variable):
            continue
        value = var.get_value()
        shape = tuple(np.shape(value))
        for dim, (_, dropped) in enumerate(_split_dims(variable_axes(var), shape, sizes, rules)):
            if dropped:
                nbytes = int(np.prod(shape)) * np.dtype(value.dtype).itemsize
                found.append(UndividedDim(".".join(str(k) for k in path), variable_axes(var)[dim], shape[dim],
                                          dropped, int(np.prod([sizes[a] for a in dropped])), nbytes))
    return found


def variable_axes(var: nnx.Variable) -> tuple[str | None, ...]:
    axes = var.get_metadata().get("logical_axes")
    if axes is None:
        return (None,) * np.ndim(var.get_value())
    if len(axes) != np.ndim(var.get_value()):
        raise ValueError(f"logical_axes {axes} do not match a value of shape {np.shape(var.get_value())}")
    return tuple(axes)


def state_shardings(state: nnx.State, mesh: Mesh, rules=DEFAULT_RULES, memory_kind: str | None = None):
    """A NamedSharding per variable of an nnx.State (same tree structure)."""
    def one(var):
        spec = logical_to_spec(variable_axes(var), np.shape(var.get_value()), mesh, rules)
        return var.replace(NamedSharding(mesh, spec, memory_kind=memory_kind))
    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh, ndim: int = 2, rules=DEFAULT_RULES) -> NamedSharding:
    """Sharding of a [batch, seq, ...] input batch."""
    return NamedSharding(mesh, logical_to_spec((names.BATCH,) + (None,) * (ndim - 1), None, mesh, rules))


def create_sharded(make_module, mesh: Mesh | None = None, rules=DEFAULT_RULES, shardings=None):
    """Build an nnx.Module with its parameters initialised by one jitted program.

    Eager initialisation compiles one tiny program per parameter shape (seconds
    for a small model); one jit is faster, and with a mesh each parameter is
    created directly in its shard, so a model larger than one device's memory
    is never materialised whole. `shardings` (a state of shardings, as
    state_shardings returns) overrides the ones `rules` give.
    """
    graphdef, program = init_program(make_module, mesh, rules, shardings)
    return nnx.merge(graphdef, program())


def init_program(make_module, mesh: Mesh | None = None, rules=DEFAULT_RULES, shardings=None):
    """(graphdef, the jitted program with no arguments that returns the module's initialised state).

    What create_sharded runs; apart so that it can also be compiled ahead of
    time for a GPU target (the start-up's HBM, benchmarks/host_params_toy.py).
    """
    graphdef, abstract_state = nnx.split(nnx.eval_shape(make_module))
    out_shardings = shardings
    if out_shardings is None and mesh is not None:
        out_shardings = state_shardings(abstract_state, mesh, rules)
    return graphdef, jax.jit(lambda: nnx.split(make_module())[1], out_shardings=out_shardings)


_ACTIVATION_MESH: contextvars.ContextVar[tuple[Mesh, Mapping] | None] = contextvars.ContextVar(
    "spillway_activation_mesh", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh | None, rules: Mapping[str, Sequence[str]] = DEFAULT_RULES) -> Iterator[None]:
    """While tracing inside this context, `constrain` pins activations to `mesh` by `rules`."""
    token = _ACTIVATION_MESH.set(None if mesh is None else (mesh, rules))
    try:
        yield
    finally:
        _ACTIVATION_MESH.reset(token)


def current_activation_mesh() -> tuple[Mesh, Mapping] | None:
    """(mesh, rules) of the `activation_sharding` in force, or None (single-device code and tests)."""
    return _ACTIVATION_MESH.get()


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """`x` with a sharding constraint from its logical axes; unchanged outside `activation_sharding`."""
    active = _ACTIVATION_MESH.get()
    if active is None:
        return x
    mesh, rules = active
    if len(logical_axes) != x.ndim:
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match an activation of shape {x.shape}")
    spec = logical_to_spec(logical_axes, x.shape, mesh, rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
