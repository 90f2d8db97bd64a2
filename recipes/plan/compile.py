"""Compile a jitted function for a GPU target on a machine without one, and report its memory.

Run this inside a compile process (``spillway.recipes.plan.subprocess_runner``): the
jax-cuda13 plugin must be on ``sys.path`` and ``JAX_PLATFORMS=cpu`` set before
JAX initialises its backends, so JAX keeps running on the CPU while the plugin's
compiler is used for the target (docs/DESIGN.md section 5).

Steps, each a function here:

1. ``compile_only_mesh(target, {"data": 2, "tensor": 4})``: a ``jax.sharding.Mesh``
   over compile-only devices of a GPU topology (``gpu_topology``) built from the
   target's ``GpuTargetConfigProto``.
2. ``abstract_array`` / ``on_compile_mesh``: ``jax.ShapeDtypeStruct`` arguments
   sharded over that mesh. Device-memory arguments get an ordinary NamedSharding.
   Host-memory (``pinned_host``) arguments need a NamedSharding over the mesh's
   *abstract* mesh: compile-only devices report no memories, so a NamedSharding
   over them silently drops ``memory_kind``; the abstract mesh keeps it.
3. ``compile_report(jax.jit(step), *args)``: lower, compile, and read
   ``memory_analysis()`` plus the compiled HLO into a ``CompileReport``.

Inside the function being compiled, move data between memories with
``jax.device_put(x, jax.memory.Space.Host)`` / ``jax.memory.Space.Device`` (or a
sharding on ``mesh.abstract_mesh`` with a memory kind). A ``NamedSharding`` over
the concrete compile-only mesh loses its memory kind, and the compile then fails
("memory_space of all inputs passed to `add` must be the same") or, worse,
silently keeps the data where it was. ``jax.memory.Space`` works the same on a
real GPU, so model and optimizer code written that way compiles in both places.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import topologies
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from spillway.layers.memory import PINNED_HOST, Memory
from spillway.recipes.plan import hlo, plugin
from spillway.recipes.targets import GpuTarget, get_target

DEVICE_MEMORY = Memory.DEVICE.value
UNPINNED_HOST = "unpinned_host"   # XLA's pageable host memory kind (no setting names it)
HOST_MEMORY_KINDS = (PINNED_HOST, UNPINNED_HOST)


class CompilerPluginNotLoaded(RuntimeError):
    """This process has no CUDA compiler plugin; run the compile in a compile process."""


def _plugin_not_loaded_message(cause: BaseException) -> str:
    reason = plugin.missing_reason()
    hint = (f"\n{reason}" if reason else
            "\nThe plugin is installed but this process did not load it: JAX initialised "
            "its backends before the plugin folder was on sys.path. Run the compile "
            "through spillway.recipes.plan.subprocess_runner.run_in_compile_process, or call "
            "prepare_compile_process() before JAX starts its backends.")
    return f"cannot create a CUDA compile-only topology ({type(cause).__name__}: {cause}).{hint}"


@functools.lru_cache(maxsize=None)
def _topology(config_text: str, topology: str) -> topologies.TopologyDescription:
    try:
        return topologies.get_topology_desc(platform="cuda", target_config=config_text,
                                            topology=topology)
    except NotImplementedError as error:
        # What JAX raises when no "cuda" PJRT plugin was registered at backend start.
        raise CompilerPluginNotLoaded(_plugin_not_loaded_message(error)) from error


def gpu_topology(target: str | GpuTarget, num_devices: int = 1, *,
                 num_hosts: int = 1) -> topologies.TopologyDescription:
    """Compile-only devices for ``num_devices`` GPUs of ``target`` over ``num_hosts`` hosts.

    The topology string is ``"1x<hosts>x<gpus per host>"``; devices on host ``i``
    get ``process_index == i``, which multi-host sharding decisions can see.
    """
    target = get_target(target)
    if num_devices < 1 or num_hosts < 1 or num_devices % num_hosts:
        raise ValueError(f"{num_devices} devices cannot be split evenly over {num_hosts} hosts")
    topology = f"1x{num_hosts}x{num_devices // num_hosts}"
    return _topology(target.target_config_text, topology)


# Concrete compile-only mesh for each abstract mesh handed out, so that a call
# whose arguments all carry abstract (host-memory) shardings can still be given
# its devices (see compile_report).
_CONCRETE_MESHES: dict[AbstractMesh, Mesh] = {}


def compile_only_mesh(target: str | GpuTarget, mesh_shape: Mapping[str, int], *,
                      num_hosts: int = 1) -> Mesh:
    """A Mesh with axes ``mesh_shape`` (name -> size, major to minor) over compile-only GPUs."""
    if not mesh_shape:
        raise ValueError("mesh_shape needs at least one axis, e.g. {'data': 1}")
    sizes = tuple(int(size) for size in mesh_shape.values())
    topology = gpu_topology(target, math.prod(sizes), num_hosts=num_hosts)
    mesh = Mesh(np.asarray(topology.devices, dtype=object).reshape(sizes),
                tuple(mesh_shape))
    _CONCRETE_MESHES[mesh.abstract_mesh] = mesh
    return mesh


def normalize_memory_kind(memory_kind: Any) -> str | None:
    """``None``/"device"/"pinned_host"/"unpinned_host" or a ``jax.memory.Space`` -> str | None."""
    if memory_kind is None:
        return None
    name = getattr(memory_kind, "name", memory_kind)   # jax.memory.Space member
    name = str(name).lower()
    if name in (Memory.HOST, PINNED_HOST):
        return PINNED_HOST
    if name in (DEVICE_MEMORY, UNPINNED_HOST):
        return name
    raise ValueError(f"unknown memory kind {memory_kind!r}; use 'device', 'pinned_host' "
                     f"or 'unpinned_host'")


def compile_sharding(mesh: Mesh, spec: PartitionSpec = PartitionSpec(),
                     memory_kind: Any = None) -> NamedSharding:
    """A NamedSharding that keeps ``memory_kind`` in a deviceless compile.

    Host memory kinds go on the abstract mesh (the concrete one would drop them);
    device memory stays on the concrete mesh, which gives the compile its devices.
    """
    kind = normalize_memory_kind(memory_kind)
    if kind in HOST_MEMORY_KINDS:
        return NamedSharding(mesh.abstract_mesh, spec, memory_kind=kind)
    return NamedSharding(mesh, spec)


def abstract_array(shape: tuple[int, ...], dtype: Any, mesh: Mesh,
                   spec: PartitionSpec = PartitionSpec(),
                   memory_kind: Any = None) -> jax.ShapeDtypeStruct:
    """A ShapeDtypeStruct on the compile-only mesh, in device or host memory."""
    return jax.ShapeDtypeStruct(tuple(shape), dtype,
                                sharding=compile_sharding(mesh, spec, memory_kind))


def _is_partition_spec(value: Any) -> bool:
    return isinstance(value, PartitionSpec)


def on_compile_mesh(tree: Any, mesh: Mesh, *, specs: Any = None,
                    memory_kinds: Any = None) -> Any:
    """Re-home a pytree of abstract values (anything with .shape/.dtype) onto ``mesh``.

    Per leaf, the PartitionSpec and memory kind come from ``specs`` /
    ``memory_kinds`` when given (a tree of the same structure, or one value for
    every leaf), else from the leaf's own NamedSharding (e.g. built on an
    AbstractMesh with the same axis names by the sharding rules), else the leaf
    is replicated in device memory. This lets the planner build shardings as the
    trainer does and only swap the devices.
    """
    leaves, treedef = jax.tree.flatten(tree)

    def per_leaf(values: Any, is_single: Callable[[Any], bool]) -> list[Any]:
        if values is None or is_single(values):
            return [values] * len(leaves)
        return treedef.flatten_up_to(values)   # raises if the structure differs

    leaf_specs = per_leaf(specs, _is_partition_spec)
    leaf_kinds = per_leaf(memory_kinds, lambda v: isinstance(v, (str, jax.memory.Space)))
    rehomed = []
    for leaf, spec, kind in zip(leaves, leaf_specs, leaf_kinds):
        own = getattr(leaf, "sharding", None)
        if spec is None:
            spec = own.spec if isinstance(own, NamedSharding) else PartitionSpec()
        if kind is None and isinstance(own, NamedSharding):
            kind = own.memory_kind
        rehomed.append(abstract_array(leaf.shape, leaf.dtype, mesh, spec, kind))
    return jax.tree.unflatten(treedef, rehomed)


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """What a deviceless compile says about one program, per device.

    HBM: ``hbm_bytes = argument + output - alias + temp`` (device memory only;
    ``peak_memory_bytes`` from XLA mixes in host bytes once offload is used, so
    it is kept for reference only). Host: the same sum over the host_* fields.
    ``host_buffer_count`` counts ``S(5)`` (host memory space) annotations in the
    compiled HLO: zero means nothing was offloaded, whatever the policy asked.
    The transfer fields estimate the bytes one run moves each way (see
    ``spillway.spillway.recipes.plan.hlo.host_traffic`` for what is and is not counted).
    """

    hbm_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    host_bytes: int
    host_argument_bytes: int
    host_output_bytes: int
    host_alias_bytes: int
    host_temp_bytes: int
    peak_memory_bytes: int
    host_buffer_count: int
    host_async_transfers: int
    host_sync_transfers: int
    device_to_host_bytes: int
    host_to_device_bytes: int
    unknown_trip_counts: int
    lower_seconds: float
    compile_seconds: float
    device_kind: str
    num_devices: int
    # Bytes that move in one link direction while the other direction moves too
    # (hlo.overlapping_host_copies); 0 in reports written before it existed.
    overlapped_transfer_bytes: int = 0
    # The same split by autodiff pass ("forward", "backward", "other"); empty in older reports.
    overlapped_bytes_by_pass: dict[str, int] = dataclasses.field(default_factory=dict)
    # Bytes each way per autodiff pass (hlo.traffic_by_pass); empty in older reports.
    transfer_bytes_by_pass: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    # Async host copy bytes (both directions) per autodiff pass, and those the schedule runs beside a
    # matmul (hlo.host_copies_beside_compute); empty in older reports.
    async_copy_bytes_by_pass: dict[str, int] = dataclasses.field(default_factory=dict)
    copies_beside_compute_by_pass: dict[str, int] = dataclasses.field(default_factory=dict)
    # Of host_to_device_bytes, those inside a conditional's branch (hlo.HostTraffic); 0 in older reports.
    conditional_host_to_device_bytes: int = 0
    # Of the bytes moved both ways, those a GPU moves with a kernel reading or writing pinned host memory
    # rather than a DMA memcpy (hlo.host_copy_engines); 0 in older reports.
    host_kernel_copy_bytes: int = 0
    hlo_text: str | None = dataclasses.field(default=None, repr=False, compare=False)

    def host_transfer_seconds(self, link_bytes_per_s: float) -> float:
        """Time the host link needs per run; the link is full duplex, so the larger direction."""
        return max(self.device_to_host_bytes, self.host_to_device_bytes) / link_bytes_per_s

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (without the HLO text)."""
        data = dataclasses.asdict(self)
        data.pop("hlo_text")
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CompileReport:
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in names})

    @classmethod
    def from_compiled(cls, compiled: Any, *, lower_seconds: float = 0.0,
                      compile_seconds: float = 0.0, device_kind: str = "",
                      num_devices: int = 0, keep_hlo_text: bool = False) -> CompileReport:
        """Read a ``jax.stages.Compiled`` into a report."""
        stats = compiled.memory_analysis()
        hlo_text = compiled.as_text()
        traffic = hlo.host_traffic(hlo_text)
        overlap = hlo.overlapping_host_copies(hlo_text)
        beside = hlo.host_copies_beside_compute(hlo_text)
        return cls(
            hbm_bytes=(stats.argument_size_in_bytes + stats.output_size_in_bytes
                       - stats.alias_size_in_bytes + stats.temp_size_in_bytes),
            argument_bytes=stats.argument_size_in_bytes,
            output_bytes=stats.output_size_in_bytes,
            alias_bytes=stats.alias_size_in_bytes,
            temp_bytes=stats.temp_size_in_bytes,
            generated_code_bytes=stats.generated_code_size_in_bytes,
            host_bytes=(stats.host_argument_size_in_bytes + stats.host_output_size_in_bytes
                        - stats.host_alias_size_in_bytes + stats.host_temp_size_in_bytes),
            host_argument_bytes=stats.host_argument_size_in_bytes,
            host_output_bytes=stats.host_output_size_in_bytes,
            host_alias_bytes=stats.host_alias_size_in_bytes,
            host_temp_bytes=stats.host_temp_size_in_bytes,
            peak_memory_bytes=stats.peak_memory_in_bytes,
            host_buffer_count=hlo.count_host_memory_annotations(hlo_text),
            host_async_transfers=traffic.async_transfers,
            host_sync_transfers=traffic.sync_transfers,
            device_to_host_bytes=traffic.device_to_host_bytes,
            host_to_device_bytes=traffic.host_to_device_bytes,
            unknown_trip_counts=traffic.unknown_trip_counts,
            lower_seconds=lower_seconds,
            compile_seconds=compile_seconds,
            device_kind=device_kind,
            num_devices=num_devices,
            overlapped_transfer_bytes=overlap.overlapped_bytes,
            overlapped_bytes_by_pass=overlap.overlapped_by_pass,
            transfer_bytes_by_pass=hlo.traffic_by_pass(hlo_text),
            async_copy_bytes_by_pass=beside.moved_by_pass,
            copies_beside_compute_by_pass=beside.beside_compute_by_pass,
            conditional_host_to_device_bytes=traffic.conditional_host_to_device_bytes,
            host_kernel_copy_bytes=hlo.host_copy_engines(hlo_text).kernel_bytes,
            hlo_text=hlo_text if keep_hlo_text else None,
        )


