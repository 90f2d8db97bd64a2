"""Peak resident memory per phase of a CPU training run, optimizer state on device vs in host memory.

    .venv/bin/python -m benchmarks.host_memory_phases            # the table (a few minutes on 2 cores)
    .venv/bin/python -m benchmarks.host_memory_phases --json     # the same as JSON

On CPU every memory kind is the same RAM, so a run with its optimizer state in
"host" memory should need no more RAM than one with it on device; where it does,
the difference is a copy the host path makes and the device path does not, and on
a GPU machine that copy is host RAM too. Each configuration runs in its own
process (peaks of one never mix with another's), and a second process per
configuration restores the checkpoint the first one wrote, as a resumed run
does.

A phase's peak is the resident-set high-water mark (VmHWM of /proc/self/status)
reached during the phase, after writing "5" to /proc/self/clear_refs at its
start (which resets the mark to the current RSS). `live` is the RSS when the
phase ends. Linux only.

Phases, in the order the train loop runs them (recipes/train/loop.py):
  start-up   JAX imported and its CPU backend started
  model      the model built in its shards (step.setup)
  state      the optimizer state created (Optimizer.init; with
             offload.update=next_forward also the empty pending update)
  compile    the train step lowered and compiled
  step       STEPS train steps
  flush      (next_forward) the pending update applied, as before a checkpoint
  save       an async checkpoint save of params and the state's saved form,
             waited for
and in the restoring process: start-up, model (the setup with its targets only,
step.setup(initialise=False): a resume initialises no weights), then
  restore    what a resume does: every saved leaf read a piece at a time
             straight into its target's parts (recipes/train/checkpoint_read.py)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CONFIGS = {
    "device": ["offload.optimizer_state=device"],
    "host": ["offload.optimizer_state=host"],
    "host_next_forward": ["offload.optimizer_state=host", "offload.update=next_forward"],
}
# A small-but-not-tiny float32 Llama: 66M parameters, 265 MB of weights, 530 MB of Adam moments.
MODEL = ["model.vocab_size=32000", "model.d_model=512", "model.num_layers=8", "model.num_heads=8",
         "model.num_kv_heads=8", "model.mlp_hidden=2048", "model.max_seq_len=64", "data.seq_len=64",
         "train.global_batch=2", "train.steps=100", "train.eval_every=0", "optimizer.warmup_steps=1"]
STEPS = 3


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class PhaseMeter:
    """Per-phase resident-set peaks of this process (bytes)."""

    def __init__(self):
        self.rows: list[dict] = []

    def phase(self, name: str):
        meter = self

        class _Phase:
            def __enter__(self):
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")   # VmHWM := VmRSS
                self.start_rss = _status_kib("VmRSS") * 1024
                self.t0 = time.perf_counter()
                return self

            def __exit__(self, *exc):
                if exc[0] is None:
                    meter.rows.append({"phase": name, "start_bytes": self.start_rss,
                                       "peak_bytes": _status_kib("VmHWM") * 1024,
                                       "live_bytes": _status_kib("VmRSS") * 1024,
                                       "seconds": time.perf_counter() - self.t0})
        return _Phase()


def _recipe(config: str, extra: list[str]):
    from spillway.recipes.registry import get_recipe
    return get_recipe("tiny", MODEL + CONFIGS[config] + list(extra))


def _child(config: str, role: str, checkpoint_dir: str, extra: list[str]) -> dict:
    meter = PhaseMeter()
    with meter.phase("start-up"):
        import jax
        import jax.numpy as jnp
        import numpy as np
        jax.block_until_ready(jnp.zeros(()))
    from spillway.layers.mesh import MeshConfig
    from spillway.layers.sharding import make_mesh
    from spillway.recipes.train.batch import Batch
    from spillway.recipes.train.checkpoint import RunCheckpointer
    from spillway.recipes.train.step import setup

    recipe = _recipe(config, extra)
    mesh = make_mesh(MeshConfig(1, 1, 1))
    with meter.phase("model"):
        # a resume initialises no weights: it restores into the setup's targets (recipes/train/run_state.py)
        s = setup(recipe, mesh, initialise=role != "restore")
        params = s.params if role == "restore" else jax.block_until_ready(s.params)
    checkpointer = RunCheckpointer(checkpoint_dir, keep=2, every_steps=1000, async_save=True)
    if role == "restore":
        with meter.phase("restore"):
            from spillway.recipes.train import host_memory
            params, opt_state = host_memory.restore_state(checkpointer, s, params)
            jax.block_until_ready((params, opt_state))
        kinds = sorted({leaf.sharding.memory_kind for leaf in jax.tree.leaves(opt_state)})
        checkpointer.close()
        return {"config": config, "role": role, "phases": meter.rows, "restored_memory_kinds": kinds}

    with meter.phase("state"):
        opt_state = jax.block_until_ready(jax.jit(s.optimizer.init, out_shardings=s.opt_state_shardings)(params))
        pending = jax.block_until_ready(s.nothing_pending(params))
    rng = np.random.default_rng(0)

    def batch():
        tokens = rng.integers(0, recipe.model.vocab_size, (recipe.train.global_batch, recipe.data.seq_len + 1))
        return Batch(jax.device_put(np.asarray(tokens, np.int32), s.batch_sharding))

    args = (params, opt_state, pending, batch())
    with meter.phase("compile"):
        s.train_step.lower(*args).compile()
    with meter.phase("step"):
        for _ in range(STEPS):
            params, opt_state, pending, metrics = s.train_step(params, opt_state, pending, batch())
            jax.block_until_ready(metrics)
        jax.block_until_ready((params, opt_state))
    if s.defers_update:
        with meter.phase("flush"):
            params, opt_state, pending = jax.block_until_ready(s.flush(params, opt_state, pending))
    with meter.phase("save"):
        checkpointer.save(STEPS, params=params, opt_state=s.optimizer.saved_form(opt_state), loader_state={},
                          meta={"step": STEPS}, recipe_json=recipe.to_json(), force=True)
        checkpointer.wait()
    checkpointer.close()
    state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(opt_state))
    return {"config": config, "role": role, "phases": meter.rows, "params": recipe.num_params(),
            "param_bytes": sum(leaf.nbytes for leaf in jax.tree.leaves(params)), "state_bytes": state_bytes}


def run_config(config: str, role: str, checkpoint_dir: str, extra: list[str]) -> dict:
    """One configuration's phases, measured in a fresh process (one CPU device, no forced device count)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    command = [sys.executable, "-m", "benchmarks.host_memory_phases", "--child", config, "--role", role,
               "--checkpoint-dir", checkpoint_dir] + (["--set", *extra] if extra else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{config}/{role} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(configs: list[str], extra: list[str]) -> dict:
    results = {}
    with tempfile.TemporaryDirectory(prefix="host-memory-phases-") as tmp:
        for config in configs:
            checkpoint_dir = os.path.join(tmp, config)
            main = run_config(config, "main", checkpoint_dir, extra)
            restored = run_config(config, "restore", checkpoint_dir, extra)
            results[config] = {"main": main, "restore": restored}
    return results


def table(results: dict) -> str:
    configs = list(results)
    phases: list[str] = []
    for config in configs:
        for role in ("main", "restore"):
            for row in results[config][role]["phases"]:
                name = row["phase"] if role == "main" or row["phase"] == "restore" else f"{row['phase']} (restoring)"
                if name not in phases:
                    phases.append(name)

    def row_of(config, phase):
        role = "restore" if phase == "restore" or phase.endswith("(restoring)") else "main"
        name = phase.removesuffix(" (restoring)")
        return next((r for r in results[config][role]["phases"] if r["phase"] == name), None)

    gb = 1e9
    head = "| phase | " + " | ".join(f"{c}: peak / live GB" for c in configs) + " |"
    lines = [head, "|---" * (len(configs) + 1) + "|"]
    for phase in phases:
        cells = []
        for config in configs:
            r = row_of(config, phase)
            cells.append("-" if r is None else f"{r['peak_bytes'] / gb:.2f} / {r['live_bytes'] / gb:.2f}")
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    peaks = {c: max(r["peak_bytes"] for role in ("main", "restore") for r in results[c][role]["phases"])
             for c in configs}
    lines.append("| **run peak** | " + " | ".join(f"**{peaks[c] / gb:.2f}**" for c in configs) + " |")
    if "device" in peaks:
        ratios = ", ".join(f"{c} {peaks[c] / peaks['device']:.2f}x" for c in configs if c != "device")
        lines.append(f"\nrun peak against the state on device: {ratios}")
    first = results[configs[0]]["main"]
    lines.append(f"model: {first['params'] / 1e6:.1f}M float32 parameters ({first['param_bytes'] / gb:.2f} GB); "
                 f"optimizer state {first['state_bytes'] / gb:.2f} GB; {STEPS} steps")
    for c in configs:
        kinds = results[c]["restore"].get("restored_memory_kinds")
        lines.append(f"{c}: restored optimizer state memory kinds {kinds}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {list(CONFIGS)}")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--set", nargs="*", default=[], help="extra recipe overrides (a.b=value)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.role, args.checkpoint_dir, args.set)))
        return
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; known: {list(CONFIGS)}")
    results = measure(configs, args.set)
    print(json.dumps(results, indent=1) if args.json else table(results))


if __name__ == "__main__":
    main()
