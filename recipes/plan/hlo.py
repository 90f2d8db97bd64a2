"""Reading host-memory traffic out of compiled (post-optimisation) HLO text.

XLA marks a buffer that lives in host memory with memory space 5 in its layout,
printed ``f32[8,1024]{1,0:S(5)}``. After its host-offload passes, data crosses
between HBM and host memory in a few instruction shapes:

* ``copy-start``/``copy-done`` (async) or ``copy`` whose source or destination is
  in S(5): whole host-resident arguments or outputs being moved;
* ``dynamic-update-slice`` into an S(5) buffer (offloading one layer's activation
  inside a scanned loop) and ``dynamic-slice`` out of one (bringing it back), often
  wrapped as async ``fusion-start``/``fusion-done`` pairs.

``host_traffic`` walks the program from its entry computation, follows while
loops (multiplying by their ``known_trip_count``), calls and conditional branches,
and for each instruction that reads host memory and writes device memory (or the
reverse) adds up the device-side bytes. It is an estimate meant for transfer-time
arithmetic, not an exact count:

* A conditional's branches are all counted (an upper bound); `HostTraffic` also says how many of the
  host->device bytes are inside a conditional's branch (`conditional_host_to_device_bytes`), so that a
  caller who knows how often a branch is taken can take out the rest (the kept weights of
  offload.params_keep: recipes/plan/cost_model.py).
* A while loop without a known trip count is counted once and flagged.
* Fused computations are not entered; the fusion's own operands and result are
  what cross the link.
* Numbers are per device: in an SPMD program every device runs this HLO.
* An async pair is counted at its ``*-start`` only (the start's shape names the
  operands and the result); the ``*-done`` moves nothing more. Before
  ``custom-call-done`` was listed here, a host computation (``compute_on``,
  ``custom-call-start`` to target HostExecute) was counted twice, and its done
  once more in the other direction.

``host_transfers`` lists the same instructions one by one, each with the
``op_name`` JAX recorded for it; ``autodiff_pass`` reads from that name whether
the instruction belongs to the forward pass, the backward pass or neither.

Nothing here imports JAX, so it can be tested anywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

from spillway.layers.names import LATER_MICRO_BATCHES_SCOPE

HOST_MEMORY_SPACE = "S(5)"

_ARRAY_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_COMMENT = re.compile(r"/\*.*?\*/")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLED = {
    "while": ("body", "condition"),
    "call": ("to_apply",),
    "conditional": ("true_computation", "false_computation", "branch_computations"),
}
# Instructions that rename or route buffers without moving bytes between memories.
_NOT_TRANSFERS = {
    "parameter", "tuple", "get-tuple-element", "bitcast", "constant", "while", "call",
    "conditional", "copy-done", "fusion-done", "async-done", "async-update",
    "opt-barrier", "after-all", "add-dependency", "custom-call", "custom-call-done", "send-done", "recv-done",
}

_BITS_PER_ELEMENT = {
    "pred": 8, "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8,
    "s16": 16, "u16": 16, "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32,
    "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128, "token": 0,
}


def _bits_per_element(dtype: str) -> int:
    if dtype in _BITS_PER_ELEMENT:
        return _BITS_PER_ELEMENT[dtype]
    if dtype.startswith("f8") or dtype.startswith("f4") or dtype.startswith("f6"):
        return int(dtype[1])   # f8e4m3fn, f4e2m1fn, f6e3m2fn ...
    raise ValueError(f"unknown HLO element type {dtype!r}")


@dataclasses.dataclass(frozen=True)
class ArrayShape:
    dtype: str
    dims: tuple[int, ...]
    on_host: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.dims) * _bits_per_element(self.dtype) // 8


# A shape is an ArrayShape or a tuple of shapes.
Shape = ArrayShape | tuple


def parse_shape(text: str) -> Shape:
    """Parse an HLO shape such as ``(f32[2]{0}, bf16[4,8]{1,0:S(5)})``."""
    text = _COMMENT.sub("", text).strip()
    shape, rest = _parse_shape_prefix(text)
    if rest.strip():
        raise ValueError(f"trailing text after HLO shape: {rest!r}")
    return shape


def _parse_shape_prefix(text: str) -> tuple[Shape, str]:
    text = text.lstrip()
    if text.startswith("("):
        elements = []
        rest = text[1:].lstrip()
        while not rest.startswith(")"):
            element, rest = _parse_shape_prefix(rest)
            elements.append(element)
            rest = rest.lstrip()
            if rest.startswith(","):
                rest = rest[1:].lstrip()
        return tuple(elements), rest[1:]
    match = _ARRAY_SHAPE.match(text)
    if match is None:
        raise ValueError(f"not an HLO shape: {text[:80]!r}")
    dtype, dims, layout = match.groups()
    shape = ArrayShape(dtype=dtype,
                       dims=tuple(int(d) for d in dims.split(",") if d),
                       on_host=bool(layout) and HOST_MEMORY_SPACE in layout)
    return shape, text[match.end():]


def _arrays(shape: Shape) -> list[ArrayShape]:
    if isinstance(shape, ArrayShape):
        return [shape]
    return [array for element in shape for array in _arrays(element)]


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: Shape
    opcode: str
    operands: tuple[str, ...]
    attributes: str


def _matching_paren(text: str, start: int) -> int:
    """Index of the parenthesis closing the one at ``start``."""
    depth = 0
    for index in range(start, len(text)):
        char = text[index]
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth == 0:
                return index
    raise ValueError(f"unbalanced parentheses in {text[:120]!r}")


def _parse_instruction(line: str) -> Instruction | None:
    line = line.strip()
    if line.startswith("ROOT "):
        line = line[5:]
    if " = " not in line:
        return None
    name, rest = line.split(" = ", 1)
    rest = _COMMENT.sub("", rest)
    if rest.startswith("("):
        end = _matching_paren(rest, 0) + 1
    else:
        end = rest.index(" ")
    shape = parse_shape(rest[:end])
    rest = rest[end:].lstrip()
    open_paren = rest.index("(")
    opcode = rest[:open_paren]
    close_paren = _matching_paren(rest, open_paren)
    operand_text = rest[open_paren + 1:close_paren]
    # Older XLA prints "f32[2]{0} %x" as an operand; the name is the last word.
    operands = tuple(part.split()[-1].lstrip("%") for part in _split_top_level(operand_text)
                     if part.strip())
    return Instruction(name=name.lstrip("%"), shape=shape, opcode=opcode,
                       operands=operands, attributes=rest[close_paren + 1:])


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for char in text:
        if char in "({[":
            depth += 1
        elif char in ")}]":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return parts


@functools.lru_cache(maxsize=1)
def parse_computations(hlo_text: str) -> tuple[dict[str, list[Instruction]], str | None]:
    """Computations by name, and the entry computation's name.

    The last program's parse is kept: a compile report reads the same HLO text with every function below
    (CompileReport.from_compiled), and parsing is most of each one's time (a 1B step's 1.7 MB of text:
    0.1 s a parse). The result is shared, so read it and never change it."""
    computations: dict[str, list[Instruction]] = {}
    entry = None
    current: list[Instruction] | None = None
    for line in hlo_text.splitlines():
        if current is None:
            stripped = line.strip()
            if stripped.endswith("{") and not line.startswith((" ", "HloModule")):
                is_entry = stripped.startswith("ENTRY ")
                name = stripped.removeprefix("ENTRY ").split()[0].lstrip("%")
                current = computations.setdefault(name, [])
                if is_entry:
                    entry = name
            continue
        if line.startswith("}"):
            current = None
            continue
        try:
            instruction = _parse_instruction(line)
        except ValueError:
            # A line in a form this reader does not know: the traffic estimate
            # is worth less than a planner that stops over it.
            instruction = None
        if instruction is not None:
            current.append(instruction)
    return computations, entry


def _called_computations(instruction: Instruction) -> list[str]:
    names = []
    for key in _CALLED.get(instruction.opcode, ()):
        match = re.search(rf"\b{key}=(\{{[^}}]*\}}|%?[\w.\-]+)", instruction.attributes)
        if match:
            value = match.group(1).strip("{}")
            names.extend(part.strip().lstrip("%") for part in value.split(",") if part.strip())
    return names


@dataclasses.dataclass(frozen=True)
class HostTraffic:
    """Bytes moved between device and host memory in one execution (per device)."""

    device_to_host_bytes: int
    host_to_device_bytes: int
    async_transfers: int        # static count of async start instructions moving host data
    sync_transfers: int         # static count of synchronous ones
    unknown_trip_counts: int    # while loops counted once because XLA gave no trip count
    conditional_host_to_device_bytes: int = 0   # of host_to_device_bytes: inside a conditional's branch


def _transfer_bytes(instruction: Instruction, shapes: dict[str, Shape]) -> tuple[int, int]:
    """(device->host, host->device) bytes one execution of ``instruction`` moves."""
    if instruction.opcode == "copy-start":
        # copy-start's shape is (destination, source, context).
        destination, source = instruction.shape[0], instruction.shape[1]
        destination_arrays, source_arrays = _arrays(destination), _arrays(source)
        to_host = sum(d.nbytes for d, s in zip(destination_arrays, source_arrays)
                      if d.on_host and not s.on_host)
        to_device = sum(d.nbytes for d, s in zip(destination_arrays, source_arrays)
                        if s.on_host and not d.on_host)
        return to_host, to_device
    if instruction.opcode.endswith("-start") and isinstance(instruction.shape, tuple):
        # fusion-start / async-start: ((operands...), result, context).
        operand_arrays = _arrays(instruction.shape[0])
        result_arrays = _arrays(instruction.shape[1])
    else:
        operand_arrays = [array for name in instruction.operands if name in shapes
                          for array in _arrays(shapes[name])]
        result_arrays = _arrays(instruction.shape)
    reads_host = any(array.on_host for array in operand_arrays)
    writes_host = any(array.on_host for array in result_arrays)
    # Scalars are loop indices and offsets, not payload.
    device_operand_bytes = sum(array.nbytes for array in operand_arrays
                               if not array.on_host and array.dims)
    device_result_bytes = sum(array.nbytes for array in result_arrays if not array.on_host)
    to_host = device_operand_bytes if writes_host else 0
    to_device = device_result_bytes if reads_host else 0
    return to_host, to_device


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _op_name(instruction: Instruction) -> str:
    """JAX's metadata op_name of an instruction, "" when XLA made the instruction up."""
    found = _OP_NAME.search(instruction.attributes)
    return found.group(1) if found else ""


