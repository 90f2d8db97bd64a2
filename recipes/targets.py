"""GPU targets for deviceless compiles, as data, and the planning defaults train and plan share.

Imports nothing (of this project or outside the standard library): `recipes/config.py`,
`recipes/train/` and `recipes/plan/` all read it.

A ``GpuTarget`` holds two kinds of facts about one GPU:

* the device description XLA's GPU compiler needs to compile for it without the
  GPU being present (the ``stream_executor.GpuTargetConfigProto`` text returned by
  ``GpuTarget.target_config_text``): SM count, shared memory, L2, clocks, compute
  capability and, importantly, ``device_memory_size``, from which XLA derives the
  memory limit its scheduler and rematerialisation work against;
* the numbers the planner uses to judge a compiled program: HBM capacity and
  bandwidth, the link to host memory, peak dense bf16 FLOP/s and a default
  amount of host RAM per GPU.

Sources. Device descriptions follow openxla/xla's
``xla/backends/gpu/target_config/specs/*.txtpb`` (h100_sxm, h200, a100_sxm_80,
b200), minus fields the jaxlib 0.10.2 plugin's proto rejects
(``collective_memory_granularity``) and the optional per-dtype unit-rate tables.
XLA has no GH200 spec; ours is the H100 SXM one with the GH200's memory (see its
notes). FLOP/s and bandwidths are NVIDIA datasheet figures, dense (no 2:4
sparsity): H100 SXM and H200 989 TFLOP/s bf16 (1979 is the sparse figure),
GH200 989, A100 312, B200 2.25 PFLOP/s (HGX B200: 18 PFLOP/s dense bf16 per 8
GPUs), L4 121 (242 sparse), L40S 362 (733 sparse), GeForce RTX 4080 97.5
(bf16 with float32 accumulation, 194.9 sparse: NVIDIA's "Ada GPU Architecture"
whitepaper, appendix A; GeForce parts run float32-accumulating tensor math at
half their float16-accumulating rate). L4, L40S and RTX 4080 (Ada, sm_89,
GDDR6/GDDR6X memory that the fields still call HBM) have no XLA spec: their
descriptions are written from the datasheets and say so in their notes. ``hbm_bytes`` is the memory CUDA reports as the device total (what
XLA's specs record), a little under the marketing figure.

Host links, stated assumptions, per direction, for transfer-time estimates:
PCIe Gen5 x16 is 64 GB/s raw, about 55 GB/s in pinned-memory copies (H100, H200,
B200 HGX hosts); PCIe Gen4 x16 about 25 GB/s (A100 HGX, L4, L40S); GH200's NVLink-C2C
is 900 GB/s bidirectional, 450 GB/s per direction; the RTX 4080 is a PCIe Gen4 x16 card. On HGX boards two GPUs often
share one PCIe switch uplink to the CPU; when both offload at once each gets
about half.

A target whose plugin compile fails is kept in ``UNSUPPORTED_TARGETS`` with the
reason, so asking for it says why rather than "unknown GPU".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

GB = 10**9
MiB = 2**20

# The planning target of a recipe that names none (`spillway plan --gpu`, `train --plan auto`).
DEFAULT_GPU = "h200"
# The fraction of a GPU's HBM a plan may use (`spillway plan --headroom`), and so the fraction training
# lets JAX's GPU allocator reserve (recipes/train/gpu_allocators.py): a plan that fits must fit there.
HBM_HEADROOM = 0.9


@dataclasses.dataclass(frozen=True)
class GpuDeviceFacts:
    """The hardware description XLA's GPU compiler reads (GpuDeviceInfoProto fields)."""

    core_count: int                    # streaming multiprocessors
    fpus_per_core: int
    shared_memory_per_core: int        # bytes per SM
    shared_memory_per_block_optin: int
    l2_cache_bytes: int
    clock_rate_ghz: float              # SM boost clock
    memory_clock_khz: int              # only shown in model_str
    # What XLA's spec files put in pcie_bandwidth (they record 32 GiB/s for
    # H100/H200, 64 GiB/s for B200, nothing for A100). We keep their value; the
    # planner uses GpuTarget.host_link_bytes_per_s instead.
    compiler_pcie_bandwidth: int | None = None
    accelerated_features: bool = False  # sm_90a / sm_100a ("a" = arch-specific features)
    threads_per_core_limit: int = 2048  # resident threads per SM: 1536 on sm_86 / sm_89


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One GPU model: its compiler description and the numbers the planner compares against."""

    name: str                       # the key users type: "h100"
    display_name: str               # "H100 SXM 80GB"
    device_name: str                # what CUDA reports; compiled devices show it as device_kind
    compute_capability: tuple[int, int]
    hbm_bytes: int                  # device memory as CUDA reports it (XLA's device_memory_size)
    hbm_bandwidth: float            # bytes/s
    host_link: str                  # "PCIe Gen5 x16"
    host_link_bytes_per_s: float    # effective, per direction
    peak_bf16_flops: float          # dense
    default_host_ram_bytes: int     # per GPU
    facts: GpuDeviceFacts
    notes: str = ""
    # Whether a copy to host memory and one from it move at once, each at the per-direction rate. The
    # compiled schedule often has both in flight (a streamed layer's write-back beside the next one's fetch),
    # but on the one GPU measured (H200, jax 0.11.2, BENCHMARKS.md 2026-12-04) a streamed update's extra step
    # time was both directions' bytes added at that rate: they take turns. No target claims otherwise until
    # a GPU run shows it; the planner then prices the bytes moved both ways at once once, not twice.
    host_link_duplex: bool = False

    @property
    def sm_version(self) -> str:
        """ptxas's name for the architecture: sm_90a, sm_80, sm_100a."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}" + ("a" if self.facts.accelerated_features else "")

    @property
    def target_config_text(self) -> str:
        """The GpuTargetConfigProto text handed to the plugin's topology factory."""
        facts = self.facts
        major, minor = self.compute_capability
        suffix = "a" if facts.accelerated_features else ""
        extension = "ACCELERATED_FEATURES" if facts.accelerated_features else "NONE"
        minor_line = f"\n    minor: {minor}" if minor else ""
        pcie_line = (f"\n  pcie_bandwidth: {facts.compiler_pcie_bandwidth}"
                     if facts.compiler_pcie_bandwidth else "")
        clock_khz = round(facts.clock_rate_ghz * 1e6)
        model = (f"sm_{major}.{minor}{suffix} with {self.hbm_bytes}B RAM, {facts.core_count} cores, "
                 f"{clock_khz}KHz clock, {facts.memory_clock_khz}KHz mem clock, "
                 f"{facts.l2_cache_bytes}B L2$")
        # The fixed limits below hold for every target here (sm_80 and newer).
        return f"""\
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {facts.shared_memory_per_core}
  threads_per_core_limit: {facts.threads_per_core_limit}
  core_count: {facts.core_count}
  fpus_per_core: {facts.fpus_per_core}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.hbm_bandwidth)}
  l2_cache_size: {facts.l2_cache_bytes}
  clock_rate_ghz: {facts.clock_rate_ghz}
  device_memory_size: {self.hbm_bytes}
  shared_memory_per_block_optin: {facts.shared_memory_per_block_optin}
  cuda_compute_capability {{
    major: {major}{minor_line}
    feature_extension: {extension}
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation"
  platform_version: "Compute Capability {major}.{minor}{suffix}"
  model_str: "{model}"
  device_address_bits: 64{pcie_line}
  ecc_enabled: true
  name: "{self.device_name}"
  driver_version: "13.0.0"
  runtime_version: "13.0.0"
  compile_time_toolkit_version: "13.0.0"
  dnn_version: "9.10.0"
  cub_version: "3.1.2"
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 10
  patch: 0
}}
device_description_str: "{self.device_name}"
"""


