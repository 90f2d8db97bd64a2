"""`spillway plan`'s progress lines: each candidate's count is of a total that stays what it said.

A fresh-clone walkthrough read "[46/46]" and then "[47/67]": the split search's compiles were added to the
first count's total as they were asked for. Now each search round is announced and counted on its own.
"""

from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.plan.progress import CompileProgress


def test_a_search_round_is_announced_and_counted_on_its_own():
    lines = []
    progress = CompileProgress(2, hbm_limit=1.0, devices=1, host_ram=1.0, write=lines.append)
    first, second = Candidate.of("save_all"), Candidate.of("recompute_all")
    progress.skipped(first, "too big")
    progress.skipped(second, "too big")
    progress.start_round(3)
    progress.skipped(first, "too big")
    progress.start_round(1)
    progress.skipped(second, "too big")
    counts = [line.split("]")[0].split("[")[-1] if "[" in line else line for line in lines]
    assert counts == ["1/2", "2/2", "spillway plan: search round 1: 3 more compiles", "search 1/3",
                      "spillway plan: search round 2: 1 more compile", "search 1/1"]
    assert lines[0] == "spillway plan: [1/2] save_all / optimizer_state=device: not compiled: too big"