@dataclasses.dataclass(frozen=True)
class HostTransfer:
    """One instruction that moves data between device and host memory, and how often it runs."""

    computation: str
    instruction: str
    opcode: str
    op_name: str                # JAX's metadata op_name ("" when XLA made the instruction up)
    runs: int                   # executions per run of the program (product of enclosing trip counts)
    device_to_host_bytes: int   # per execution
    host_to_device_bytes: int
    in_conditional: bool = False   # inside a conditional's branch (counted as if every branch ran)


def host_transfers(hlo_text: str) -> tuple[list[HostTransfer], int]:
    """Every host<->device transfer instruction reached from the entry computation, and the number of
    while loops without a known trip count (each counted as one trip)."""
    computations, entry = parse_computations(hlo_text)
    found: list[HostTransfer] = []
    unknown = 0
    if entry is None:
        return found, 0

    def visit(computation: str, multiplier: int, depth: int, branch: bool = False) -> None:
        nonlocal unknown
        if depth > 64 or computation not in computations:
            return
        instructions = computations[computation]
        shapes = {instruction.name: instruction.shape for instruction in instructions}
        for instruction in instructions:
            if instruction.opcode in _CALLED:
                inner = multiplier
                if instruction.opcode == "while":
                    trip = _TRIP_COUNT.search(instruction.attributes)
                    if trip:
                        inner = multiplier * int(trip.group(1))
                    else:
                        unknown += 1
                for called in _called_computations(instruction):
                    visit(called, inner, depth + 1, branch or instruction.opcode == "conditional")
                continue
            if instruction.opcode in _NOT_TRANSFERS:
                continue
            to_host, to_device = _transfer_bytes(instruction, shapes)
            if to_host or to_device:
                found.append(HostTransfer(computation, instruction.name, instruction.opcode,
                                          _op_name(instruction), multiplier, to_host, to_device, branch))

    visit(entry, 1, 0)
    return found, unknown


