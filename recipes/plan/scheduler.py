"""Which candidates the planner compiles, in which order, and which it answers from the compile cache.

`CandidateCompiles.run` takes the candidates of recipes/plan/planner.py and gives back, per index, the
compile process's result dict (recipes/plan/child.py `_attempt`: "report" or "error", "seconds", "bounds")
or a skip. In order:

1. The compile cache (recipes/plan/compile_cache.py): a candidate asked for before with the same recipe,
   target, options, toolchain and source is answered from disk, no process started.
2. When pruning (the default plan): the bounds of the candidates left (child.candidate_bounds, one quick
   pass through the compile processes without lowering anything, or from the cache). A candidate whose
   HBM-resident weights and optimizer state exceed the HBM limit, or whose host peak over the phases a
   run has besides its step (checkpoint save, restore, state creation) exceeds the host's RAM, cannot fit
   whatever XLA makes of it: it is not compiled (`pruning.refusal_before_compile`).
3. The stages of recipes/plan/pruning.py, each skipping what a plan that fits already beats.

Each finished compile (or cache answer, or skip) is one line of recipes/plan/progress.py.
"""

from __future__ import annotations

from spillway.recipes.plan import compile_cache, host_peak, pruning
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.plan.progress import CompileProgress
from spillway.recipes.plan.workers import default_workers, merge_answers, run_children


