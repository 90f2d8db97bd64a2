"""Host-resident optimizer state on a real accelerator that has it: one TPU v5e chip (15.7 GiB of HBM), the
only accelerator lent to some sessions. The same train steps as the GPU suite (benchmarks/gpu_suite.py
measure_case: the recipe's own jitted step, random tokens, median step time, peak HBM), sized for
its HBM, with the process's host peak (benchmarks/resident_peak.py) beside host_memory's prediction:

- Llama 3.2 1B's layers cut to 4 (506 M parameters): its AdamW state fits HBM, so the state on device,
  in pinned host memory updated after the backward pass, and the block layers' state in host memory
  updated in the next forward pass are timed side by side at 8 micro-batches (the tokens/s ratio is the
  cost of host state);
- cut to 8 layers (749 M): the device-state step needs more than the chip's HBM (XLA refuses it at
  compile); with the state in host memory it trains;
- the whole Llama 3.2 1B (1.24 B): its host-state step ran the machine's 40 GiB of host RAM out
  (BENCHMARKS.md, "On a TPU"), kept for a machine with more.

    python -m benchmarks.tpu_offload [--cases NAME,...] [--out rows.json]

Each case runs in its own process (its peak alone; one process at a time holds the chip). The MFU is
against v5e's published bf16 peak, 197 TFLOP/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from benchmarks.gpu_suite import Case, measure_case, run_child

V5E_PEAK_BF16_FLOPS = 197e12
SEQ_LEN = 4096
PENDING_IN_HBM = "offload.pending_gradients=device"
EIGHT_LAYERS = ("model.num_layers=8",)
GA8 = dict(seq_len=SEQ_LEN, global_batch=8, grad_accum=8)

CASES = {
    "1b_8layers/device/ga8": Case("llama3_1b", "recompute_all", "device", overrides=EIGHT_LAYERS, **GA8),
    "1b_8layers/host/ga8": Case("llama3_1b", "recompute_all", "host", overrides=EIGHT_LAYERS, **GA8),
    "1b_8layers/host_layers_in_fwd_hbm/ga8": Case("llama3_1b", "recompute_all", "host:8",
                                                  overrides=EIGHT_LAYERS + (PENDING_IN_HBM,),
                                                  update="next_forward", **GA8),
    "1b_8layers/split4/ga8": Case("llama3_1b", "recompute_all", "host:4", overrides=EIGHT_LAYERS, **GA8),
    **{f"1b_4layers/{name}/ga8": Case("llama3_1b", "recompute_all", state, overrides=("model.num_layers=4",) + extra,
                                      update=update, **GA8)
       for name, state, extra, update in (("device", "device", (), "after_backward"),
                                          ("host", "host", (), "after_backward"),
                                          ("host_layers_in_fwd_hbm", "host:4", (PENDING_IN_HBM,), "next_forward"))},
    "1b/device/ga8": Case("llama3_1b", "recompute_all", "device", **GA8),
    "1b/host/ga8": Case("llama3_1b", "recompute_all", "host", **GA8),
    "1b/host_layers_in_fwd_hbm/ga8": Case("llama3_1b", "recompute_all", "host:16", overrides=(PENDING_IN_HBM,),
                                          update="next_forward", **GA8),
}
CASE_TIMEOUT_S = 240.0


def render(rows: list[dict]) -> str:
    """A markdown table; each row's tokens/s also as a ratio of its size's device-state row."""
    device_rate = {row["case"].split("/")[0]: row["tokens_per_s"] for row in rows
                   if "/device/" in row["case"] and "tokens_per_s" in row}
    lines = ["| case | step s | tokens/s | vs device state | MFU | peak HBM GiB | host peak GiB | host predicted GiB "
             "| compile s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['case']} | {row['error']}: {row.get('detail', '')[:120]} | | | | | | | |")
            continue
        base = device_rate.get(row["case"].split("/")[0])
        ratio = f"{row['tokens_per_s'] / base:.3f}" if base else "-"
        mfu = row["tokens_per_s"] * row["flops_per_token"] / V5E_PEAK_BF16_FLOPS
        peak = row["peak_bytes_in_use"] / 2**30 if row.get("peak_bytes_in_use") else float("nan")
        host_peak = (row.get("host_resident_peak_bytes") or float("nan")) / 2**30
        predicted = row.get("host_predicted_step_bytes", float("nan")) / 2**30
        lines.append(f"| {row['case']} | {row['step_s']:.3f} | {row['tokens_per_s']:.0f} | {ratio} | {mfu:.1%} | "
                     f"{peak:.2f} | {host_peak:.2f} | {predicted:.2f} | {row['compile_s']:.0f} |")
    return "\n".join(lines)


def measure_child(name: str) -> dict:
    """measure_case's row, with the FLOPs of a token and host_memory's prediction of the step's host bytes
    above the process's own (recipes/train/host_memory.phases_of_recipe, from shapes)."""
    from spillway.models.flops import model_flops_per_token
    from spillway.recipes.registry import get_recipe
    from spillway.recipes.train.host_memory import phases_of_recipe
    from benchmarks.gpu_suite import case_overrides

    case = CASES[name]
    row = measure_case(name, case=case)
    recipe = get_recipe(case.recipe, case_overrides(case))
    phases = phases_of_recipe(recipe)
    return {**row, "flops_per_token": model_flops_per_token(recipe.decoder_spec(), case.seq_len),
            "host_predicted_step_bytes": phases.by_phase()["step"] - phases.footprint}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated cases (default: all)")
    ap.add_argument("--out", help="also write the measured rows (JSON) here")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure_child(args.child)), flush=True)
        return 0
    names = args.cases.split(",")
    if unknown := [name for name in names if name not in CASES]:
        ap.error(f"unknown case(s) {', '.join(unknown)}; the cases are: {', '.join(CASES)}")
    rows = []
    for name in names:
        start = time.perf_counter()
        row = run_child(name, CASE_TIMEOUT_S, module="benchmarks.tpu_offload")
        print(f"{name}: {time.perf_counter() - start:.0f} s, {json.dumps(row)[:600]}", flush=True)
        rows.append(row)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
    print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