def host_traffic(hlo_text: str) -> HostTraffic:
    """Estimate the host<->device bytes one run of a compiled program moves."""
    transfers, unknown = host_transfers(hlo_text)
    static = {(t.computation, t.instruction): t.opcode for t in transfers}
    asynchronous = sum(opcode.endswith("-start") for opcode in static.values())
    return HostTraffic(device_to_host_bytes=sum(t.device_to_host_bytes * t.runs for t in transfers),
                       host_to_device_bytes=sum(t.host_to_device_bytes * t.runs for t in transfers),
                       async_transfers=asynchronous, sync_transfers=len(static) - asynchronous,
                       unknown_trip_counts=unknown,
                       conditional_host_to_device_bytes=sum(t.host_to_device_bytes * t.runs for t in transfers
                                                            if t.in_conditional))


# A host dynamic-slice (dynamic-update-slice) that XLA's GPU compiler can address as "offset + loop iteration x
# stride" carries this in its backend config and runs as a DMA memcpy; without it, as a kernel.
_DMA_SLICE = "dynamic_slice_config"


def _dma_slice_computations(computations: dict[str, list[Instruction]]) -> set[str]:
    """The computations holding a slice XLA addresses from a loop counter (`_DMA_SLICE`): the wrapped
    computations of host slices a GPU moves as memcpys."""
    return {name for name, instructions in computations.items()
            if any(_DMA_SLICE in i.attributes for i in instructions)}


