"""recipes/plan/turn_search.py: how many streamed layers the planner keeps across the turn, on made-up compile
figures for a small recipe (the real compiles are tests/recipes/plan/test_params_keep_aot.py)."""

from __future__ import annotations

from spillway.recipes.plan import turn_search
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.plan.result import PlanRow
from tests.recipes.train.host_training import small_recipe

ONE_GPU = {"data": 1, "fsdp": 1, "tensor": 1}
RECIPE = small_recipe("offload.params=host", "offload.optimizer_state=host")   # 3 streamed layers, 2 micro-batches
PICK = Candidate.of("recompute_all", "host", "host")


def row(candidate: Candidate, hbm: float, moved_in: int, limit: float) -> PlanRow:
    r = PlanRow(candidate, "flash", {"hbm_bytes": hbm, "host_to_device_bytes": moved_in}, None, {}, compute_s=1.0,
                compile_s=0.0, forward_s=1.0, backward_s=1.0, update_s=0.0)
    r.fits = hbm <= limit
    return r


def fake_compiles(layer: int, base_hbm: float, base_moved: int, limit: float, compiled: list):
    """Each kept layer adds its weights to HBM and takes them off the backward pass's fetches (2 micro-batches)."""
    def compile_rows(candidates):
        compiled.extend(c.params_keep for c in candidates)
        return [row(c, base_hbm + c.params_keep * layer, base_moved - 2 * c.params_keep * layer, limit)
                for c in candidates]
    return compile_rows


def _layer_bytes() -> int:
    return turn_search.search(row(PICK, 0, 0, 0), RECIPE, ONE_GPU, 0, lambda c: []).layer_bytes


def test_the_search_keeps_as_many_layers_as_the_hbm_left_holds_and_counts_the_bytes_not_moved():
    layer = _layer_bytes()
    assert layer > 0
    limit, base = 10.0 * layer, 7.5 * layer          # room for 2 layers' weights, not 3
    compiled = []
    found = turn_search.search(row(PICK, base, 10**6, limit), RECIPE, ONE_GPU, limit,
                               fake_compiles(layer, base, 10**6, limit, compiled))
    assert compiled == [2, 3] and found.best == 2 and found.streamed == 3   # 2 fits: every layer tried, once
    assert found.not_moved(2) == 2 * 2 * layer
    text = "\n".join(turn_search.describe(found))
    assert "params_keep=2, the last 2 of 3 streamed layers' weights kept" in text and "does not fit" in text
    assert found.to_dict()["best_params_keep"] == 2


def test_no_room_for_a_layer_compiles_nothing_and_says_why():
    layer = _layer_bytes()
    found = turn_search.search(row(PICK, 9.5 * layer, 0, 10 * layer), RECIPE, ONE_GPU, 10 * layer,
                               fake_compiles(layer, 0, 0, 0, compiled := []))
    assert compiled == [] and found.best is None
    assert "less than one streamed layer's weights" in turn_search.describe(found)[0]


def test_a_pick_that_streams_no_weights_or_keeps_some_is_not_searched():
    for candidate in (Candidate.of("recompute_all", "host"), Candidate.of("recompute_all", "host", "host",
                                                                           params_keep=1)):
        assert turn_search.search(row(candidate, 0, 0, 1), RECIPE, ONE_GPU, 1.0, lambda c: []) is None


def test_a_lora_pick_is_not_compiled_with_kept_layers_and_says_why():
    """LoRA refuses offload.params_keep (its frozen base is streamed whole): the search says so, compiling
    nothing (a compile would have failed in the compile process: llama3_8b_lora_16gb's planner pick test)."""
    lora = small_recipe("offload.params=host", "offload.optimizer_state=host", "lora.rank=2",
                        "checkpoint.init_from=runs/base")   # a base is named, never read here
    layer = _layer_bytes()
    found = turn_search.search(row(PICK, 0, 10**6, 10 * layer), lora, ONE_GPU, 10 * layer,
                               fake_compiles(layer, 0, 10**6, 10 * layer, compiled := []))
    assert compiled == [] and found.best is None
    assert "not written for LoRA runs" in turn_search.describe(found)[0]