class CandidateCompiles:
    """The compiles of one plan: `request` is the compile processes' request without its candidates."""

    def __init__(self, todo: list[Candidate], request: dict, progress: CompileProgress, *,
                 cache: compile_cache.CompileCache | None, request_keys: list[str] | None,
                 workers: int | None):
        self.todo, self.request, self.progress = todo, request, progress
        self.cache, self.keys, self.workers = cache, request_keys, workers
        self.results: dict[int, dict] = {}      # index -> the compile process's result (or the cache's)
        self.bounds: dict[int, dict] = {}
        self.skipped: list[dict] = []
        self.answers: list[dict] = []           # the compile processes' answers, in the order they ran (stages, then more)
        self.groups: list[list[int]] = []
        self.used_workers = 0
        self.warnings: list[str] = []
        self.wanted: set[int] = set()           # indices the user asked for: compiled even where beaten

    # -- the cache --------------------------------------------------------------------------------------
    def _from_cache(self, index: int) -> None:
        entry = self.cache.get("requests", self.keys[index], required=("bounds",))
        if entry is None:
            return
        self.bounds[index] = entry["bounds"]
        program = entry.get("program")
        figures = None if program is None else self.cache.get("programs", program,
                                                              required=compile_cache.REPORT_FIELDS)
        if figures is None:
            return
        report = {**figures, "host_phases": host_peak.with_step_host(entry["bounds"]["host_phases"],
                                                                     figures["host_bytes"])}
        self.results[index] = {"report": report, "bounds": entry["bounds"], "cached": True, "seconds": 0.0,
                               "program": program}
        self.progress.finished(self.todo[index], self.results[index], cached=True)

    def _remember(self, index: int, result: dict) -> None:
        """Keep what a compile process answered; write its request entry (its program entry is the compile
        process's)."""
        if "bounds" in result:
            self.bounds[index] = result["bounds"]
        if self.cache is None or "bounds" not in result or index >= len(self.keys):
            return   # no cache, or a candidate of `more` (no request key)
        previous = self.cache.get("requests", self.keys[index]) if "report" not in result else None
        program = result.get("program") if "report" in result else (previous or {}).get("program")
        self.cache.put("requests", self.keys[index], {"bounds": result["bounds"], "program": program})

    # -- the compile processes --------------------------------------------------------------------------
    def _run(self, indices: list[int], *, bounds_only: bool = False, verify: list[int] = ()) -> dict:
        count = len(indices) if self.workers is None else min(self.workers, len(indices))
        workers = default_workers(len(indices)) if self.workers is None else count
        self.used_workers = max(self.used_workers, workers)

        def finished(position: int, result: dict) -> None:
            if not bounds_only:
                self.progress.finished(self.todo[indices[position]], result, cached=result.get("cached", False))

        answer = run_children({**self.request, "candidates": [self.todo[i].to_dict() for i in indices],
                               "bounds_only": bounds_only, "verify_full_codegen": list(verify)},
                              workers, on_progress=finished)
        self.warnings += [w for w in answer.get("cache_warnings", []) if w not in self.warnings]
        for index, result in zip(indices, answer["results"]):
            self._remember(index, result)
        return answer

    def _skip(self, index: int, because: str, cannot_fit: bool) -> None:
        candidate = self.todo[index]
        self.skipped.append({**candidate.to_dict(), "label": candidate.label, "because": because,
                             **({"cannot_fit": True} if cannot_fit else {})})
        self.progress.skipped(candidate, because if cannot_fit else f"{because} fits and is at least as fast")

    # -- a plan -----------------------------------------------------------------------------------------
    def run(self, stages: list[list[int]], *, refuse_before_compile: bool, limits: dict, judged_rows,
            host_update_floor_s: float | None, verify_full_codegen: int = 0) -> dict:
        """Compile `stages` in turn (indices into todo); `judged_rows(results)` gives the rows (PlanRow by
        index, their fits set) that the next stage's pruning reads. limits: hbm_bytes, devices, host_ram.
        Returns the merged answer of the compile processes (or a stand-in when none ran)."""
        if self.cache is not None:
            for index in range(len(self.todo)):
                self._from_cache(index)
            self.warnings += [w for w in self.cache.warnings if w not in self.warnings]
        refused: set[int] = set()
        if refuse_before_compile:
            unknown = [i for i in range(len(self.todo)) if i not in self.bounds and i not in self.results]
            if unknown:
                self._run(unknown, bounds_only=True)
            for index in range(len(self.todo)):
                if index in self.results or index not in self.bounds:
                    continue
                why = pruning.refusal_before_compile(self.bounds[index], limits["hbm_bytes"], limits["devices"],
                                                     limits["host_ram"])
                if why is not None:
                    refused.add(index)
                    self._skip(index, why, cannot_fit=True)
        compiled_answers, compiled_groups = self.answers, self.groups
        for stage in stages:
            rows = judged_rows(self.results)
            run = []
            for index in stage:
                if index in refused or index in self.results:
                    continue
                faster = None if index in self.wanted else pruning.faster_plan_that_fits(
                    self.todo[index], self.todo, rows, self.skipped, host_update_floor_s)
                if faster is None:
                    run.append(index)
                else:
                    self._skip(index, faster, cannot_fit=False)
            if not run:
                continue
            verify = list(range(min(verify_full_codegen, len(run)))) if not compiled_answers else []
            answer = self._run(run, verify=verify)
            compiled_answers.append(answer)
            compiled_groups.append(run)
            for index, result in zip(run, answer["results"]):
                self.results[index] = result
        return self._merged(compiled_answers, compiled_groups)

    def more(self, candidates: list[Candidate]) -> list[int]:
        """Compile candidates named after the stages (the planner's split search): their indices into todo.
        Their results are not written to the cache (its request keys were made for the first todo)."""
        indices = list(range(len(self.todo), len(self.todo) + len(candidates)))
        self.todo.extend(candidates)
        self.progress.start_round(len(candidates))
        answer = self._run(indices)
        self.answers.append(answer)
        self.groups.append(indices)
        for index, result in zip(indices, answer["results"]):
            self.results[index] = result
        return indices

    def merged_answer(self, answer: dict) -> dict:
        """`answer` (what run returned) with the compiles of `more` merged in."""
        return self._merged(self.answers, self.groups) if self.answers else answer

    def _merged(self, answers: list[dict], groups: list[list[int]]) -> dict:
        if answers:
            merged = merge_answers(answers, groups, len(self.todo), combine_seconds=sum)   # stages ran in turn
        else:   # every candidate answered by the cache or skipped: no compile process ran
            import jax
            merged = {"jax_version": jax.__version__, "mesh": None, "full_codegen": {}, "searches": None,
                      "seconds": 0.0, "startup_seconds": 0.0, "results": [None] * len(self.todo)}
        for index, result in self.results.items():
            merged["results"][index] = result
        return merged
