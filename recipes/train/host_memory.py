"""Host memory per phase of a training run: the peak a plan must fit, known before anything is allocated.

The step's arguments are not a run's host memory. Measured on CPU
(benchmarks/host_memory_phases.py) and read from deviceless GPU compiles
(benchmarks/host_memory_aot.py), a run with its optimizer state in host memory
holds, besides the process's own footprint F (JAX, the CUDA runtime and
libraries, XLA's compiler), per process:

    state creation  W + S + Gp           Optimizer.init writes the state straight into host
                                         memory (deviceless H200: host temp 0)
    step            the step's own host  donated, the new state is written over the old one
                    bytes                (host alias = host arguments); with the update in the
                                         next forward pass S + Gp: each layer's new state
                                         goes over its old row in place, the new pending
                                         gradients over the old (both donated; step.py)
    save, in pieces W + S + Gp + P       every array written from where it lies, one zarr chunk of
                                         at most SAVE_PIECE_BYTES at a time (checkpoint_io.py): P =
                                         PIECES_STAGING_BYTES, the pieces in flight and tensorstore's
                                         encoded copies of them; no join of the halves (the run picks
                                         this when the whole save below does not fit)
    save, whole     W + S + Gp + H       orbax's own path (async, overlapping the next steps): the
                    + staging            halved and split state and the split weights joined (H), and
                                         orbax's copies: on a GPU, orbax
                                         0.12.8 stages every device array in pinned host memory and
                                         then copies every array into NumPy before writing
                                         (serialization/replica_slices.transfer_arrays_to_host),
                                         2 x the device bytes saved + the host bytes saved; on CPU
                                         NumPy reads the buffers in place, but tensorstore's atomic
                                         OCDBT transaction holds every encoded array until it commits
                                         (measured: 1.9 GB for 2 GB saved), the bytes saved
    restore         W + S + Gp + P       every array read a piece at a time straight into its target
                                         placement and parts (the halves, a split's device and host
                                         rows; checkpoint_read.py): P = PIECES_STAGING_BYTES, the pieces
                                         in flight, as for the save; neither the state nor the weights
                                         are initialised first (run_state.py, step.setup's
                                         initialise=False: the targets are ShapeDtypeStructs), so the
                                         weights are held once. A step whose stored chunks are
                                         larger (orbax's whole save before chunks of a piece: up to
                                         2 GiB) reads a chunk at a time

with S the optimizer state in host memory, H what the whole save joins into new host arrays (the state kept
as LayerHalves, a split leaf of the state or of the weights whole: offload.*=host:N),
W the block weights in host memory, Gp the pending gradients in host memory
(offload.update=next_forward with offload.pending_gradients=host; 0 with them in HBM,
where the step is S alone). F is assumed (ASSUMED_GPU_FOOTPRINT_BYTES), not
measured on a GPU yet: benchmarks/gpu_suite.py records the resident peak.

`HostPhases` holds those figures; `phases_of(setup)` makes them from a
TrainSetup (abstract or concrete), and `check_host_peak` refuses a run whose
peak exceeds the host's RAM, naming the phase. The planner uses the same
model with the compiled step's own host bytes (recipes/plan/host_peak.py).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from spillway.layers.errors import SpillwayError
from spillway.layers.memory import PINNED_HOST, Memory

GiB = 2**30
# The process's own resident memory on a GPU machine before any state: JAX, the CUDA runtime, cuDNN and
# cuBLAS, XLA's GPU compiler compiling the step. Assumed, not measured (on CPU: 0.2 GB at start-up,
# 1.3 GB after compiling the 66M model's step, benchmarks/host_memory_phases.py).
ASSUMED_GPU_FOOTPRINT_BYTES = 6 * GiB
# Orbax's own array reads (a leaf not read in pieces) hold at most this many GB at once (its default: 96),
# set by recipes/train/checkpoint.py.
RESTORE_CONCURRENT_GB = 8
PHASES = ("start-up", "state creation", "step", "checkpoint save", "restore")
# A save in pieces (recipes/train/checkpoint_io.py): one zarr chunk, the most one piece holds, and the pieces
# tensorstore writes (and a restore reads) at once. 4, not 2: tensorstore's zstd encoding is what a save waits
# for once the device takes the pieces, and it runs a piece to a thread. Measured on a TPU v5e host (13 cores),
# 5.65 GiB of host state (BENCHMARKS.md, "Pieces in flight"): save 13.4-14.0 s at 2, 9.6-9.9 s at 4, 8.8-9.0 s
# at 8; restore 20-22 s, 16.8-17.1 s, 16.3-16.5 s; the save's rise +0.48-0.63, +0.58-0.70, +0.83-0.89 GiB.
SAVE_PIECE_BYTES = 32 * 2**20
SAVE_PIECES_IN_FLIGHT = 4
# What a save in pieces holds beside the state, a fixed amount: the pieces in flight and tensorstore's encoded
# copies of them, the piece being taken out (on a GPU its slice in pinned memory and its NumPy copy), the
# slice's compile, allocator slack. Measured with 4 in flight: on CPU, 2 GiB of state in 32 MiB pieces, the
# peak rose by 382 MiB (259 MiB with 2; tests/recipes/train/test_checkpoint_pieces.py bounds it by one layer
# + this); on the TPU v5e above, by at most 0.70 GiB.
PIECES_STAGING_BYTES = 768 * 2**20
# What a restore holds beside the restored arrays: pieces read straight into their targets
# (recipes/train/checkpoint_read.py), the same pieces in flight as a save's. Measured on CPU, 256 MiB of state
# in 8 MiB pieces: +115 to 180 MiB beside the state with 2 in flight, +164 MiB with 4
# (tests/recipes/train/test_checkpoint_restore.py).
RESTORE_STAGING_BYTES = PIECES_STAGING_BYTES


class HostPeakError(SpillwayError, MemoryError):
    """A run's host memory would peak above the host's RAM in some phase."""


@dataclasses.dataclass(frozen=True)
class HostPhases:
    """Bytes of host memory one process holds per phase (module docstring), and how much of it is pinned."""

    footprint: int
    state: int            # S: optimizer state in host memory
    halved: int           # H: what orbax's whole save joins first (LayerHalves, split state and weights)
    weights: int          # W: block weights in host memory
    pending: int          # Gp: pending gradients in host memory (offload.update=next_forward with
                          # offload.pending_gradients=host; 0 when they wait in HBM)
    step_host: int        # what the step holds in host memory (the compiled step's, or the argument count)
    saved_device: int     # bytes a checkpoint saves from device memory (parameters, device state)
    saved_host: int       # bytes a checkpoint saves from host memory
    gpu: bool = True      # orbax stages device arrays through pinned host memory (a GPU's)
    save_in_pieces: bool = True   # the save writes a chunk at a time (else orbax's whole, async save)

    @property
    def save_staging(self) -> int:
        """Host bytes the save holds beside the live state (module docstring)."""
        if self.save_in_pieces:
            return PIECES_STAGING_BYTES
        whole = 2 * self.saved_device + self.saved_host if self.gpu else self.saved_device + self.saved_host
        return self.halved + whole

    def whole_save_fits(self, host_ram_bytes: int) -> bool:
        """Whether orbax's whole (async) save fits `host_ram_bytes`: what a run uses when it does."""
        return dataclasses.replace(self, save_in_pieces=False).by_phase()["checkpoint save"] <= host_ram_bytes

    def by_phase(self) -> dict[str, int]:
        live = self.weights + self.state + self.pending
        saved = self.saved_device + self.saved_host
        return {
            "start-up": self.footprint,
            "state creation": self.footprint + live,
            "step": self.footprint + self.step_host,
            "checkpoint save": self.footprint + live + self.save_staging,
            "restore": self.footprint + live + min(saved, RESTORE_STAGING_BYTES),  # into targets, in pieces
        }

    def pinned_by_phase(self) -> dict[str, int]:
        """The pinned part of each phase: what XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB must allow."""
        live = self.weights + self.state + self.pending
        return {"start-up": 0, "state creation": live, "step": self.step_host,
                "checkpoint save": live + (0 if self.save_in_pieces else
                                           self.halved + (self.saved_device if self.gpu else 0)),
                "restore": live}

    def peak(self) -> tuple[str, int]:
        """(phase, bytes) of the highest phase."""
        return max(self.by_phase().items(), key=lambda item: item[1])

    def pinned_peak(self) -> int:
        return max(self.pinned_by_phase().values())

    def scaled(self, factor: int) -> HostPhases:
        """The same for `factor` processes' worth (the planner's per-GPU figures x GPUs on the host);
        the footprint once."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name) * factor for f in dataclasses.fields(self)
                                            if f.name not in ("footprint", "gpu", "save_in_pieces")})

    def describe(self, phase: str) -> str:
        gib = lambda n: f"{n / GiB:.1f} GiB"  # noqa: E731
        parts = {"start-up": f"process {gib(self.footprint)}",
                 "state creation": f"process {gib(self.footprint)}, state {gib(self.state)}, weights "
                                   f"{gib(self.weights)}, pending gradients {gib(self.pending)}",
                 "step": f"process {gib(self.footprint)}, the step's host buffers {gib(self.step_host)}",
                 "checkpoint save": f"process {gib(self.footprint)}, state {gib(self.state)}, weights "
                                    f"{gib(self.weights)}, pending gradients {gib(self.pending)}, "
                                    + (f"the pieces being written {gib(self.save_staging)}" if self.save_in_pieces
                                       else f"the state's halves and split leaves joined and orbax's host copies "
                                            f"{gib(self.save_staging)} (a whole save)"),
                 "restore": f"process {gib(self.footprint)}, state {gib(self.state)}, weights "
                            f"{gib(self.weights)}, the pieces being read "
                            f"{gib(min(self.saved_device + self.saved_host, RESTORE_STAGING_BYTES))}"}
        return parts[phase]

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "by_phase": self.by_phase(), "pinned_by_phase": self.pinned_by_phase()}

    @classmethod
    def from_dict(cls, data: dict) -> HostPhases:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


def _bytes_by_kind(tree, per_device: bool = False) -> dict[str, int]:
    """Bytes per memory kind this process holds, or (per_device) one device holds: each leaf's shard."""
    from spillway.recipes.optim.host_streaming import tree_nbytes_by_memory_kind
    if not per_device:
        return tree_nbytes_by_memory_kind(tree)
    totals: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape)
        kind = leaf.sharding.memory_kind or Memory.DEVICE.value
        totals[kind] = totals.get(kind, 0) + math.prod(shape) * leaf.dtype.itemsize
    return totals