_HOPPER_SM = GpuDeviceFacts(
    core_count=132, fpus_per_core=128, shared_memory_per_core=233472,
    shared_memory_per_block_optin=232448, l2_cache_bytes=52428800, clock_rate_ghz=1.98,
    memory_clock_khz=2619000, compiler_pcie_bandwidth=34359738368, accelerated_features=True)

_PCIE_GEN5_X16 = 55 * GB
_PCIE_GEN4_X16 = 25 * GB
# Ada (sm_89) SMs: 128 FP32 lanes, 1536 resident threads, 100 KB of shared
# memory per SM (99 KB opt-in per block), as NVIDIA's Ada tuning guide gives them.
_ADA_SM = GpuDeviceFacts(
    core_count=0, fpus_per_core=128, shared_memory_per_core=102400,
    shared_memory_per_block_optin=101376, l2_cache_bytes=0, clock_rate_ghz=0.0,
    memory_clock_khz=0, threads_per_core_limit=1536)
_ADA_NOTES = ("XLA ships no spec for this GPU: the device description is written from NVIDIA's "
              "datasheet and Ada tuning guide (SM count, clocks, L2, shared memory, 1536 threads per SM) "
              "in the form of XLA's specs; hbm_bytes is the memory nvidia-smi reports (CUDA's total is a "
              "little lower, so HBM limits here are slightly generous). GDDR6 memory, not HBM.")
_PER_GPU_OF_2TB_HGX_NODE = 256 * GB   # DGX/HGX H100, H200, B200: 2 TB for 8 GPUs

