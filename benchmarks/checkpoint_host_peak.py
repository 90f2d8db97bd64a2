"""The host peak (VmHWM) of a checkpoint save and a restore of host-resident state, beside the prediction.

The GPU suite's checkpoint case (benchmarks/gpu_suite.py runs it at the end with the time left): a train
setup with its optimizer state in pinned host memory, its state created, then one save (the mode the run
would pick, recipes/train/host_memory.check_run, or --mode) and one restore as a resume does, each
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
    """{"save_rise_bytes", "restore_rise_bytes", predicted ..., "mode", seconds}: one save and one restore."""
    import jax

    from spillway.layers.sharding import make_mesh
    from spillway.recipes.registry import get_recipe
    from spillway.recipes.train import host_memory, piece_take
    from spillway.recipes.train import step as step_lib
    from spillway.recipes.train.checkpoint import RunCheckpointer
    from spillway.recipes.train.xla_settings import GPU_PLATFORMS

    resident = ResidentPeak()   # started first: where /proc keeps no VmHWM it samples from here on
    recipe = get_recipe(recipe_name, ["offload.optimizer_state=host", *overrides])
    mesh = make_mesh(recipe.mesh)
    s = step_lib.setup(recipe, mesh)
    # created as the train loop creates it (recipes/train/run_state.py): one jitted program writing the
    # state where its shardings place it, not eager ops staging it
    params = s.params
    opt_state = jax.block_until_ready(jax.jit(s.optimizer.init, out_shardings=s.opt_state_shardings)(params))
    gpu = jax.default_backend() in GPU_PLATFORMS
    phases = host_memory.phases_of(s, gpu=gpu)
    # auto: what the train loop picks (host_memory.check_run): orbax's whole save where it fits the RAM
    in_pieces = mode == "pieces" or (mode == "auto" and not phases.whole_save_fits(host_memory_ram()))
    phases = dataclasses.replace(phases, save_in_pieces=in_pieces)
    by_phase, live = phases.by_phase(), phases.weights + phases.state + phases.pending
    taking = timed_piece_taking()
    with tempfile.TemporaryDirectory() as directory:
        ckpt = RunCheckpointer(directory, keep=1, every_steps=1, async_save=True, save_in_pieces=in_pieces)
        resettable = resident.reset()
        before, t0 = resident.peak(), time.perf_counter()
        ckpt.save(1, params=params, opt_state=opt_state, loader_state={}, meta={"step": 1}, recipe_json="{}",
                  force=True)
        ckpt.wait()
        save_rise, save_s = resident.peak() - before, time.perf_counter() - t0
        print(f"saved in {save_s:.1f} s; restoring", file=sys.stderr, flush=True)
        sums_saved = leaf_sums(opt_state)
        del opt_state   # a resume holds no state before the restore
        resident.reset()
        before, t0 = resident.peak(), time.perf_counter()
        restored = host_memory.restore_state(ckpt, s, params)
        jax.block_until_ready(restored)
        restore_rise, restore_s = resident.peak() - before, time.perf_counter() - t0
        ckpt.close()
        restored_equal = leaf_sums(restored[1]) == sums_saved   # (params, opt_state)
    return {"recipe": recipe_name, "overrides": overrides, "backend": jax.default_backend(),
            "mode": "pieces" if in_pieces else "whole", "state_bytes": phases.state, "vmhwm_reset": resettable,
            "resident_source": resident.source,
            "save_rise_bytes": save_rise, "save_predicted_rise_bytes": by_phase["checkpoint save"] - phases.footprint
            - live, "save_s": round(save_s, 2),
            "restore_rise_bytes": restore_rise,
            "restore_predicted_bytes": by_phase["restore"] - phases.footprint, "restore_s": round(restore_s, 2),
            "restored_sums_equal": restored_equal,
            "pieces_taken": taking["pieces"], "piece_taking_s": round(taking["seconds"], 2),
            "slabs_the_device_could_not_read": sorted(map(str, piece_take._DEVICE_CANNOT_READ_HOST))}


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
            f"state, {row['restore_s']} s); restored state's sums equal the saved: {row['restored_sums_equal']}; "
            f"{row['pieces_taken']} pieces taken in {row['piece_taking_s']} s of the save (slabs the device could "
            f"not read: {row['slabs_the_device_could_not_read'] or 'none'})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="llama3_1b")
    ap.add_argument("--set", action="append", default=[], metavar="A.B=VALUE")
    ap.add_argument("--mode", choices=("auto", "pieces", "whole"), default="auto")
    ap.add_argument("--json", action="store_true")
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
    row = measure(args.recipe, args.set, args.mode)
    print(json.dumps(row) if args.json else render(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
