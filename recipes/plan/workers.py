"""The planner's compile processes: a request (recipe, target, candidates) run in one or several at once.

Each process (recipes/plan/child.py, started by subprocess_runner with the GPU
compiler plugin) compiles the candidates it is dealt and answers one JSON
document; `merge_answers` puts the answers of several back in the order of
the candidates.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from spillway.recipes.plan.subprocess_runner import compile_processes_bounded, run_in_compile_process


def run_child(request: dict, on_progress: Callable[[int, dict], None] | None = None) -> dict:
    """One compile process over the request's candidates; `on_progress(index, result)` as each finishes."""
    started = time.perf_counter()
    # the request on stdin: no file to leave behind, however the planner stops
    answer = run_in_compile_process(
        "spillway.recipes.plan.child", ["-"], timeout_s=3600, input_text=json.dumps(request),
        on_progress=None if on_progress is None else lambda value: on_progress(value["index"], value["result"]))
    if "error" in answer:
        raise ValueError(answer["error"])
    # Python, JAX and the plugin starting, before the child's main() ran.
    answer["startup_seconds"] = time.perf_counter() - started - answer["seconds"] + answer["setup_seconds"]
    return answer


def default_workers(num_candidates: int) -> int:
    """Compile processes to run at once: one per core, at most 4, at most one per candidate.

    XLA's GPU compile of one candidate keeps more than one core busy only part
    of the time, so two processes on two cores finish sooner than one
    (BENCHMARKS.md, `spillway plan llama3_8b`). More than 4 mostly adds memory
    (each process holds its own traced model).
    """
    return max(1, min(4, os.cpu_count() or 1, num_candidates))


def run_children(request: dict, workers: int, on_progress: Callable[[int, dict], None] | None = None) -> dict:
    """`run_child` over `workers` processes, candidates dealt round-robin; one merged answer.
    `on_progress(index, result)`, index into the request's candidates, as each compile finishes (from the
    threads that read the processes' output).

    Round-robin spreads both optimizer-state placements (which compile at
    different speeds) over the processes. Each candidate's search runs in
    the process that compiled it.
    """
    count = len(request["candidates"])
    workers = max(1, min(workers, count))
    if workers == 1:
        with compile_processes_bounded():
            return run_child(request, on_progress)
    groups = [list(range(w, count, workers)) for w in range(workers)]
    verify = set(request.get("verify_full_codegen", []))
    requests = [{**request, "candidates": [request["candidates"][i] for i in group],
                 "verify_full_codegen": [j for j, i in enumerate(group) if i in verify]} for group in groups]
    # threads only wait on the child processes, killed first if this process stops (subprocess_runner.py)
    with ThreadPoolExecutor(workers) as pool, compile_processes_bounded():
        answers = list(pool.map(lambda job: run_child(job[0], _in_request(on_progress, job[1])),
                                zip(requests, groups)))
    return merge_answers(answers, groups, count, combine_seconds=max)   # the processes ran side by side


def _in_request(on_progress: Callable[[int, dict], None] | None, group: list[int]):
    """`on_progress` for one process's share (`group`: the request's indices it was dealt)."""
    if on_progress is None:
        return None
    return lambda index, result: on_progress(group[index], result)


def merge_answers(answers: list[dict], groups: list[list[int]], count: int, combine_seconds) -> dict:
    """Compile-process answers as one: answers[k] holds the candidates at indices groups[k] of a list of
    `count`; its results, searches and full-codegen checks go to those indices. combine_seconds: `max`
    for processes that ran at once, `sum` for ones that ran one after another."""
    merged = {**answers[0], "results": [None] * count, "full_codegen": {},
              "searches": None if answers[0]["searches"] is None else [None] * count,
              "seconds": combine_seconds(a["seconds"] for a in answers),
              "cache_warnings": [w for a in answers for w in a.get("cache_warnings", [])],
              "startup_seconds": combine_seconds(a["startup_seconds"] for a in answers)}
    for group, answer in zip(groups, answers):
        for j, i in enumerate(group):
            merged["results"][i] = answer["results"][j]
            if merged["searches"] is not None:
                merged["searches"][i] = answer["searches"][j]
        for j, full in answer["full_codegen"].items():
            merged["full_codegen"][str(group[int(j)])] = full
    return merged