def _moved_by_kernel(instruction: Instruction, dma_slices: set[str]) -> bool:
    """Whether an async host transfer's start is a kernel reading or writing host memory: a fusion-start whose
    wrapped slice XLA could not address from a loop counter. Not a copy-start (a memcpy), a fusion-start whose
    slice it could, nor any other start (a host computation's custom-call-start: the host CPU's work)."""
    return instruction.opcode == "fusion-start" and not any(
        name in dma_slices for name in _FUSED.findall(instruction.attributes))


@dataclasses.dataclass(frozen=True)
class HostCopyEngines:
    """Host<->device bytes of one program run (per device, both directions) by what moves them on a GPU."""

    dma_bytes: int      # every async move but the kernels below: copy-start/done, host slices XLA addresses from
                        # the loop counter (memcpys, copy engines), a host computation's result
    kernel_bytes: int   # other host slices: a kernel whose threads read or write pinned host memory over PCIe
    sync_bytes: int     # synchronous moves (neither async start nor done)

    @property
    def kernel_fraction(self) -> float:
        moved = self.dma_bytes + self.kernel_bytes + self.sync_bytes
        return self.kernel_bytes / moved if moved else 0.0


def host_copy_engines(hlo_text: str) -> HostCopyEngines:
    """Which host<->device moves of a compiled GPU program are DMA memcpys and which are kernels.

    XLA's GPU compiler makes a dynamic-slice of a host (S(5)) buffer, and a
    dynamic-update-slice into one, an async fusion. Where the offset is an
    affine function of a while loop's counter (the loop's own induction
    variable, or a counter carried from 0 by 1) it records the offset as
    "byte_offset + iteration x byte_stride" (``dynamic_slice_config``) and the
    runtime issues a memcpy; otherwise (an index from a scan's ``xs``, a
    clamped or parity-dependent offset, a constant offset outside a loop) the
    fusion is a kernel whose threads move the row over PCIe
    (docs/DESIGN.md section 6: a memcpy is a copy engine's work, a kernel
    takes SMs as compute does). Read from the compiled HLO text: the slice in
    the async start's called computation carries the config or not (its root
    in jaxlib 0.11 and 0.12; in 0.10 the root is a copy of it). Loop bodies
    are weighted by their trip counts, as in `host_traffic`.
    """
    computations, _ = parse_computations(hlo_text)
    dma_slices = _dma_slice_computations(computations)
    by_name = {(computation, i.name): i for computation, instructions in computations.items() for i in instructions}
    dma = kernel = sync = 0
    for transfer in host_transfers(hlo_text)[0]:
        moved = (transfer.device_to_host_bytes + transfer.host_to_device_bytes) * transfer.runs
        if not transfer.opcode.endswith("-start"):
            sync += moved
        elif _moved_by_kernel(by_name[(transfer.computation, transfer.instruction)], dma_slices):
            kernel += moved
        else:
            dma += moved
    return HostCopyEngines(dma_bytes=dma, kernel_bytes=kernel, sync_bytes=sync)


FORWARD, BACKWARD, OTHER = "forward", "backward", "other"
# The deferred update with grad_accum > 1 (recipes/train/accumulate_in_forward.py) runs its first micro-batch,
# which takes the update, apart from the others, and traces those others under LATER_MICRO_BATCHES_SCOPE
# (layers/names.py): their passes are LATER_FORWARD and LATER_BACKWARD, so that the planner prices the
# update's copies beside one micro-batch's compute, not all of them. Kinds a program has none of are absent from the dicts below.
LATER_FORWARD, LATER_BACKWARD = "later_forward", "later_backward"


