"""`spillway plan`: what a recipe's train step needs on a GPU, measured by compiling it there without the GPU.

For a recipe and a target GPU, `plan` compiles the real train step
(recipes/train/step.py abstract_setup: the same shardings and donation as
training) once per candidate plan (recipes/plan/candidates.py) in compile
processes that have the GPU compiler plugin (recipes/plan/workers.py,
child.py; docs/DESIGN.md section 5), prices each compile
(recipes/plan/cost_model.py) and judges them (recipes/plan/result.py): the
pick is the fastest estimated step among the candidates that fit. Candidates
compile in stages, and one that cannot beat a plan that already fits is
skipped (recipes/plan/pruning.py). The model and its checks: docs/DESIGN.md
section 9.

Search (`--search seq_len` / `--search batch`): per candidate, the longest
sequence (a multiple of 1024, or of a smaller power of two for recipes shorter
than that, up to model.max_seq_len: raise it with --set to search further) or
the largest global batch that fits; recipes/plan/child.py bounds the compiles.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable

from spillway.layers.mesh import batch_ways
from spillway.layers.offload import RematPlan
from spillway.recipes.blocks import import_root
from spillway.recipes.config import Recipe
from spillway.recipes.plan import compile_cache, compute_model, host_update, pruning, split_search, turn_search
from spillway.recipes.plan.candidates import Candidate, candidates, planned_recipe
from spillway.recipes.plan.cost_model import params_per_gpu, plan_row
from spillway.recipes.plan.mesh_rules import check_sharding, resolve_mesh
from spillway.recipes.plan.preflight import check_recipe_before_compiles
from spillway.recipes.plan.result import Plan, PlanRow
from spillway.recipes.plan.toolchain import check_toolchain, compiler_options
from spillway.recipes.plan.progress import CompileProgress, write_to_stderr
from spillway.recipes.plan.scheduler import CandidateCompiles
from spillway.recipes.targets import DEFAULT_GPU, HBM_HEADROOM, get_target

GiB = 2**30
GB = 10**9
SEQ_SEARCH_STEP = 1024
BATCH_SEARCH_CAP = 4096
MAX_COMPILES_PER_SEARCH = 10


# Rows that must all have failed, the same way, before the plan stops: one stage of a small model's candidates.
SAME_FAILURE_ROWS = 4


def _refuse_a_shape_no_plan_compiles(rows: list[PlanRow]) -> None:
    """ValueError when every compile so far (at least SAME_FAILURE_ROWS, the first stage) failed with one error,
    the digits of its instruction names and its metadata aside (the op name says "checkpoint" under a remat
    plan and not under save_all): the compiler rejects the model's shape (XLA's "Couldn't find output tile
    sizes" for a d_model of 72), which no offload plan changes; the stages after it would fail alike for
    minutes, then say only that nothing fits. Called between stages, when no compile runs."""
    if len(rows) < SAME_FAILURE_ROWS or any(row.error is None for row in rows):
        return
    firsts = {re.sub(r"\d+", "#", re.sub(r", metadata=\{[^}]*\}", "", row.error.strip().splitlines()[0]
                                          if row.error.strip() else "")) for row in rows}
    if len(firsts) == 1:
        shown = " ".join(rows[0].error.split())[:300]
        raise ValueError(f"every plan compiled ({len(rows)}) failed with the same compiler error, which no offload "
                         f"plan changes (the model's shape or the batch's, most likely: the instruction's shape "
                         f"below): {shown}")


def _search_request(recipe: Recipe, axis: str, mesh: dict, hbm_limit: float, host_ram: float,
                    devices: int) -> dict:
    if axis == "seq_len":
        cap = recipe.model.max_seq_len
        step = SEQ_SEARCH_STEP
        # Small models (short caps, short recipes): a finer step, so the recipe's
        # own length is on the grid and "none fits" means none.
        while step > 16 and (cap < 4 * step or recipe.data.seq_len < step):
            step //= 2
    elif axis == "batch":
        step = math.lcm(batch_ways(mesh), recipe.train.grad_accum)
        cap = max(step, BATCH_SEARCH_CAP - BATCH_SEARCH_CAP % step)
    else:
        raise ValueError(f"--search must be seq_len or batch, got {axis!r}")
    return {"axis": axis, "step": step, "cap": cap, "max_compiles_per_plan": MAX_COMPILES_PER_SEARCH,
            "limits": {"hbm_bytes": hbm_limit, "host_bytes_per_device": host_ram / devices}}


def _open_cache(use: bool, request: dict, todo: list[Candidate], compiled_recipe: Recipe, target, devices: int,
                options: dict | None, recipe: Recipe):
    """(the compile cache, each candidate's request key), or (None, None) when not used; the compile processes'
    request learns where the cache is and the toolchain it was keyed with."""
    if not use or not compile_cache.enabled():
        return None, None
    fingerprint = compile_cache.toolchain_fingerprint()
    block_module = (recipe.block.split(":", 1)[0],) if recipe.block else ()
    source = compile_cache.source_digest(block_module)
    store = compile_cache.CompileCache(compile_cache.cache_dir())
    request["cache"] = {"directory": str(store.directory), "fingerprint": fingerprint}
    keys = [compile_cache.request_key(candidate.applied_to(compiled_recipe).to_dict(), target.target_config_text,
                                      devices, options, fingerprint, source) for candidate in todo]
    return store, keys


def _split(staged: bool, rows: list[PlanRow], num_layers: int, limits: Plan, compile_more
           ) -> split_search.SplitSearch | None:
    """The per-layer split search (recipes/plan/split_search.py), when a split could gain: the fastest
    device-state plan does not fit (keep some layers' state, then weights, in HBM), or, when that finds
    nothing, a streamed plan fits HBM but not the host (move some layers into HBM)."""
    if not staged:
        return None
    split = None
    base = split_search.base_plan(rows)
    if base is not None:
        split = split_search.search(base, num_layers, compile_more)
        if split.best is not None:
            return _faster_state_split(split, rows, num_layers, compile_more)
    for host_base in split_search.host_bound_bases(rows, limits.hbm_limit_bytes, limits.host_ram_bytes,
                                                   limits.devices):
        device_row = next((row for row in rows if row.candidate == Candidate.of(host_base.candidate.activations)),
                          None)   # None: refused before compiling (its weights and state alone exceed HBM)
        found = split_search.search_toward_hbm(host_base, device_row, num_layers, limits.hbm_limit_bytes,
                                               compile_more)
        if found.best is not None:
            return found
        split = split or found
    return split


def _faster_state_split(split: split_search.SplitSearch, rows: list[PlanRow], num_layers: int, compile_more
                        ) -> split_search.SplitSearch:
    """`split` (its pick found), or a state-only split of another activation plan whose step beats it: the
    first search splits the fastest device-state plan only, and its pick may need the weights split too."""
    def step_of(found):
        return found.rows[found.best].step_s

    fitting = [row.step_s for row in rows if row.fits and row.step_s is not None]
    best_step = min(fitting + [step_of(split)])
    for base in split_search.other_bases(rows, best_step, {split.activations}):
        if base.step_s >= best_step:   # its compute alone is slower than what a search before found
            continue
        found = split_search.search_state(base, num_layers, compile_more)
        if found.best is not None and step_of(found) < best_step:
            split, best_step = found, step_of(found)
    return split


def _report_on(result: Plan, answer: dict, compiles: CandidateCompiles, todo: list[Candidate],
               search_request: dict | None, options: dict | None, started: float) -> None:
    """What the plan says besides its rows (in place): warnings about them, the full-codegen check, the
    search, the timing."""
    rows, warnings = result.rows, result.warnings
    for row in rows:
        if row.dropped_offload:
            warnings.append(f"{row.candidate.label}: the plan offloads activations but the compiled step keeps "
                            f"none in host memory (XLA dropped the offload)")
        if row.error:
            warnings.append(f"{row.candidate.label}: compile failed: {row.error.splitlines()[0][:300]}")
    for index, full in answer["full_codegen"].items():
        fast = answer["results"][int(index)]
        figures = ("hbm_bytes", "host_bytes", "temp_bytes", "host_temp_bytes", "host_buffer_count",
                   "device_to_host_bytes", "host_to_device_bytes")
        result.full_codegen_check.append({
            **todo[int(index)].to_dict(),
            "fast": {k: fast["report"][k] for k in figures} if "report" in fast else fast.get("error"),
            "full": {k: full["report"][k] for k in figures} if "report" in full else full.get("error"),
            "fast_compile_s": fast.get("seconds"), "full_compile_s": full.get("seconds")})
    if search_request is not None:
        result.search = {**{k: v for k, v in search_request.items() if k != "limits"},
                         "results": [{**c.to_dict(), **found} for c, found in zip(todo, answer["searches"])]}
    result.timing = {
        "total_s": time.perf_counter() - started, "child_s": answer["seconds"],
        "child_startup_s": answer["startup_seconds"],
        "compiles": sum(not row_result.get("cached") for row_result in compiles.results.values())
        + len(answer["full_codegen"]) + sum(found["compiles"] for found in (answer["searches"] or [])),
        "cached": sum(bool(row_result.get("cached")) for row_result in compiles.results.values()),
        "jax_version": answer["jax_version"], "fast_codegen": options is not None,
        "workers": compiles.used_workers}


def _check_limits(headroom: float, host_ram_gb: float | None, hbm_budget_gib: float | None,
                  workers: int | None) -> None:
    """ValueError, one line naming the option, for a limit out of its range (before anything compiles)."""
    if not 0 < headroom <= 1:
        raise ValueError(f"--headroom must be in (0, 1], got {headroom}")
    # written as `not 0 < x < inf`: a NaN fails every comparison, so `x <= 0` let it through as no limit
    if host_ram_gb is not None and not 0 < host_ram_gb < math.inf:
        raise ValueError(f"--host-ram-gb must be a positive finite number (GB), got {host_ram_gb}")
    if hbm_budget_gib is not None and not 0 < hbm_budget_gib < math.inf:
        raise ValueError(f"--hbm-budget must be a positive number (GiB), got {hbm_budget_gib}")
    if workers is not None and workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")


def _host_pricing(host_update_rate: float | None, host_cores_per_gpu: float | None) -> dict:
    """How the host-compute plans are priced: parameters/s per core (measured file or default), cores a GPU."""
    per_core, rate_source = host_update.host_update_rate(host_update_rate)
    cores = host_update.DEFAULT_HOST_CORES_PER_GPU if host_cores_per_gpu is None else host_cores_per_gpu
    if not 0 < cores < math.inf:
        raise ValueError(f"--host-cores must be a positive finite number, got {host_cores_per_gpu}")
    return {"params_per_s_per_core": per_core, "cores_per_gpu": cores, "source": rate_source}


def _compile_request(recipe: Recipe, compiled_recipe: Recipe, target, devices: int, options,
                     search_request: dict | None) -> dict:
    """What every compile process is sent. They inherit PYTHONPATH and the working directory, not this
    process's sys.path: it names where the recipe's own block class was found."""
    import_paths = [root for root in [import_root(recipe.block) if recipe.block else None] if root]
    return {"recipe": compiled_recipe.to_dict(), "import_paths": import_paths, "target": target.name,
            "devices": devices, "compiler_options": options, "search": search_request}


def _searches(current_rows, judged, compile_more, compiled_recipe: Recipe, mesh: dict, hbm_limit: float, *,
              staged: bool, turn: bool):
    """(the split search, the turn search), each None when not run: the per-layer split (`_split`), then the
    pick's weights across the turn (recipes/plan/turn_search.py)."""
    split = _split(staged, current_rows(), compiled_recipe.model.num_layers, judged([], None), compile_more)
    kept = None
    if turn:
        kept = turn_search.search(judged(current_rows(), None).picked, compiled_recipe, mesh, hbm_limit, compile_more)
    return split, kept


def _candidates_to_compile(recipe: Recipe, compiled_recipe: Recipe, plans: list[Candidate] | None,
                           with_own: bool) -> tuple[list[Candidate], set[int]]:
    """(the candidates, the indices of those compiled even where a plan that fits beats them): `plans`, else
    `candidates`, and with `with_own` the recipe's own placement among them (`spillway plan` with `--set
    offload.*`: the user asks for that placement, priced even where a faster plan fits)."""
    todo = list(plans) if plans is not None else candidates(compiled_recipe)
    if not with_own or plans is not None:
        return todo, set()
    own = Candidate.of_recipe(recipe)
    if own not in todo:
        todo.append(own)
    return todo, {todo.index(own)}


def plan(recipe: Recipe, gpu: str = DEFAULT_GPU, devices: int = 1, *, headroom: float = HBM_HEADROOM,
         host_ram_gb: float | None = None, hbm_budget_gib: float | None = None,
         host_update_rate: float | None = None, host_cores_per_gpu: float | None = None, search: str | None = None,
         plans: list[Candidate] | None = None, verify_full_codegen: int = 0,
         workers: int | None = None, prune: bool = True, cache: bool = True, turn: bool | None = None,
         with_own: bool = False, progress_write: Callable[[str], None] | None = write_to_stderr) -> Plan:
    """Compile the recipe's train step for every candidate on `devices` x `gpu`; rows and the pick.

    host_ram_gb: RAM of the host for pinned memory, in GB (10^9 bytes); default
    the target's per-GPU share times `devices`. hbm_budget_gib: HBM per GPU a
    plan may use, in GiB (2^30 bytes), when lower than headroom x the GPU's.
    host_update_rate (parameters/s per core) and host_cores_per_gpu price the
    host-compute plans (recipes/plan/host_update.py: measured file or default). plans: candidates to compile
    (default `candidates(recipe)`). verify_full_codegen: also compile the first
    N candidates exactly as for a run and record both figures
    (Plan.full_codegen_check). workers: compile processes at once (default
    `default_workers`). prune: compile in stages (everything on device;
    optimizer state on host; weights on host too, an MoE model's experts
    before every block weight) and skip a candidate when
    the same activation plan with less in host memory already fits, as it
    cannot be faster (recipes/plan/pruning.py; the skipped ones are listed in
    Plan.skipped), and one its bounds rule out (recipes/plan/scheduler.py); not with `plans` or `search`.
    cache: answer earlier compiles from recipes/plan/compile_cache.py. turn: when the pick streams block
    weights, also compile it with some of them kept across the turn (recipes/plan/turn_search.py; default:
    when compiling in stages). with_own: the recipe's own placement too (`_candidates_to_compile`). progress_write:
    where the line per finished compile goes (default stderr; None: nowhere). ValueError for bad inputs
    (unknown GPU, mesh not matching, toolchain missing), saying what to do.
    """
    started = time.perf_counter()
    target = get_target(gpu)
    check_recipe_before_compiles(recipe)   # what train refuses in one line: here too, before any compile
    _check_limits(headroom, host_ram_gb, hbm_budget_gib, workers)
    hbm_budget = None if hbm_budget_gib is None else hbm_budget_gib * GiB
    host_pricing = _host_pricing(host_update_rate, host_cores_per_gpu)
    host_rate = host_pricing["params_per_s_per_core"] * host_pricing["cores_per_gpu"]   # parameters/s a GPU
    mesh = resolve_mesh(recipe, devices)
    compiled_recipe, warnings = planned_recipe(recipe)
    check_sharding(compiled_recipe, mesh)
    host_ram = host_ram_gb * GB if host_ram_gb is not None else target.default_host_ram_bytes * devices
    hbm_limit = headroom * target.hbm_bytes if hbm_budget is None else min(headroom * target.hbm_bytes, hbm_budget)
    search_request = None if search is None else _search_request(
        compiled_recipe, search, mesh, hbm_limit, host_ram, devices)
    todo, wanted = _candidates_to_compile(recipe, compiled_recipe, plans, with_own)
    for candidate in todo:   # a bad spec is an error here, before any compile
        RematPlan.parse(candidate.activations).resolve(compiled_recipe.model.num_layers)
    check_toolchain()
    options = compiler_options()
    request = _compile_request(recipe, compiled_recipe, target, devices, options, search_request)
    staged = prune and plans is None and search_request is None
    host_update_floor_s = params_per_gpu(compiled_recipe, mesh) / host_rate
    stages = pruning.stages(todo) if staged else [list(range(len(todo)))]
    # The cache answers plain compiles; a search or a full-codegen check compiles everything it names.
    store, keys = _open_cache(cache and search_request is None and not verify_full_codegen, request, todo,
                              compiled_recipe, target, devices, options, recipe)
    progress = CompileProgress(len(todo), hbm_limit, devices, host_ram, write=progress_write)
    compiles = CandidateCompiles(todo, request, progress, cache=store, request_keys=keys, workers=workers)
    compiles.wanted = wanted

    def judged(rows: list[PlanRow], mesh_answer: dict | None) -> Plan:
        return Plan(compiled_recipe, target, devices, mesh_answer or mesh, headroom, host_ram, rows, warnings, None, {},
                    hbm_budget_bytes=hbm_budget, host_update=host_pricing, host_ram_given=host_ram_gb is not None).judge()

    rows_by_index: dict[int, PlanRow] = {}

    def rows_of(results: dict[int, dict]) -> dict[int, PlanRow]:
        for index in sorted(results):
            if index not in rows_by_index:
                rows_by_index[index] = plan_row(todo[index], results[index], compiled_recipe, target, mesh,
                                                host_rate, run_attention_impl=recipe.execution.attention_impl)
        _refuse_a_shape_no_plan_compiles(list(rows_by_index.values()))
        judged([rows_by_index[i] for i in sorted(rows_by_index)], None)   # sets fits for the next stage
        return rows_by_index

    answer = compiles.run(stages, refuse_before_compile=staged,
                          limits={"hbm_bytes": hbm_limit, "devices": devices, "host_ram": host_ram},
                          judged_rows=rows_of, host_update_floor_s=host_update_floor_s,
                          verify_full_codegen=verify_full_codegen)
    rows_of(compiles.results)
    skipped = compiles.skipped
    warnings += compiles.warnings

    def compile_more(more: list[Candidate]) -> list[PlanRow]:
        """Compile candidates after the stages (the split search); their rows, judged with the others."""
        indices = compiles.more(more)
        rows_of(compiles.results)
        return [rows_by_index[i] for i in indices]

    def current_rows() -> list[PlanRow]:
        return [rows_by_index[i] for i in sorted(rows_by_index)]

    split, kept = _searches(current_rows, judged, compile_more, compiled_recipe, mesh, hbm_limit, staged=staged,
                            turn=(staged if turn is None else turn) and search_request is None)
    if split is not None or (kept is not None and kept.rows):
        answer = compiles.merged_answer(answer)
    result = judged(current_rows(), answer["mesh"])
    result.skipped, result.split, result.turn = skipped, split, kept
    result.compute_basis = compute_model.efficiency(recipe.execution.attention_impl).describe(
        recipe.execution.attention_impl)
    _report_on(result, answer, compiles, todo, search_request, options, started)
    return result