def phases_of(s, *, step_host: int | None = None, footprint: int | None = None, gpu: bool = True,
              per_device: bool = False, save_in_pieces: bool = True) -> HostPhases:
    """HostPhases of a TrainSetup (step.setup or step.abstract_setup); nothing is allocated.

    `step_host`: the step's own host bytes (a compiled step's memory analysis); default: what
    step.pinned_host_bytes counts from the arguments. `footprint`: default ASSUMED_GPU_FOOTPRINT_BYTES
    on a GPU, the process's resident set now on CPU. `per_device`: one GPU's share (each leaf's shard;
    the planner's figures, with a compiled step's per-GPU host bytes) instead of this process's.
    """
    from spillway.recipes.train import step as train_step

    opt = s.optimizer
    abstract_state = opt.abstract_state(s.params, s.param_shardings)
    state = _bytes_by_kind(abstract_state, per_device).get(PINNED_HOST, 0)
    halved = (_bytes_by_kind(opt.halved_part(abstract_state), per_device).get(PINNED_HOST, 0)
              + sum(_bytes_by_kind(_split_leaves(s.params), per_device).values()))   # joined whole at a whole save
    weights = _bytes_by_kind(s.params, per_device).get(PINNED_HOST, 0)
    pending = _bytes_by_kind(train_step._abstract_pending(s), per_device).get(PINNED_HOST, 0)   # None: 0
    if step_host is None:
        step_host = train_step.pinned_bytes_of_setup(s).total
    saved = _bytes_by_kind((s.params, opt.saved_abstract_state(s.params, s.param_shardings)), per_device)
    if footprint is None:
        footprint = ASSUMED_GPU_FOOTPRINT_BYTES if gpu else _resident_bytes()
    return HostPhases(footprint=footprint, state=state, halved=halved, weights=weights, pending=pending,
                      step_host=step_host, saved_device=saved.get(Memory.DEVICE, 0),
                      saved_host=sum(n for kind, n in saved.items() if kind != Memory.DEVICE), gpu=gpu,
                      save_in_pieces=save_in_pieces)