def autodiff_pass(op_name: str) -> str:
    """FORWARD, BACKWARD or OTHER: where JAX's autodiff put the operation an instruction came from; LATER_FORWARD
    or LATER_BACKWARD for the passes of micro-batches traced under LATER_MICRO_BATCHES_SCOPE.

    JAX names what it traces under differentiation ``.../jvp(...)/...`` and the
    transposed (backward) computation ``.../transpose(jvp(...))/...``. Anything
    else (the optimizer update, gradient sums between micro-batches, copies
    XLA made up and left without a name) is OTHER.
    """
    if "transpose(jvp(" in op_name:
        kind = BACKWARD
    elif "jvp(" in op_name:
        kind = FORWARD
    else:
        return OTHER
    later = LATER_MICRO_BATCHES_SCOPE in op_name.split("/")
    return {FORWARD: LATER_FORWARD, BACKWARD: LATER_BACKWARD}[kind] if later else kind


def traffic_by_pass(hlo_text: str) -> dict[str, dict[str, int]]:
    """{pass: {"device_to_host_bytes", "host_to_device_bytes"}} per `autodiff_pass`, one program run."""
    totals = {kind: {"device_to_host_bytes": 0, "host_to_device_bytes": 0} for kind in (FORWARD, BACKWARD, OTHER)}
    for transfer in host_transfers(hlo_text)[0]:
        kind = totals.setdefault(autodiff_pass(transfer.op_name),
                                 {"device_to_host_bytes": 0, "host_to_device_bytes": 0})
        kind["device_to_host_bytes"] += transfer.device_to_host_bytes * transfer.runs
        kind["host_to_device_bytes"] += transfer.host_to_device_bytes * transfer.runs
    return totals


def count_host_memory_annotations(hlo_text: str) -> int:
    """How many shapes in the HLO are in host memory (``S(5)``): the offload ground truth.

    Counts mentions, not distinct allocations: a host buffer threaded through a
    loop is counted at every instruction that names it.
    """
    return hlo_text.count(HOST_MEMORY_SPACE)


@dataclasses.dataclass(frozen=True)
class CopyOverlap:
    """How much of the async host traffic runs in both link directions at once (per device, one execution)."""

    host_to_device_bytes: int     # async host->device copies (start/done windows)
    device_to_host_bytes: int     # async device->host copies
    overlapped_bytes: int         # bytes each direction moves while the other is also moving (see below)
    overlapping_pairs: int        # static count of (host->device, device->host) windows in flight together
    # overlapped_bytes split by `autodiff_pass` (forward, backward, other) of the copies that overlap
    overlapped_by_pass: dict[str, int] = dataclasses.field(default_factory=dict)


