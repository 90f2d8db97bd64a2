"""What each XLA setting of recipes/train/xla_settings.py does to the train step, compiled for an H200 without one.

    .venv/bin/python -m benchmarks.xla_settings_effect            # table (a compile per variant)
    .venv/bin/python -m benchmarks.xla_settings_effect --json

A 66M-parameter Llama (8 layers of d_model 512, 4096 tokens per step), its
optimizer state in host memory and its MLP outputs and attention context
offloaded (offload_dots), so the step has host copies both ways. Per variant:
HBM and host temp (buffer assignment), host traffic, the bytes moved in one
link direction while the other is busy too, and the host copies whose
start..done window spans a matmul or convolution fusion (the copies that overlap
compute in the schedule).
"""

from __future__ import annotations

import argparse
import sys

from spillway.recipes.plan.subprocess_runner import prepare_compile_process, serve_compile_process
from spillway.recipes.targets import DEFAULT_GPU

MODEL = ["model.vocab_size=32000", "model.d_model=512", "model.num_layers=8", "model.num_heads=8",
         "model.num_kv_heads=8", "model.mlp_hidden=2048", "model.max_seq_len=1024", "data.seq_len=1024",
         "train.global_batch=4", "train.steps=100", "optimizer.warmup_steps=1", "execution.dtype=bfloat16",
         "execution.param_dtype=bfloat16", "execution.attention_impl=flash", "offload.optimizer_state=host",
         "offload.activations=offload_dots"]
FLAGS = ("xla_gpu_enable_latency_hiding_scheduler", "xla_gpu_enable_highest_priority_async_stream",
         "xla_gpu_enable_host_memory_offloading", "xla_gpu_enable_while_loop_double_buffering")


def copies_across_compute(hlo_text: str) -> tuple[int, int]:
    """(host copies whose async window spans a dot/convolution/custom-call fusion, all async host copies)."""
    in_flight: dict[str, bool] = {}
    spanned = total = 0
    for line in hlo_text.splitlines():
        line = line.strip()
        if "=" not in line:
            continue
        name = line.split("=")[0].strip().removeprefix("ROOT ").lstrip("%")
        is_host = "S(5)" in line
        if ("copy-start(" in line or "-start(" in line and "slice" in line) and is_host:
            in_flight[name] = False
        elif "-done(" in line:
            operand = line.split("-done(")[1].split(")")[0].split(",")[0].strip().lstrip("%")
            if operand in in_flight:
                total += 1
                spanned += in_flight.pop(operand)
        elif any(kind in line for kind in ("kind=kCustom", "custom-call(", "convolution(", " dot(")):
            for key in in_flight:
                in_flight[key] = True
    return spanned, total


def measure(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_GPU)
    parser.add_argument("--set", nargs="*", default=[])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    prepare_compile_process()
    import jax

    from spillway.recipes.plan import compile as aot
    from spillway.recipes.plan import hlo
    from spillway.recipes.plan.toolchain import compiler_options
    from spillway.recipes.registry import get_recipe
    from spillway.recipes.train.step import abstract_setup, abstract_step_arguments

    recipe = get_recipe("tiny", MODEL + list(args.set))
    mesh = aot.compile_only_mesh(args.target, {"data": 1, "fsdp": 1, "tensor": 1})
    s = abstract_setup(recipe, mesh, platform="cuda")
    lowered = s.train_step.lower(*abstract_step_arguments(s))
    off = {flag: False for flag in FLAGS}
    variants = {"all off": off, **{f"{flag} only": {**off, flag: True} for flag in FLAGS},
                "xla_settings.STEP_OPTIONS": None}
    rows = {}
    for name, options in variants.items():
        from spillway.recipes.train.xla_settings import STEP_OPTIONS
        chosen = {**off, **STEP_OPTIONS} if options is None else options
        try:
            compiled = lowered.compile(compiler_options={**(compiler_options() or {}), **chosen})
        except Exception as error:   # an option this jaxlib refuses: say so and go on
            rows[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
            continue
        report = aot.CompileReport.from_compiled(compiled, keep_hlo_text=True)
        spanned, total = copies_across_compute(report.hlo_text)
        rows[name] = {"hbm_bytes": report.hbm_bytes, "host_temp_bytes": report.host_temp_bytes,
                      "device_to_host_bytes": report.device_to_host_bytes,
                      "host_to_device_bytes": report.host_to_device_bytes,
                      "overlapped_bytes": report.overlapped_transfer_bytes,
                      "copies_across_compute": spanned, "host_copies": total,
                      "fusions": report.hlo_text.count(" fusion("),
                      "host_buffers": hlo.count_host_memory_annotations(report.hlo_text)}
    return {"jax": jax.__version__, "target": args.target, "rows": rows}


def print_table(result: dict) -> None:
    mib = 2**20
    print(f"jax {result['jax']}, {result['target']} deviceless; MiB per GPU")
    print(f"{'variant':55s} {'HBM':>8s} {'host temp':>9s} {'D->H':>8s} {'H->D':>8s} {'both dirs':>9s} "
          f"{'copies over compute':>19s} {'fusions':>7s}")
    for name, r in result["rows"].items():
        if "error" in r:
            print(f"{name:55s} FAILED: {r['error']}")
            continue
        print(f"{name:55s} {r['hbm_bytes'] / mib:8.1f} {r['host_temp_bytes'] / mib:9.1f} "
              f"{r['device_to_host_bytes'] / mib:8.1f} {r['host_to_device_bytes'] / mib:8.1f} "
              f"{r['overlapped_bytes'] / mib:9.1f} {r['copies_across_compute']:>10d} of {r['host_copies']:<5d} "
              f"{r['fusions']:7d}")


if __name__ == "__main__":
    if "--json" in sys.argv[1:]:
        serve_compile_process(measure)
    print_table(measure(sys.argv[1:]))