def _shardings_in(args: Any) -> list[Any]:
    return [leaf.sharding for leaf in jax.tree.leaves(args)
            if getattr(leaf, "sharding", None) is not None]


def _find_mesh(shardings: list[Any]) -> Mesh | None:
    """The concrete mesh a call should compile against, or None if arguments give their devices."""
    if any(isinstance(s, NamedSharding) and isinstance(s.mesh, Mesh)
           or not isinstance(s, NamedSharding) for s in shardings):
        return None
    for sharding in shardings:
        mesh = _CONCRETE_MESHES.get(sharding.mesh)
        if mesh is not None:
            return mesh
    return None


def _describe_devices(shardings: list[Any], mesh: Mesh | None) -> tuple[str, int]:
    if mesh is not None:
        return mesh.devices.flat[0].device_kind, mesh.size
    for sharding in shardings:
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
            return sharding.mesh.devices.flat[0].device_kind, sharding.mesh.size
        if not isinstance(sharding, NamedSharding):
            devices = sorted(sharding.device_set, key=lambda d: d.id)
            return devices[0].device_kind, len(devices)
    return "", 0


def compile_report(jitted_fn: Callable[..., Any], *abstract_args: Any,
                   compile_mesh: Mesh | None = None, keep_hlo_text: bool = False,
                   **abstract_kwargs: Any) -> CompileReport:
    """Lower and compile ``jitted_fn`` for the devices its arguments name; report memory.

    Arguments are ShapeDtypeStructs on a compile-only mesh (``abstract_array``,
    ``on_compile_mesh``). When every argument is in host memory they name no
    concrete devices; the call then runs under ``jax.set_mesh`` of the compile
    mesh (``compile_mesh``, or the mesh ``compile_only_mesh`` made for their
    abstract mesh). Pass a plain function and it is jitted without options.
    """
    if not hasattr(jitted_fn, "lower"):
        jitted_fn = jax.jit(jitted_fn)
    shardings = _shardings_in((abstract_args, abstract_kwargs))
    mesh = compile_mesh or _find_mesh(shardings)
    if mesh is None and shardings and all(isinstance(s, NamedSharding)
                                          and isinstance(s.mesh, AbstractMesh) for s in shardings):
        raise ValueError("every argument has an abstract-mesh sharding and no compile mesh is "
                         "known: pass compile_mesh= (the Mesh from compile_only_mesh)")
    context = jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
    with context:
        started = time.perf_counter()
        lowered = jitted_fn.lower(*abstract_args, **abstract_kwargs)
        lowered_at = time.perf_counter()
        compiled = lowered.compile()
        compiled_at = time.perf_counter()
    device_kind, num_devices = _describe_devices(shardings, mesh)
    return CompileReport.from_compiled(
        compiled, lower_seconds=lowered_at - started, compile_seconds=compiled_at - lowered_at,
        device_kind=device_kind, num_devices=num_devices, keep_hlo_text=keep_hlo_text)