def _split_leaves(params) -> list:
    """The split weights (offload.params=host:N) of a parameter tree, each a ResidentSplit of its two parts."""
    from spillway.recipes.optim.split_state import ResidentSplit
    split = lambda x: isinstance(x, ResidentSplit)  # noqa: E731
    return [x for x in jax.tree.leaves(params, is_leaf=split) if split(x)]


def _resident_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def check_host_peak(phases: HostPhases, host_ram_bytes: int, *, where: str = "this host") -> None:
    """HostPeakError naming the phase when the run's host memory would peak above `host_ram_bytes`."""
    phase, peak = phases.peak()
    if peak > host_ram_bytes:
        # Nothing of the run in host memory: moving it to the device cannot help, so the advice says so.
        remedy = ("keep more on device (offload.optimizer_state=device, offload.params=device, "
                  "offload.update=after_backward) or shard the state over more hosts"
                  if phases.state + phases.weights + phases.pending else
                  "nothing of this run is in host memory already (the process and the save's staging are): "
                  "run on a host with more RAM")
        raise HostPeakError(
            f"this run's host memory would peak at {peak / GiB:.1f} GiB during the {phase} "
            f"({phases.describe(phase)}), but {where} has {host_ram_bytes / GiB:.1f} GiB of RAM: {remedy}")


