"""The host peak (VmHWM) of a checkpoint save and a restore of host-resident state, beside the prediction.

The GPU suite's checkpoint case (benchmarks/gpu_suite.py runs it at the end with the time left): a train
setup with its optimizer state in pinned host memory, its state created, then one save (the mode the run
would pick, recipes/train/host_memory.check_run, or --mode) and one restore as a resume does (in a
process of its own, which never held the state; --restore-in same-process: after the save), each
measured as the rise of the process's resident high-water mark over what it held before (VmHWM reset
through /proc/self/clear_refs; sampled where /proc has no VmHWM: benchmarks/resident_peak.py), beside
host_memory's prediction of that phase above the live state.

    python -m benchmarks.checkpoint_host_peak                                    # the GPU case: Llama 3.2 1B (llama3_1b)
    python -m benchmarks.checkpoint_host_peak --recipe tiny --set model.d_model=96 --mode pieces   # CPU-sized
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time

from benchmarks.resident_peak import ResidentPeak

GiB = 2**30


def timed_piece_taking() -> dict:
    """Wraps the save's piece taking (checkpoint_io._piece) to add up its seconds: what of the save is taking
    pieces out of the state, and what is tensorstore compressing and writing them."""
    from spillway.recipes.train import checkpoint_io
    totals, take = {"seconds": 0.0, "pieces": 0}, checkpoint_io._piece

    def timed(shard, index):
        start = time.perf_counter()
        try:
            return take(shard, index)
        finally:
            totals["seconds"] += time.perf_counter() - start
            totals["pieces"] += 1
    checkpoint_io._piece = timed
    return totals


def measure(recipe_name: str, overrides: list[str], mode: str = "auto") -> dict:
    """{"save_rise_bytes", "restore_rise_bytes", predicted ..., "mode", seconds}: one save and one restore,
    in this process (the restore after the saved state is deleted)."""
    with tempfile.TemporaryDirectory() as directory:
        saved = save_phase(recipe_name, overrides, mode, directory)
        restored = restore_phase(recipe_name, overrides, directory, initialised=True)
    return merged(saved, restored, "same process")


def measure_in_new_processes(recipe_name: str, overrides: list[str], mode: str = "auto",
                             child_flags: tuple[str, ...] = ()) -> dict:
    """The same row from two processes, one saving and one restoring: the restore as a resume meets it, in a
    process that never held the state. A runtime that keeps a freed host buffer in its pool (the TPU's; a
    GPU's pinned host allocator too) makes a restore after a save in one process count both."""
    import subprocess
    with tempfile.TemporaryDirectory() as directory:
        rows = []
        for phase in ("save", "restore"):
            command = [sys.executable, "-m", "benchmarks.checkpoint_host_peak", "--phase", phase, "--dir", directory,
                       "--recipe", recipe_name, "--mode", mode, *(f"--set={o}" for o in overrides), *child_flags]
            done = subprocess.run(command, stdout=subprocess.PIPE, text=True)   # stderr: the child's own
            if done.returncode != 0:
                raise SystemExit(f"checkpoint host peak: the {phase} process failed (exit {done.returncode})")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return merged(*rows, "a new process")


def _setup(recipe_name: str, overrides: list[str], initialise: bool):
    from spillway.layers.sharding import make_mesh
    from spillway.recipes.registry import get_recipe
    from spillway.recipes.train import step as step_lib
    recipe = get_recipe(recipe_name, ["offload.optimizer_state=host", *overrides])
    return step_lib.setup(recipe, make_mesh(recipe.mesh), initialise=initialise)


def save_phase(recipe_name: str, overrides: list[str], mode: str, directory: str) -> dict:
    """A train setup's state created as the loop creates it, then one save into `directory`, measured."""
    import jax

    from spillway.recipes.train import host_memory, piece_take
    from spillway.recipes.train.checkpoint import RunCheckpointer
    from spillway.recipes.train.xla_settings import GPU_PLATFORMS

    resident = ResidentPeak()   # started first: where /proc keeps no VmHWM it samples from here on
    s = _setup(recipe_name, overrides, initialise=True)
    # created as the train loop creates it (recipes/train/run_state.py): one jitted program writing the
    # state where its shardings place it, not eager ops staging it
    opt_state = jax.block_until_ready(jax.jit(s.optimizer.init, out_shardings=s.opt_state_shardings)(s.params))
    phases = host_memory.phases_of(s, gpu=jax.default_backend() in GPU_PLATFORMS)
    # auto: what the train loop picks (host_memory.check_run): orbax's whole save where it fits the RAM
    in_pieces = mode == "pieces" or (mode == "auto" and not phases.whole_save_fits(host_memory_ram()))
    phases = dataclasses.replace(phases, save_in_pieces=in_pieces)
    by_phase, live = phases.by_phase(), phases.weights + phases.state + phases.pending
    taking = timed_piece_taking()
    ckpt = RunCheckpointer(directory, keep=1, every_steps=1, async_save=True, save_in_pieces=in_pieces)
    resettable = resident.reset()
    before, t0 = resident.peak(), time.perf_counter()
    ckpt.save(1, params=s.params, opt_state=opt_state, loader_state={}, meta={"step": 1}, recipe_json="{}",
              force=True)
    ckpt.wait()
    save_rise, save_s = resident.peak() - before, time.perf_counter() - t0
    ckpt.close()
    print(f"saved in {save_s:.1f} s; restoring", file=sys.stderr, flush=True)
    return {"recipe": recipe_name, "overrides": overrides, "backend": jax.default_backend(),
            "mode": "pieces" if in_pieces else "whole", "state_bytes": phases.state, "vmhwm_reset": resettable,
            "resident_source": resident.source, "saved_sums": leaf_sums(opt_state),
            "save_rise_bytes": save_rise, "save_predicted_rise_bytes": by_phase["checkpoint save"] - phases.footprint
            - live, "save_s": round(save_s, 2),
            "restore_predicted_bytes": by_phase["restore"] - phases.footprint,
            "pieces_taken": taking["pieces"], "piece_taking_s": round(taking["seconds"], 2),
            "slabs_the_device_could_not_read": sorted(map(str, piece_take._DEVICE_CANNOT_READ_HOST))}


def restore_phase(recipe_name: str, overrides: list[str], directory: str, initialised: bool) -> dict:
    """The step in `directory` restored as a resume restores it (nothing made first where `initialised` is
    False: the weights' targets are shapes), measured; the restored state's sums to compare with the saved."""
    import gc

    import jax

    from spillway.recipes.train import host_memory
    from spillway.recipes.train.checkpoint import RunCheckpointer

    resident = ResidentPeak()
    s = _setup(recipe_name, overrides, initialise=initialised)
    gc.collect()   # the save phase's state, where it ran in this process: a resume holds none
    ckpt = RunCheckpointer(directory, keep=1, every_steps=1, async_save=True)
    resident.reset()
    before, t0 = resident.peak(), time.perf_counter()
    restored = jax.block_until_ready(host_memory.restore_state(ckpt, s, s.params))
    restore_rise, restore_s = resident.peak() - before, time.perf_counter() - t0
    ckpt.close()
    return {"restore_rise_bytes": restore_rise, "restore_s": round(restore_s, 2),
            "restored_sums": leaf_sums(restored[1])}   # (params, opt_state)


def merged(saved: dict, restored: dict, restored_in: str) -> dict:
    row = {**saved, **restored, "restored_in": restored_in}
    row["restored_sums_equal"] = row.pop("restored_sums") == row.pop("saved_sums")
    return row


def leaf_sums(tree) -> list[float]:
    """Every array of `tree` summed in float64 by the same program: equal lists for the saved and the
    restored state say the restore brought back what was saved (a check that costs no copy of the state)."""
    import jax
    import jax.numpy as jnp
    total = jax.jit(lambda x: jnp.sum(x.astype(jnp.float32), dtype=jnp.float32))
    return [float(total(leaf)) for leaf in jax.tree.leaves(tree) if hasattr(leaf, "dtype")]


def host_memory_ram() -> int:
    from spillway.recipes.optim.host_memory import host_ram_bytes
    return host_ram_bytes()


def render(row: dict) -> str:
    gib = lambda n: f"{n / GiB:.2f} GiB"  # noqa: E731
    rise = lambda n: f"{n / GiB:+.2f} GiB"  # noqa: E731  (signed: a rise of nothing can read a page below zero)
    return (f"checkpoint of host state ({row['recipe']}, {row['backend']}, save {row['mode']}, state "
            f"{gib(row['state_bytes'])}): save VmHWM {rise(row['save_rise_bytes'])} (predicted "
            f"+{gib(row['save_predicted_rise_bytes'])} above the live state, {row['save_s']} s); restore VmHWM "
            f"{rise(row['restore_rise_bytes'])} (predicted {gib(row['restore_predicted_bytes'])} with the restored "
            f"state, {row['restore_s']} s, restored in {row['restored_in']}); restored state's sums equal the "
            f"saved: {row['restored_sums_equal']}; "
            f"{row['pieces_taken']} pieces taken in {row['piece_taking_s']} s of the save (slabs the device could "
            f"not read: {row['slabs_the_device_could_not_read'] or 'none'})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="llama3_1b")
    ap.add_argument("--set", action="append", default=[], metavar="A.B=VALUE")
    ap.add_argument("--mode", choices=("auto", "pieces", "whole"), default="auto")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--restore-in", choices=("new-process", "same-process"), default="new-process",
                    help="restore in a process of its own, as a resume does (default), or after the save in "
                         "this one")
    ap.add_argument("--phase", choices=("save", "restore"), help=argparse.SUPPRESS)   # a child's part
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--pieces-in-flight", type=int, help="pieces a save writes at once (default: the code's)")
    ap.add_argument("--restore-pieces-in-flight", type=int,
                    help="pieces a restore reads at once (default: the code's)")
    args = ap.parse_args(argv)
    if args.pieces_in_flight:
        from spillway.recipes.train import checkpoint_io
        checkpoint_io.PIECES_IN_FLIGHT = args.pieces_in_flight
    if args.restore_pieces_in_flight:
        from spillway.recipes.train import checkpoint_read
        checkpoint_read.PIECES_IN_FLIGHT = args.restore_pieces_in_flight
    if args.phase == "save":
        print(json.dumps(save_phase(args.recipe, args.set, args.mode, args.dir)))
        return 0
    if args.phase == "restore":
        print(json.dumps(restore_phase(args.recipe, args.set, args.dir, initialised=False)))
        return 0
    if args.restore_in == "new-process":
        child_flags = [f"--{name}={value}" for name, value in (("pieces-in-flight", args.pieces_in_flight),
                       ("restore-pieces-in-flight", args.restore_pieces_in_flight)) if value]
        row = measure_in_new_processes(args.recipe, args.set, args.mode, tuple(child_flags))
    else:
        row = measure(args.recipe, args.set, args.mode)
    print(json.dumps(row) if args.json else render(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