def overlapping_host_copies(hlo_text: str) -> CopyOverlap:
    """Async host<->device copies whose start..done windows overlap in opposite directions.

    In scheduled HLO each computation's instructions are printed in the
    order they run, so an async copy is in flight from its ``*-start`` to the
    ``*-done`` that names it. In every computation (loop bodies weighted by
    their trip count, as in `host_traffic`), windows are grouped into runs that
    overlap in time; in a run holding both directions the smaller
    direction's bytes are credited as ``overlapped_bytes`` (they move while
    the other direction moves too). The link time of the copies is then about
    (host_to_device + device_to_host - overlapped) / per-direction rate;
    without any overlap it is the plain sum. Each run's overlapped bytes are
    attributed to the autodiff pass (`autodiff_pass`) of its largest copy, so
    that the planner credits them to the phase they happen in.
    """
    computations, entry = parse_computations(hlo_text)
    totals = {"h2d": 0, "d2h": 0, "overlapped": 0, "pairs": 0}
    by_pass = {FORWARD: 0, BACKWARD: 0, OTHER: 0}
    if entry is None:
        return CopyOverlap(0, 0, 0, 0, by_pass)
    counted_pairs: set[str] = set()

    def windows_of(instructions: list[Instruction]) -> list[tuple[int, int, int, int, str]]:
        """(start index, done index, device->host bytes, host->device bytes, pass) per async transfer."""
        shapes = {instruction.name: instruction.shape for instruction in instructions}
        started: dict[str, tuple[int, int, int, str]] = {}
        windows = []
        for index, instruction in enumerate(instructions):
            if instruction.opcode.endswith("-start") and instruction.opcode not in _NOT_TRANSFERS:
                to_host, to_device = _transfer_bytes(instruction, shapes)
                if to_host or to_device:
                    started[instruction.name] = (index, to_host, to_device, autodiff_pass(_op_name(instruction)))
            elif instruction.opcode.endswith("-done") and instruction.operands \
                    and instruction.operands[0] in started:
                begin, to_host, to_device, kind = started.pop(instruction.operands[0])
                windows.append((begin, index, to_host, to_device, kind))
        return windows

    def visit(computation: str, multiplier: int, depth: int) -> None:
        if depth > 64 or computation not in computations:
            return
        instructions = computations[computation]
        for instruction in instructions:
            if instruction.opcode in _CALLED:
                inner = multiplier
                if instruction.opcode == "while":
                    trip = _TRIP_COUNT.search(instruction.attributes)
                    inner = multiplier * int(trip.group(1)) if trip else multiplier
                for called in _called_computations(instruction):
                    visit(called, inner, depth + 1)
        windows = sorted(windows_of(instructions))
        # Runs of windows that overlap one another, in schedule order.
        runs: list[list[tuple[int, int, int, int, str]]] = []
        for window in windows:
            if runs and window[0] < max(w[1] for w in runs[-1]):
                runs[-1].append(window)
            else:
                runs.append([window])
        for run in runs:
            to_host = sum(w[2] for w in run)
            to_device = sum(w[3] for w in run)
            totals["h2d"] += to_device * multiplier
            totals["d2h"] += to_host * multiplier
            totals["overlapped"] += min(to_host, to_device) * multiplier
            if min(to_host, to_device):
                largest = max(run, key=lambda w: w[2] + w[3])
                by_pass[largest[4]] = by_pass.get(largest[4], 0) + min(to_host, to_device) * multiplier
        if computation not in counted_pairs:
            counted_pairs.add(computation)
            totals["pairs"] += sum(1 for a in windows for b in windows
                                   if a[3] and not a[2] and b[2] and not b[3] and a[0] < b[1] and b[0] < a[1])

    visit(entry, 1, 0)
    return CopyOverlap(host_to_device_bytes=totals["h2d"], device_to_host_bytes=totals["d2h"],
                       overlapped_bytes=totals["overlapped"], overlapping_pairs=totals["pairs"],
                       overlapped_by_pass=by_pass)


@dataclasses.dataclass(frozen=True)
class DeviceArray:
    """One device-memory array an instruction of the program produces (a buffer XLA must place in HBM)."""
    computation: str
    instruction: str
    opcode: str
    nbytes: int
    dims: tuple[int, ...]


def largest_device_arrays(hlo_text: str, count: int = 5) -> list[DeviceArray]:
    """The `count` largest device-memory (not S(5)) arrays produced in the program, largest first.

    Walks the entry computation and what it calls (while bodies, calls,
    branches), not the inside of fusions: each instruction's result is a
    buffer (or a bitcast/tuple view of one, which can only repeat a size), so
    no HBM buffer of the program is larger than the first of these. An upper
    bound per buffer, not a peak: it says nothing about how many are live at once.
    """
    computations, entry = parse_computations(hlo_text)
    found: list[DeviceArray] = []
    visited: set[str] = set()

    def visit(computation: str, depth: int) -> None:
        if depth > 64 or computation in visited or computation not in computations:
            return
        visited.add(computation)
        for instruction in computations[computation]:
            for called in _called_computations(instruction):
                visit(called, depth + 1)
            for array in _arrays(instruction.shape):
                if not array.on_host and array.dtype != "token":
                    found.append(DeviceArray(computation, instruction.name, instruction.opcode,
                                             array.nbytes, array.dims))

    if entry is not None:
        visit(entry, 0)
    return sorted(found, key=lambda a: -a.nbytes)[:count]


_FUSED = re.compile(r"\bcalls=%?([\w.\-]+)")
_COMPUTE_TARGETS = ("cublas", "cudnn", "triton")   # custom-call targets that run matmuls or attention