def restore_state(checkpointer, s, params, step: int | None = None):
    """(params, opt_state) of a checkpoint, restored as a resume does (recipes/train/run_state.py): nothing
    made first (`params` may be ShapeDtypeStructs), each saved leaf read a piece at a time straight into its
    parts (the state's halves, the split weights' device and host rows, offload.params=host:N)."""
    from spillway.recipes.train.step import abstract_with_shardings
    placed = abstract_with_shardings(params, s.param_shardings)
    restored = checkpointer.restore(step, abstract_params=placed,
                                    abstract_opt_state=s.optimizer.abstract_state(params, s.param_shardings))
    return restored["params"], restored["opt_state"]


def leaves_memory_kinds(tree) -> set[str]:
    """The memory kinds of a tree of arrays (to check a restore kept them)."""
    return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)}


# --- a run's checks, before anything is allocated ----------------------------------------------------------

def pinned_need_of_recipe(recipe) -> int:
    """The pinned bytes one process holding the whole model needs at its pinned peak (HostPhases.pinned_peak),
    from shapes alone: callable before JAX starts its GPU backend, which reads the pinned limit once.

    An upper bound for a run over several processes (each holds its shard).
    """
    phases = phases_of_recipe(recipe)
    # the run picks the save mode later (check_run): allow the whole save's pinned staging too
    return max(phases.pinned_peak(), dataclasses.replace(phases, save_in_pieces=False).pinned_peak())


