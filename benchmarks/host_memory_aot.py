"""Host memory of each program a run with host-resident state executes, compiled for a GPU without one.

    .venv/bin/python -m benchmarks.host_memory_aot                  # table, Llama of 8 layers, H200
    .venv/bin/python -m benchmarks.host_memory_aot --json --set model.num_layers=4

On CPU every memory is the same RAM, so what a GPU run keeps in pinned host
memory can only be read from a deviceless GPU compile (docs/DESIGN.md section
5): `memory_analysis()` reports the host arguments, outputs, aliased bytes
and temporaries of each program separately. Programs, per configuration:

  init      Optimizer.init (jit, out_shardings = the state's): the state is
            created in host memory; host temp says whether a whole copy is
            made beside it
  step      the train step: host alias = host arguments means the new state
            is written over the old one (the state is donated)
  flush     offload.update=next_forward only: the pending update applied
  join      Optimizer.saved_form (checkpoint save): the halved state joined
  split     Optimizer.from_saved_form (restore): back into halves
  step, pending donated   (next_forward) the deferred step with the pending
            gradients donated too: can they be written over the old ones?

Runs in a compile process (recipes/plan/subprocess_runner.py); prints one JSON
document with --json.
"""

from __future__ import annotations

import argparse
import sys

from spillway.recipes.plan.subprocess_runner import prepare_compile_process, serve_compile_process
from spillway.recipes.targets import DEFAULT_GPU

CONFIGS = {
    "host": ["offload.optimizer_state=host"],
    "host_next_forward": ["offload.optimizer_state=host", "offload.update=next_forward"],
    "host_bf16": ["offload.optimizer_state=host", "execution.dtype=bfloat16", "execution.param_dtype=bfloat16"],
}
MODEL = ["model.vocab_size=32000", "model.d_model=512", "model.num_layers=8", "model.num_heads=8",
         "model.num_kv_heads=8", "model.mlp_hidden=2048", "model.max_seq_len=64", "data.seq_len=64",
         "train.global_batch=2", "train.steps=100", "train.eval_every=0", "optimizer.warmup_steps=1"]
FIELDS = ("host_argument_bytes", "host_output_bytes", "host_alias_bytes", "host_temp_bytes", "hbm_bytes",
          "temp_bytes")


def _report(jitted, *args) -> dict:
    from spillway.recipes.plan import compile as aot
    from spillway.recipes.plan import hlo
    report = aot.compile_report(jitted, *args, keep_hlo_text=True)
    copies = sum(1 for line in report.hlo_text.splitlines() if " copy-start(" in line or " copy(" in line)
    return {**{field: getattr(report, field) for field in FIELDS}, "copies": copies,
            "device_to_host_bytes": report.device_to_host_bytes, "host_to_device_bytes": report.host_to_device_bytes,
            "host_buffers": hlo.count_host_memory_annotations(report.hlo_text)}


def compile_config(config: str, extra: list[str], target: str) -> dict:
    import jax

    from spillway.recipes.plan import compile as aot
    from spillway.recipes.registry import get_recipe
    from spillway.recipes.optim.host_streaming import tree_nbytes_by_memory_kind
    from spillway.recipes.train.step import abstract_setup, abstract_step_arguments, abstract_with_shardings

    recipe = get_recipe("tiny", MODEL + CONFIGS[config] + list(extra))
    mesh = aot.compile_only_mesh(target, {"data": 1, "fsdp": 1, "tensor": 1})
    s = abstract_setup(recipe, mesh, platform="cuda")
    arguments = abstract_step_arguments(s)
    opt_state = arguments[1]
    rows = {"init": _report(jax.jit(s.optimizer.init, out_shardings=s.opt_state_shardings), s.params),
            "step": _report(s.train_step, *arguments)}
    if s.defers_update:
        rows["flush"] = _report(s.flush, *arguments[:3])
        # Can the new pending gradients be written over the old? The same step with them donated too.
        from spillway.recipes.optim import update_in_forward
        from spillway.recipes.train.step import make_objective
        objective = make_objective(s.graphdef, recipe.train.loss_chunk, mesh, recipe.aux_loss)
        donated = jax.jit(update_in_forward.make_train_step(objective, s.optimizer),
                          in_shardings=(s.param_shardings, s.opt_state_shardings, s.pending_shardings,
                                        s.batch_sharding),
                          out_shardings=(s.param_shardings, s.opt_state_shardings, s.pending_shardings, None),
                          donate_argnums=(0, 1, 2))
        rows["step, pending donated"] = _report(donated, *arguments)
    saved = jax.eval_shape(s.optimizer.saved_form, opt_state)
    saved_sh = jax.tree.map(lambda leaf: leaf.sharding, s.optimizer.saved_abstract_state(s.params,
                                                                                         s.param_shardings))
    rows["join"] = _report(jax.jit(s.optimizer.saved_form, out_shardings=saved_sh), opt_state)
    rows["split"] = _report(jax.jit(s.optimizer.from_saved_form, out_shardings=s.opt_state_shardings),
                            abstract_with_shardings(saved, saved_sh))
    state_bytes = tree_nbytes_by_memory_kind(opt_state).get("pinned_host", 0)
    param_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(s.params))
    pending_bytes = tree_nbytes_by_memory_kind(arguments[2]).get("pinned_host", 0) if s.defers_update else 0
    return {"config": config, "state_host_bytes": state_bytes, "param_bytes": param_bytes,
            "pending_host_bytes": pending_bytes, "programs": rows}


def measure(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_GPU)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--set", nargs="*", default=[])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    prepare_compile_process()
    import jax
    return {"jax": jax.__version__, "target": args.target,
            "configs": {c: compile_config(c, args.set, args.target) for c in args.configs.split(",") if c}}


def print_table(result: dict) -> None:
    mib = 2**20
    print(f"jax {result['jax']}, {result['target']} deviceless; MiB per GPU")
    print(f"{'config':18s} {'program':7s} " + " ".join(f"{f.removesuffix('_bytes'):>13s}" for f in FIELDS))
    for config, row in result["configs"].items():
        for program, r in row["programs"].items():
            print(f"{config:18s} {program:7s} " + " ".join(f"{r[f] / mib:13.1f}" for f in FIELDS)
                  + f"  D->H {r['device_to_host_bytes'] / mib:.1f} H->D {r['host_to_device_bytes'] / mib:.1f}")
        print(f"{config:18s} state in host memory {row['state_host_bytes'] / mib:.1f} MiB, pending gradients "
              f"{row['pending_host_bytes'] / mib:.1f} MiB, parameters {row['param_bytes'] / mib:.1f} MiB")


if __name__ == "__main__":
    if "--json" in sys.argv[1:]:
        serve_compile_process(measure)
    print_table(measure(sys.argv[1:]))