TARGETS: dict[str, GpuTarget] = {
    "h100": GpuTarget(
        name="h100", display_name="H100 SXM 80GB", device_name="NVIDIA H100 80GB HBM3",
        compute_capability=(9, 0), hbm_bytes=84942979072, hbm_bandwidth=3.35232e12,
        host_link="PCIe Gen5 x16", host_link_bytes_per_s=_PCIE_GEN5_X16,
        peak_bf16_flops=989e12, default_host_ram_bytes=_PER_GPU_OF_2TB_HGX_NODE,
        facts=_HOPPER_SM),
    "h200": GpuTarget(
        name="h200", display_name="H200 SXM 141GB", device_name="NVIDIA H200 141GB HBM3e",
        compute_capability=(9, 0), hbm_bytes=151397597184, hbm_bandwidth=4.8e12,
        host_link="PCIe Gen5 x16", host_link_bytes_per_s=_PCIE_GEN5_X16,
        peak_bf16_flops=989e12, default_host_ram_bytes=_PER_GPU_OF_2TB_HGX_NODE,
        facts=dataclasses.replace(_HOPPER_SM, memory_clock_khz=3750000)),
    "gh200-96gb": GpuTarget(
        name="gh200-96gb", display_name="GH200 Grace Hopper 96GB HBM3",
        device_name="NVIDIA GH200 480GB",
        compute_capability=(9, 0),
        # nvidia-smi shows 97871 MiB; CUDA reports 551 MiB less than nvidia-smi on
        # an H100 80GB (81008 vs 81559 MiB), assumed the same here: 97320 MiB.
        hbm_bytes=97320 * MiB, hbm_bandwidth=4.0e12,
        host_link="NVLink-C2C", host_link_bytes_per_s=450 * GB,
        peak_bf16_flops=989e12, default_host_ram_bytes=480 * GB,
        facts=_HOPPER_SM,
        notes=("The 96 GB HBM3 GH200 (CUDA names it 'NVIDIA GH200 480GB' after its "
               "480 GB LPDDR5X). Same H100 die as the SXM part (132 SMs); no XLA spec "
               "exists, so the H100 SXM one with this memory is used. Some systems "
               "fit 120 GB LPDDR5X per superchip: set host RAM in the recipe.")),
    "a100": GpuTarget(
        name="a100", display_name="A100 SXM 80GB", device_name="NVIDIA A100-SXM4-80GB",
        compute_capability=(8, 0), hbm_bytes=85100068864, hbm_bandwidth=2.03904e12,
        host_link="PCIe Gen4 x16", host_link_bytes_per_s=25 * GB,
        peak_bf16_flops=312e12, default_host_ram_bytes=128 * GB,   # DGX A100: 1 TB / 8 GPUs
        facts=GpuDeviceFacts(
            core_count=108, fpus_per_core=64, shared_memory_per_core=167936,
            shared_memory_per_block_optin=166912, l2_cache_bytes=41943040,
            clock_rate_ghz=1.41, memory_clock_khz=1593000)),
    "b200": GpuTarget(
        name="b200", display_name="B200 180GB", device_name="NVIDIA B200",
        compute_capability=(10, 0), hbm_bytes=191514411008, hbm_bandwidth=7.67232e12,
        host_link="PCIe Gen5 x16", host_link_bytes_per_s=_PCIE_GEN5_X16,
        peak_bf16_flops=2.25e15, default_host_ram_bytes=_PER_GPU_OF_2TB_HGX_NODE,
        facts=GpuDeviceFacts(
            core_count=148, fpus_per_core=128, shared_memory_per_core=233472,
            shared_memory_per_block_optin=232448, l2_cache_bytes=132644864,
            clock_rate_ghz=1.965, memory_clock_khz=3996000,
            compiler_pcie_bandwidth=68719476736, accelerated_features=True)),
    "l4": GpuTarget(
        name="l4", display_name="L4 24GB", device_name="NVIDIA L4",
        compute_capability=(8, 9), hbm_bytes=23034 * MiB, hbm_bandwidth=300e9,
        host_link="PCIe Gen4 x16", host_link_bytes_per_s=_PCIE_GEN4_X16,
        peak_bf16_flops=121e12,   # datasheet: 242 TFLOPS bf16 with 2:4 sparsity
        default_host_ram_bytes=96 * GB,   # AWS g6.48xlarge: 768 GB for 8 L4
        facts=dataclasses.replace(_ADA_SM, core_count=58, l2_cache_bytes=48 * MiB, clock_rate_ghz=2.04,
                                  memory_clock_khz=6251000),
        notes=_ADA_NOTES),
    # A 16 GB GPU for LoRA on an 8B (recipes/registry.py llama3_8b_lora_16gb). The Ada whitepaper's
    # appendix A: AD103, 76 SMs, boost 2505 MHz, 64 MB L2, 16 GB GDDR6X at 22.4 Gbps on 256 bits (716.8 GB/s).
    "rtx4080": GpuTarget(
        name="rtx4080", display_name="RTX 4080 16GB", device_name="NVIDIA GeForce RTX 4080",
        compute_capability=(8, 9),
        # 16 GiB on the card less the 551 MiB CUDA reports below nvidia-smi on an H100 80GB (assumed the same,
        # as for the GH200): 15833 MiB. Not measured on a 4080.
        hbm_bytes=(16384 - 551) * MiB, hbm_bandwidth=716.8e9,
        host_link="PCIe Gen4 x16", host_link_bytes_per_s=_PCIE_GEN4_X16,
        peak_bf16_flops=97.5e12,  # whitepaper: bf16 tensor with fp32 accumulate, dense (194.9 with 2:4 sparsity)
        default_host_ram_bytes=64 * GB,   # a workstation's 64 GB: our assumption, no cloud shape to read
        facts=dataclasses.replace(_ADA_SM, core_count=76, l2_cache_bytes=64 * MiB, clock_rate_ghz=2.505,
                                  memory_clock_khz=11200000),
        notes=_ADA_NOTES.replace("hbm_bytes is the memory nvidia-smi reports (CUDA's total is a little lower, "
                                 "so HBM limits here are slightly generous)",
                                 "hbm_bytes is the card's 16 GiB less CUDA's reserve as measured on an H100")),
    "l40s": GpuTarget(
        name="l40s", display_name="L40S 48GB", device_name="NVIDIA L40S",
        compute_capability=(8, 9), hbm_bytes=46068 * MiB, hbm_bandwidth=864e9,
        host_link="PCIe Gen4 x16", host_link_bytes_per_s=_PCIE_GEN4_X16,
        peak_bf16_flops=362e12,   # datasheet: 362.05 dense, 733 with 2:4 sparsity
        default_host_ram_bytes=192 * GB,  # AWS g6e.48xlarge: 1536 GB for 8 L40S
        facts=dataclasses.replace(_ADA_SM, core_count=142, l2_cache_bytes=96 * MiB, clock_rate_ghz=2.52,
                                  memory_clock_khz=9001000),
        notes=_ADA_NOTES),
}

