"""The planner's compile process: the recipe's train step compiled for a GPU target, once per candidate plan.

Started by recipes/plan/workers.py through `run_in_compile_process` (the GPU compiler
plugin can only join a JAX process at backend start, so compiles happen here,
never in the caller). One process compiles all the candidates it is given, so
start-up (JAX, the plugin, the topology) is paid once per process; the planner
deals the candidates over a few such processes at once (`workers.default_workers`).

    python -m spillway.recipes.plan.child REQUEST.json

The request (written by recipes/plan/planner.py) holds the resolved recipe as a dict, the
folders to put on sys.path to import the recipe's own block class, the
target name, the number of GPUs, the candidate plans (activation plan x
optimizer-state placement) and optionally a search. For each candidate the
recipe's offload settings are replaced, the train step is built abstractly
(spillway.recipes.train.abstract_setup: the same make_train_step, shardings and
donation as training; nothing allocated) on a mesh of compile-only GPUs and
compiled; the answer is one JSON document with a CompileReport per candidate
(or the error that candidate hit).

Also in the request: `compiler_options` (XLA options for every compile: the
planner's fast code generation, or None to compile as for a run) and
`verify_full_codegen` (candidates to compile a second time with None, so the
caller can compare the figures).

Search (`"search": {"axis": "seq_len" | "batch", ...}`, `search_one`): per
candidate, the largest data.seq_len or train.global_batch (a multiple of the
request's step) that fits the request's limits. It starts from the compile at
the recipe's own value, brackets the answer with powers of two (skipping those
that a straight line through two fitting points says fit too), then narrows
the bracket: a guess by linear interpolation of HBM between its ends, then the
guess's neighbour (under affine HBM that pair closes the bracket), then a
bisection, and again. HBM grows with both, so the answer is exact to the step;
compiles per candidate are capped, and an unfinished search says so.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any

import jax

from spillway.layers.sharding import make_mesh
from spillway.recipes.config import Recipe
from spillway.recipes.plan import compile_cache
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.plan.compile import CompileReport, gpu_topology
from spillway.recipes.plan.subprocess_runner import report_progress, serve_compile_process
from spillway.recipes.targets import get_target
from spillway.recipes.train.step import abstract_setup, abstract_step_arguments


def _with_plan(recipe, candidate: dict):
    return Candidate.from_dict(candidate).applied_to(recipe)


def _with_value(recipe, axis: str, value: int):
    if axis == "seq_len":
        return dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, seq_len=value))
    return dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, global_batch=value))


def compile_step(recipe, mesh, compiler_options: dict | None = None, cache: ProgramCache | None = None,
                 setup=None):
    """(CompileReport, build seconds) of `recipe`'s train step on `mesh` (compile-only GPUs).

    `compiler_options` are XLA debug options for this compile only (the
    planner's fast code generation, see recipes/plan/toolchain.py); None compiles as
    for a run. `cache`: the compile cache's programs (recipes/plan/compile_cache.py): a lowered program
    compiled before with the same options and toolchain is not compiled again (`cache.last_hit` says
    whether it was). `setup`: the abstract setup, when the caller built it already.
    """
    started = time.perf_counter()
    s = abstract_setup(recipe, mesh, platform="cuda") if setup is None else setup
    arguments = abstract_step_arguments(s)
    built = time.perf_counter()
    # The parameters carry concrete shardings on the compile-only mesh, so the
    # call names its devices and needs no mesh context (spillway.recipes.plan.compile).
    lowered = s.train_step.lower(*arguments)
    lowered_at = time.perf_counter()
    key = None
    if cache is not None:
        key = cache.key(lowered, compiler_options)
        figures = cache.get(key)
        cache.last_hit = figures is not None
        if figures is not None:
            return CompileReport.from_dict({**figures, "lower_seconds": lowered_at - built}), built - started
    compiled = compile_lowered(lowered, compiler_options)
    compiled_at = time.perf_counter()
    report = CompileReport.from_compiled(
        compiled, lower_seconds=lowered_at - built, compile_seconds=compiled_at - lowered_at,
        device_kind=mesh.devices.flat[0].device_kind, num_devices=mesh.size)
    if cache is not None:
        cache.put(key, report.to_dict())
    return report, built - started


class ProgramCache:
    """The compile cache's programs/ entries for one compile process (recipes/plan/compile_cache.py)."""

    def __init__(self, directory: str, target_config: str, devices: int, fingerprint: dict):
        self.cache = compile_cache.CompileCache(directory)
        self.target_config, self.devices, self.fingerprint = target_config, devices, fingerprint
        self.last_key: str | None = None   # the key and the outcome of the latest compile_step
        self.last_hit = False

    def key(self, lowered, compiler_options: dict | None) -> str:
        program = compile_cache.program_text(lowered.as_text(debug_info=True))
        self.last_key = compile_cache.program_key(program, self.target_config, self.devices, compiler_options,
                                                  self.fingerprint)
        return self.last_key

    def get(self, key: str) -> dict | None:
        return self.cache.get("programs", key, required=compile_cache.REPORT_FIELDS)

    def put(self, key: str, report: dict) -> None:
        self.cache.put("programs", key, compile_cache.report_figures(report))


def candidate_bounds(setup) -> dict:
    """What a candidate needs whatever XLA makes of it, from its abstract setup alone (no lowering): its
    step's device-resident arguments per GPU (weights and optimizer state in HBM: the HBM figure is at least
    these) and the host phases of a run with the step's own host bytes left at 0 (the host's peak is at least
    theirs; recipes/plan/host_peak.py). The planner refuses a candidate these already rule out."""
    from spillway.recipes.train.host_memory import _bytes_by_kind, phases_of

    opt_state = setup.optimizer.abstract_state(setup.params, setup.param_shardings)
    device_bytes = _bytes_by_kind((setup.params, opt_state), per_device=True).get("device", 0)
    phases = phases_of(setup, step_host=0, footprint=0, gpu=True, per_device=True).to_dict()
    return {"device_argument_bytes": device_bytes, "host_phases": phases}


def compile_lowered(lowered, compiler_options: dict | None):
    """`lowered.compile(compiler_options=...)`; at autotune level 1 where level 0 has no kernel.

    jaxlib 0.11's GPU compiler, with autotuning off (level 0), takes each Triton
    GEMM fusion's one default tiling and fails with "No supported config found
    for HLO" where that tiling does not suit the fusion (a bf16[2048,1536] weight
    gradient of Qwen2.5 1.5B, among others); level 1 tries a short list instead,
    without timing anything (there is no GPU). 0.10 and 0.12 compile the same
    steps at level 0 (toolchain.compiler_options says why it is 0). Judged by the
    error, not by the version, so a patch release is handled by what it does.
    Once one compile needed level 1, this process's later compiles start there:
    a failed level-0 attempt costs most of a compile.
    """
    global _AUTOTUNE_LEVEL_1
    if compiler_options and compiler_options.get("xla_gpu_autotune_level") == 0:
        if not _AUTOTUNE_LEVEL_1:
            try:
                return lowered.compile(compiler_options=compiler_options)
            except Exception as error:
                if NO_GEMM_CONFIG not in str(error):
                    raise
                _AUTOTUNE_LEVEL_1 = True
        compiler_options = {**compiler_options, "xla_gpu_autotune_level": 1}
    return lowered.compile(compiler_options=compiler_options)


NO_GEMM_CONFIG = "No supported config found for HLO"
_AUTOTUNE_LEVEL_1 = False   # set by compile_lowered: this jaxlib needs level 1 for some GEMMs


def _attempt(recipe, mesh, compiler_options: dict | None, cache: ProgramCache | None = None,
             bounds_only: bool = False) -> dict:
    """One candidate as a JSON-ready dict: its bounds (`candidate_bounds`) and, unless `bounds_only`, the
    report of its compile (or the error it raised); "cached" when the compile cache had it, and "program" its
    key there."""
    started = time.perf_counter()
    try:
        setup = abstract_setup(recipe, mesh, platform="cuda")
        bounds = candidate_bounds(setup)
        if bounds_only:
            return {"bounds": bounds, "seconds": time.perf_counter() - started}
        report, built = compile_step(recipe, mesh, compiler_options, cache, setup=setup)
        cached = cache is not None and cache.last_hit
    except Exception as error:   # one failing candidate must not hide the others
        return {"error": f"{type(error).__name__}: {error}"[:3000],
                "seconds": time.perf_counter() - started}
    # The run's other phases beside the step's (save, restore, state creation: recipes/plan/host_peak.py).
    from spillway.recipes.plan import host_peak
    return {"report": {**report.to_dict(), "host_phases": host_peak.with_step_host(bounds["host_phases"],
                                                                                report.host_bytes)},
            "bounds": bounds, "cached": cached, "program": None if cache is None else cache.last_key,
            "build_seconds": built, "seconds": time.perf_counter() - started}


def _round_down(value: float, step: int) -> int:
    return int(value // step) * step


def _next_power_of_two_above(value: int) -> int:
    return 1 << int(value).bit_length()


class _FitSearch:
    """The compiles of one `search_one`: the points measured so far (value -> figures and whether they fit),
    the compile budget spent, and the errors met."""

    def __init__(self, measure, limits: dict, *, step: int, max_compiles: int):
        self.measure, self.limits, self.step, self.max_compiles = measure, limits, step, max_compiles
        self.points: dict[int, dict] = {}
        self.compiles = 0
        self.errors: list[str] = []

    def fits(self, point: dict) -> bool:
        return (point["hbm_bytes"] <= self.limits["hbm_bytes"]
                and point["host_bytes"] <= self.limits["host_bytes_per_device"])

    def probe(self, value: int) -> bool | None:
        """Whether `value` fits; None when out of compiles or the compile failed."""
        if value in self.points:
            return self.points[value]["fits"]
        if self.compiles >= self.max_compiles:
            return None
        self.compiles += 1
        try:
            point = self.measure(value)
        except Exception as error:   # report it with the search, do not lose the other plans
            self.errors.append(f"{value}: {type(error).__name__}: {error}"[:1000])
            return None
        self.points[value] = {**point, "fits": self.fits(point)}
        return self.points[value]["fits"]

    def predicted_limit(self, lo: int, hi: int) -> int | None:
        """Where HBM, linear through the points at lo and hi, reaches the limit (None: not rising)."""
        a, b = self.points[lo]["hbm_bytes"], self.points[hi]["hbm_bytes"]
        if b <= a:
            return None
        return lo + _round_down((self.limits["hbm_bytes"] - a) / (b - a) * (hi - lo), self.step)

    def bracket(self, first: int, cap: int) -> tuple[int | None, int | None]:
        """(lo, hi) with powers of two from `first`: lo fits, hi does not (None: not found)."""
        ok = self.probe(first)
        if ok:
            return self._bracket_up(first, cap)
        if ok is None:
            return None, None
        hi, value = first, _next_power_of_two_above(first) // (4 if first & (first - 1) == 0 else 2)
        while value >= self.step:
            ok = self.probe(value)
            if ok is None:
                return None, hi
            if ok:
                return value, hi
            hi, value = value, value // 2
        return None, hi

    def _bracket_up(self, lo: int, cap: int) -> tuple[int, int | None]:
        while lo < cap:
            value = _next_power_of_two_above(lo)
            previous = max((v for v in self.points if v < lo and self.points[v]["fits"]), default=None)
            if previous is not None:
                # Two fitting points: skip the powers of two that the trend says fit too.
                guess = self.predicted_limit(previous, lo)
                if guess is not None and guess >= value:
                    value = _next_power_of_two_above(guess)
            ok = self.probe(min(value, cap))
            if ok is None:
                return lo, None
            if not ok:
                return lo, min(value, cap)
            lo = min(value, cap)
        return lo, None

    def narrow(self, lo: int | None, hi: int | None) -> tuple[int | None, int | None]:
        """[lo, hi] narrowed to one step: interpolate, check the neighbour, bisect if that did not close it."""
        mode = "interpolate"
        while lo is not None and hi is not None and hi - lo > self.step:
            middle = lo + max(self.step, _round_down((hi - lo) // 2, self.step))
            if mode == "interpolate":
                guess = self.predicted_limit(lo, hi)
                guess = middle if guess is None else min(max(guess, lo + self.step), hi - self.step)
            elif mode == "neighbour_up":
                guess = lo + self.step
            elif mode == "neighbour_down":
                guess = hi - self.step
            else:
                guess = middle
            ok = self.probe(guess)
            if ok is None:
                break
            if ok:
                lo = guess
            else:
                hi = guess
            if mode == "interpolate":
                mode = "neighbour_up" if ok else "neighbour_down"
            elif mode.startswith("neighbour"):
                mode = "bisect"
            else:
                mode = "interpolate"
        return lo, hi


def search_one(measure, start_value: int, start_point: dict | None, limits: dict, *,
               step: int, cap: int, max_compiles: int) -> dict:
    """Largest value (a multiple of `step`, <= cap) whose compile fits `limits`.

    measure(value) -> {"hbm_bytes", "host_bytes", ...} compiles the step at
    `value` (or raises). `start_point` is the compile at `start_value` already
    made for the plan table (None if it failed); it costs nothing here.
    Pure logic over `measure`, so tests can drive it with synthetic curves.
    """
    search = _FitSearch(measure, limits, step=step, max_compiles=max_compiles)
    if start_point is not None:
        search.points[start_value] = {**start_point, "fits": search.fits(start_point)}
    started = time.perf_counter()
    lo, hi = search.bracket(min(cap, max(step, _round_down(start_value, step))), cap)
    lo, hi = search.narrow(lo, hi)
    resolved = (lo is not None and (lo == cap or (hi is not None and hi - lo <= step))) or \
        (lo is None and hi is not None and hi <= step)
    return {
        "best": lo,                 # largest value known to fit (None: none fits)
        "first_fail": hi,           # smallest value known not to fit (None: none failed up to the cap)
        "resolved": bool(resolved),
        "at_cap": lo is not None and lo == cap,
        "compiles": search.compiles,
        "seconds": time.perf_counter() - started,
        "points": {str(k): v for k, v in sorted(search.points.items())},
        "errors": search.errors,
    }


def _measure(recipe, mesh, axis: str, compiler_options: dict | None):
    """A `measure` for search_one: compile the step with `axis` set to the value."""
    def measure(value: int) -> dict:
        report, _ = compile_step(_with_value(recipe, axis, value), mesh, compiler_options)
        return {"hbm_bytes": report.hbm_bytes, "host_bytes": report.host_bytes}
    return measure


def main(argv: list[str]) -> dict[str, Any]:
    started = time.perf_counter()
    if argv[0] == "-":   # the planner sends its request on stdin: no file to leave behind
        request = json.load(sys.stdin)
    else:
        with open(argv[0]) as f:
            request = json.load(f)
    # Where the parent found the recipe's own block class (recipes/blocks.py import_root).
    sys.path[:0] = [path for path in request.get("import_paths", []) if path not in sys.path]
    try:
        recipe = Recipe.from_dict(request["recipe"])
    except ValueError as error:   # e.g. a block module this process cannot import: one line for the planner
        return {"error": f"compile process: {error}"}
    options = request.get("compiler_options")
    try:
        topology = gpu_topology(request["target"], request["devices"])
        mesh = make_mesh(recipe.mesh, devices=topology.devices)
    except ValueError as error:
        return {"error": str(error)}
    ready = time.perf_counter()

    plans = [_with_plan(recipe, candidate) for candidate in request["candidates"]]
    cached = request.get("cache")
    cache = None if not cached else ProgramCache(cached["directory"], get_target(request["target"]).target_config_text,
                                                 request["devices"], cached["fingerprint"])
    results = []
    for index, planned in enumerate(plans):
        results.append(_attempt(planned, mesh, options, cache, bounds_only=request.get("bounds_only", False)))
        report_progress({"index": index, "result": results[-1]})   # the planner's line per finished compile

    # The same candidates compiled exactly as for a run: the figures must not move.
    full_codegen = {str(i): _attempt(plans[i], mesh, None) for i in request.get("verify_full_codegen", [])}

    searches = None
    search = request.get("search")
    if search:
        axis = search["axis"]
        start_value = recipe.data.seq_len if axis == "seq_len" else recipe.train.global_batch
        searches = []
        for planned, result in zip(plans, results):
            start = result.get("report")
            start_point = None if start is None else {k: start[k] for k in ("hbm_bytes", "host_bytes")}
            searches.append(search_one(_measure(planned, mesh, axis, options), start_value, start_point,
                                       search["limits"], step=search["step"], cap=search["cap"],
                                       max_compiles=search["max_compiles_per_plan"]))
    return {
        "cache_warnings": [] if cache is None else cache.cache.warnings,
        "jax_version": jax.__version__,
        "device_kind": mesh.devices.flat[0].device_kind,
        "mesh": dict(mesh.shape),
        "setup_seconds": ready - started,
        "results": results,
        "full_codegen": full_codegen,
        "searches": searches,
        "seconds": time.perf_counter() - started,
    }


if __name__ == "__main__":
    serve_compile_process(main)