def phases_of_recipe(recipe) -> HostPhases:
    """The HostPhases (footprint 0) of one process holding the whole model, from shapes alone (no backend)."""
    from spillway.layers.residency import host_layers, is_param_split
    from spillway.recipes.config import NEXT_FORWARD, PENDING_HOST
    from spillway.recipes.optim.layouts import LeafLayout, make_layouts
    from spillway.recipes.optim.param_placement import param_memories
    from spillway.recipes.train.step import abstract_model, pinned_step_bytes

    # The parameters' shapes do not depend on the attention kernel, and building a cuDNN one asks for the
    # backend (which would start it before the limit is set).
    _, abstract = abstract_model(dataclasses.replace(
        recipe, execution=dataclasses.replace(recipe.execution, attention_impl="flash")))
    layouts = jax.tree.leaves(make_layouts(abstract, recipe.optimizer, state_memory=recipe.offload.optimizer_state),
                              is_leaf=lambda x: isinstance(x, LeafLayout))
    values = [getattr(leaf, "value", leaf) for leaf in jax.tree.leaves(abstract)]
    memories = jax.tree.leaves(param_memories(abstract, recipe.offload.params))   # per leaf, same order
    deferred = recipe.offload.update == NEXT_FORWARD
    # offload.pending_gradients=device keeps them in HBM: Gp counts only pending gradients on host
    pending_on_host = deferred and recipe.offload.pending_gradients == PENDING_HOST
    moment_bytes = jnp.dtype(recipe.optimizer.moment_dtype).itemsize
    state = halved = weights = weights_f32 = pending = device_saved = split_device = 0
    for layout, value, memory in zip(layouts, values, memories, strict=True):
        size = int(value.size)
        param_bytes = size * value.dtype.itemsize
        state_bytes = size * (2 * moment_bytes + 4 * layout.master)   # mu, nu, the fp32 master
        streamed = layout.stacked and layout.state_memory == Memory.HOST and not recipe.optimizer.update_on_host
        host_weight = memory == Memory.HOST
        if layout.split:
            # offload.optimizer_state=host:N: the last layers' state on host; orbax's whole save joins the
            # leaf into one host array first (Optimizer.saved_form), the device part copied out (a save in
            # pieces writes the parts as they lie).
            host_share = state_bytes * layout.host_layers // value.shape[0]
            state += host_share
            halved += state_bytes
            split_device += state_bytes - host_share
        elif layout.state_memory == Memory.HOST:
            state += state_bytes
            halved += state_bytes if streamed and not deferred else 0
            pending += param_bytes if streamed and pending_on_host else 0
        else:
            device_saved += state_bytes
        # offload.params=host:N: the last N layers' weights on host; a save in pieces writes both parts as
        # they lie, orbax's whole save joins the leaf into one host array first
        host_fraction = (host_layers(recipe.offload.params, value.shape[0]) / value.shape[0]
                         if host_weight and is_param_split(recipe.offload.params) else float(host_weight))
        host_weight_bytes = int(param_bytes * host_fraction)
        halved += param_bytes if 0 < host_fraction < 1 else 0
        weights += host_weight_bytes
        weights_f32 += int(4 * size * host_fraction)
        device_saved += param_bytes - host_weight_bytes
        split_device += param_bytes - host_weight_bytes if host_weight else 0
    step_host = pinned_step_bytes(recipe, state=state, weights=weights, weights_f32=weights_f32,
                                  pending=pending).total
    return HostPhases(footprint=0, state=state, halved=halved, weights=weights, pending=pending,
                      step_host=step_host, saved_device=device_saved,
                      saved_host=state + weights + split_device)


def check_run(s, *, host_ram_bytes: int | None = None, machine_ram_bytes: int | None = None,
              environ=None, say=print, async_save: bool = True) -> HostPhases:
    """Before a run allocates anything: its host peak against the RAM, its pinned peak against
    XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB when the user set that. `s` is the run's abstract setup on this
    process's mesh. `host_ram_bytes`: the RAM to plan for (spillway train --host-ram-gb); default the
    machine's. Returns the phases, with the save mode the run uses (`save_in_pieces`): orbax's whole,
    async save when `async_save` and it fits the RAM, else the save in pieces."""
    import os

    from spillway.recipes.optim.host_memory import host_ram_bytes as machine_ram
    from spillway.recipes.train import gpu_allocators
    from spillway.recipes.train.xla_settings import GPU_PLATFORMS

    environ = os.environ if environ is None else environ
    gpu = jax.default_backend() in GPU_PLATFORMS
    machine = machine_ram() if machine_ram_bytes is None else machine_ram_bytes
    if host_ram_bytes is not None and machine and host_ram_bytes > machine:
        say(f"warning: --host-ram-gb {host_ram_bytes / 1e9:g} is more than this machine's RAM "
            f"({machine / 1e9:.1f} GB, /proc/meminfo): the host memory check uses {host_ram_bytes / 1e9:g} GB, "
            f"and a run that needs more than the machine has is killed by the kernel")
    phases = phases_of(s, gpu=gpu)
    ram = host_ram_bytes if host_ram_bytes is not None else machine
    if async_save and ram and phases.whole_save_fits(ram):
        phases = dataclasses.replace(phases, save_in_pieces=False)
    if ram:
        check_host_peak(phases, ram)
    if gpu:
        gpu_allocators.check_pinned_limit(phases.pinned_peak(), environ)
    return phases