# Targets tried and found not to compile, with the reason (name -> reason).
UNSUPPORTED_TARGETS: dict[str, str] = {
    "v100": ("Volta (sm_70) cannot be compiled for with the CUDA 13 toolchain the jax-cuda13 "
             "plugin uses: XLA stops with 'ptxas too old' (ptxas 13 dropped sm_70) and there "
             "is no CUDA driver to fall back to on a machine without a GPU"),
}

# Other spellings users type.
ALIASES: Mapping[str, str] = {
    "h100-sxm": "h100", "h100-80gb": "h100",
    "h200-141gb": "h200",
    "gh200": "gh200-96gb",
    "a100-80gb": "a100", "a100-sxm": "a100",
    "b200-180gb": "b200",
    "l4-24gb": "l4", "l40s-48gb": "l40s",
    "rtx-4080": "rtx4080", "4080": "rtx4080",
}


def target_for_device_kind(device_kind: str) -> GpuTarget | None:
    """The target whose GPU family a runtime `device.device_kind` names ("NVIDIA H200" -> h200), or None.

    Families are the display name's words up to the first holding a digit ("H200", "RTX 4080"), matched
    longest first, so "GH200" is not taken for "H200" nor "L40S" for "L4".
    """
    by_family = sorted(TARGETS.values(), key=lambda t: -len(_family(t)))
    return next((t for t in by_family if _family(t) in device_kind), None)


def _family(target: GpuTarget) -> str:
    """The display name's words up to the first with a digit: "H100 SXM 80GB" -> "H100", "RTX 4080 16GB" ->
    "RTX 4080" (one word would take every RTX for the first one listed)."""
    words = target.display_name.split()
    count = next((i + 1 for i, word in enumerate(words) if any(ch.isdigit() for ch in word)), 1)
    return " ".join(words[:count])


def target_names() -> list[str]:
    """Names of the targets that compile."""
    return sorted(TARGETS)


def get_target(name: str | GpuTarget) -> GpuTarget:
    """The target called ``name`` (case-insensitive, aliases allowed).

    Raises ValueError naming the known targets for an unknown name, and the reason
    for a known but unsupported one.
    """
    if isinstance(name, GpuTarget):
        return name
    key = name.strip().lower().replace("_", "-")
    key = ALIASES.get(key, key)
    if key in TARGETS:
        return TARGETS[key]
    if key in UNSUPPORTED_TARGETS:
        raise ValueError(f"GPU target {name!r} is not supported: {UNSUPPORTED_TARGETS[key]}")
    known = ", ".join(target_names())
    raise ValueError(f"unknown GPU target {name!r}; known targets: {known}"
                     + (f" (aliases: {', '.join(sorted(ALIASES))})" if ALIASES else ""))
