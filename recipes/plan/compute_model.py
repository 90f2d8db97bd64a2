"""The planner's compute time: counted FLOPs at the efficiency measured on a GPU for the attention kernel run.

Counted FLOPs at the GPU's peak dense bf16 rate are a lower bound that the one
GPU this project has touched was far from: on one H200 (jax 0.11.2,
BENCHMARKS.md "On a GPU", 2026-11-30) the Llama 3.2 1B step at 8,192 tokens
took 2.1x the peak-rate figure with cuDNN's fused attention and 5-7x with the
blockwise JAX attention (layers/flash_attention.py). So the planner prices
compute at the fraction of peak that the kernel the run will use reached there
(`EFFICIENCY`), and says which figures are measured and which assumed.

Only the H200 has been measured; other GPUs are assumed to reach the same
fraction of their own peak with the same kernels. The fraction grows with
the model: on 2026-12-04 (BENCHMARKS.md) at 8 micro-batches of 8,192 tokens
the 1B step took 1547.3 ms against this model's 1619.9 (48.8% of peak) and
the 3B shape's 3700.0 against 4300.6 (54.2%); the table keeps the 1B's
figure, the conservative one, until a larger model (the 8B) is measured. The FLOPs are the
planner's count for the blockwise kernel (models/flops.py: masked halves
of diagonal blocks and the backward's recomputed scores included), which is
also what the measured fractions were taken against, cuDNN's included (the
planner compiles cuDNN plans as blockwise ones, docs/DESIGN.md section 5).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Achieved FLOP/s over peak dense bf16 FLOP/s for one attention kernel."""
    fraction: float
    measured: bool
    source: str

    def describe(self, attention_impl: str) -> str:
        how = "measured" if self.measured else "assumed"
        return f"{self.fraction:.1%} of peak ({how}, {attention_impl} attention: {self.source})"


EFFICIENCY: dict[str, Efficiency] = {
    # 93.1 ms of counted FLOPs at peak, 199.8 ms measured (1b/recompute_all/device/cudnn).
    "cudnn": Efficiency(93.1 / 199.8, True, "Llama 3.2 1B, recompute_all, 8,192 tokens, one H200: 199.8 ms against "
                                            "93.1 ms at peak"),
    # 93.1 -> 716.2 ms (recompute_all) and 77.0 -> 547.8 ms (save_all): 0.130 and 0.141; their mean.
    "flash": Efficiency((93.1 / 716.2 + 77.0 / 547.8) / 2, True,
                        "Llama 3.2 1B, recompute_all and save_all, 8,192 tokens, one H200: 716.2 and 547.8 ms "
                        "against 93.1 and 77.0 ms at peak"),
    # Dense attention materialises the scores; nothing measured. Assumed no better than the blockwise kernel.
    "xla": Efficiency((93.1 / 716.2 + 77.0 / 547.8) / 2, False, "not measured; taken as the blockwise kernel's"),
}


def efficiency(attention_impl: str) -> Efficiency:
    """The efficiency the planner prices compute at for a run with `attention_impl`."""
    try:
        return EFFICIENCY[attention_impl]
    except KeyError:
        raise ValueError(f"no compute efficiency for attention_impl {attention_impl!r}; "
                         f"known: {sorted(EFFICIENCY)}") from None


def peak_flops(target, compute_dtype: str) -> tuple[float, str]:
    """(the dense peak FLOP/s a step's matmuls run at, its name): the GPU's bf16 peak for bfloat16 and float16
    compute; for float32 compute TF32's, half the bf16 rate on every GPU in recipes/targets.py (XLA computes a
    float32 matmul in TF32 at JAX's default precision). The efficiencies above were measured in bfloat16; a
    float32 run is assumed to reach the same fraction of its own peak."""
    if str(compute_dtype) == "float32":
        return target.peak_bf16_flops / 2, "tf32 (float32 compute)"
    return target.peak_bf16_flops, "bf16"


def effective_flops_per_s(peak_flops_per_s: float, attention_impl: str) -> float:
    """The FLOP/s a step's counted FLOPs are divided by."""
    return peak_flops_per_s * efficiency(attention_impl).fraction