@dataclasses.dataclass(frozen=True)
class CopiesBesideCompute:
    """Async host<->device copies (both directions, bytes per run of the program) per `autodiff_pass`: all of
    them, and those whose start..done window in the schedule holds compute (`host_copies_beside_compute`)."""

    moved_by_pass: dict[str, int]
    beside_compute_by_pass: dict[str, int]

    def hidden_fraction(self, kind: str) -> float:
        """The share of pass `kind`'s async copy bytes scheduled beside compute (0 when it moves none)."""
        moved = self.moved_by_pass.get(kind, 0)
        return self.beside_compute_by_pass.get(kind, 0) / moved if moved else 0.0


def host_copies_beside_compute(hlo_text: str) -> CopiesBesideCompute:
    """Which async host copies the compiled schedule runs while the GPU computes.

    In scheduled HLO an async copy is in flight from its ``*-start`` to its
    ``*-done``; the GPU computes beside it when an instruction that multiplies
    matrices runs between the two in the same computation: a fusion whose
    fused computation holds a ``dot`` or ``convolution``, a cuBLAS, cuDNN or
    Triton custom call, or a loop or call whose body holds one (the blockwise
    attention's loop). A copy with nothing of that kind inside its window waits
    on its own or beside elementwise work only (the optimizer's maths) and
    hides under nothing worth counting. Nor does a copy a GPU moves with a
    kernel (`host_copy_engines`): it takes the SMs the matmuls need, and on the
    H200 the update in the next forward pass, whose rows are all such kernels
    scheduled across the layers' matmuls, hid none of them (BENCHMARKS.md
    2026-12-04); it counts as moved, never as beside compute. Loop bodies are
    weighted by their trip counts, as in `host_traffic`.
    """
    computations, entry = parse_computations(hlo_text)
    moved = {FORWARD: 0, BACKWARD: 0, OTHER: 0}
    beside = {FORWARD: 0, BACKWARD: 0, OTHER: 0}
    if entry is None:
        return CopiesBesideCompute(moved, beside)
    dma_slices = _dma_slice_computations(computations)
    computes: dict[str, bool] = {}

    def holds_compute(computation: str, depth: int = 0) -> bool:
        if computation not in computes:
            computes[computation] = False   # a cycle or a deep nest counts as none
            if depth <= 64:
                computes[computation] = any(is_compute(i, depth + 1) for i in computations.get(computation, ()))
        return computes[computation]

    def is_compute(instruction: Instruction, depth: int = 0) -> bool:
        if instruction.opcode in ("dot", "convolution"):
            return True
        if instruction.opcode == "custom-call":
            return any(target in instruction.attributes for target in _COMPUTE_TARGETS)
        if instruction.opcode in ("fusion", "fusion-start"):
            fused = _FUSED.search(instruction.attributes)
            return "gemm" in instruction.name or bool(fused and holds_compute(fused.group(1), depth))
        if instruction.opcode in _CALLED:
            return any(holds_compute(called, depth) for called in _called_computations(instruction))
        return False

    def visit(computation: str, multiplier: int, depth: int) -> None:
        if depth > 64 or computation not in computations:
            return
        instructions = computations[computation]
        shapes = {instruction.name: instruction.shape for instruction in instructions}
        started: dict[str, tuple[int, int, str, bool]] = {}
        compute_at = [k for k, instruction in enumerate(instructions) if is_compute(instruction)]
        for index, instruction in enumerate(instructions):
            if instruction.opcode in _CALLED:
                trip = _TRIP_COUNT.search(instruction.attributes) if instruction.opcode == "while" else None
                for called in _called_computations(instruction):
                    visit(called, multiplier * (int(trip.group(1)) if trip else 1), depth + 1)
            elif instruction.opcode.endswith("-start") and instruction.opcode not in _NOT_TRANSFERS:
                to_host, to_device = _transfer_bytes(instruction, shapes)
                if to_host or to_device:
                    started[instruction.name] = (index, to_host + to_device, autodiff_pass(_op_name(instruction)),
                                                 _moved_by_kernel(instruction, dma_slices))
            elif instruction.opcode.endswith("-done") and instruction.operands and instruction.operands[0] in started:
                begin, nbytes, kind, by_kernel = started.pop(instruction.operands[0])
                moved[kind] = moved.get(kind, 0) + nbytes * multiplier
                beside.setdefault(kind, 0)
                if not by_kernel and any(begin < k < index for k in compute_at):
                    beside[kind] += nbytes * multiplier

    visit(entry, 1, 0)
    return CopiesBesideCompute(moved, beside)
