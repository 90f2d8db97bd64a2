"""recipes/plan/split_search.py: the planner's bisection over the host-layer count, on made-up compile figures
(the real compiles of a split are in the slow test at the end)."""

from __future__ import annotations

import pytest

from spillway.recipes.plan import split_search
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.plan.result import PlanRow

GiB = 2**30


def row(candidate: Candidate, hbm_gib: float, step_s: float, limit_gib: float) -> PlanRow:
    r = PlanRow(candidate, "flash", {"hbm_bytes": hbm_gib * GiB}, None, {}, compute_s=1.0, compile_s=0.0,
                forward_s=step_s, backward_s=0.0, update_s=0.0)
    r.fits = hbm_gib <= limit_gib
    return r


def fake_compiles(hbm_of_layers, limit_gib, compiled):
    def compile_rows(candidates):
        rows = []
        for c in candidates:
            k = int(c.optimizer_state.split(":")[1])
            compiled.append(k)
            rows.append(row(c, hbm_of_layers(k), 1.0 + 0.1 * k, limit_gib))
        return rows
    return compile_rows


@pytest.mark.parametrize("limit", [79.5, 61.0, 40.0])
def test_the_search_finds_the_fewest_host_layers_that_fit_and_compiles_both_neighbours(limit):
    layers = 32
    hbm = lambda k: 80.0 - 1.25 * k   # noqa: E731  (a line: 80 GiB all resident, 40 all on host)
    compiled = []
    found = split_search.search(row(Candidate.of("save_dots"), hbm(0), 1.0, limit), layers,
                                fake_compiles(hbm, limit, compiled))
    fewest = next(k for k in range(layers + 1) if hbm(k) <= limit)
    assert found.best == fewest
    assert found.best - 1 in found.rows and not found.rows[found.best - 1].fits
    assert found.best + 1 in found.rows or found.best == layers
    assert len(compiled) == len(set(compiled)) <= split_search.MAX_SPLIT_COMPILES
    assert found.linear
    text = "\n".join(split_search.describe(found))
    assert f"opt state host:{fewest}, the last {fewest} of 32 block layers' state in host memory" in text
    assert ("one layer more on host" in text or found.best == layers) and "one layer more in HBM" in text
    assert "linear in the layer count" in text


def test_a_step_function_is_said_not_to_be_linear_and_nothing_fitting_is_said_too():
    hbm = lambda k: 8.0 if k < 3 else 6.5   # noqa: E731  (the shape the 1B compile showed)
    found = split_search.search(row(Candidate.of("save_dots"), 8.0, 1.0, 7.0), 4, fake_compiles(hbm, 7.0, []))
    assert found.best == 3 and not found.linear
    assert "not linear in the layer count" in "\n".join(split_search.describe(found))
    none = split_search.search(row(Candidate.of("save_dots"), 9.0, 1.0, 7.0), 4, fake_compiles(lambda k: 9.0, 7.0, []))
    assert none.best is None and "no count of host layers fits" in split_search.describe(none)[0]


def test_when_the_state_alone_cannot_make_it_fit_the_weights_are_split_too():
    """State on host saves 0.5 GiB a layer and never fits 7 GiB; each layer's weights on host too saves 1 GiB
    more: the fewest layers of both on host that fit is the pick, its neighbours compiled."""
    compiled = []

    def compile_rows(candidates):
        rows = []
        for c in candidates:
            k = int(c.optimizer_state.split(":")[1])
            weights = c.params != "device"
            assert not weights or c.params == c.optimizer_state   # one split for both
            compiled.append((k, weights))
            rows.append(row(c, 12.0 - (1.5 if weights else 0.5) * k, 1.0 + 0.1 * k, 7.0))
        return rows

    found = split_search.search(row(Candidate.of("save_dots"), 12.0, 1.0, 7.0), 6, compile_rows)
    assert found.weights and found.best == 4 and found.state_only.best is None
    assert (6, False) in compiled and {(3, True), (4, True), (5, True)} <= set(compiled)
    text = "\n".join(split_search.describe(found))
    assert "weights and opt state host:4, the last 4 of 6 block layers' weights and state in host memory" in text
    assert "the state alone on host does not fit" in text and "one layer more in HBM (host:3)" in text


def test_the_base_plan_is_the_fastest_device_state_plan_that_does_not_fit_and_beats_every_fit():
    fast = row(Candidate.of("save_dots"), 90.0, 1.0, 80.0)
    slow = row(Candidate.of("recompute_all"), 85.0, 1.5, 80.0)
    host = row(Candidate.of("save_dots", "host"), 50.0, 2.0, 80.0)
    assert split_search.base_plan([fast, slow, host]) is fast
    fitting_fast = row(Candidate.of("offload_dots"), 70.0, 0.9, 80.0)
    assert split_search.base_plan([fast, slow, host, fitting_fast]) is None
