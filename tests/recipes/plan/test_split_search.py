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


def test_a_count_with_more_host_layers_that_compiled_faster_is_the_pick_and_the_plan_says_why():
    """The step is not monotone in the host-layer count (XLA schedules each count's copies its own way): the
    fewest that fit (3 of 8) compiled slower than a count the bisection also compiled (4); the faster is the
    pick, the fewest is kept and named."""
    hbm = lambda k: 10.0 - k   # noqa: E731  (fits 7 GiB from 3 host layers)
    steps = {3: 1.9, 4: 1.4, 8: 1.6}

    def compile_rows(candidates):
        rows = []
        for c in candidates:
            k = int(c.optimizer_state.split(":")[1])
            rows.append(row(c, hbm(k), steps.get(k, 1.0 + 0.1 * k), 7.0))
        return rows

    found = split_search.search(row(Candidate.of("save_dots"), hbm(0), 1.0, 7.0), 8, compile_rows)
    assert found.fewest == 3 and found.best == 4
    assert found.to_dict()["best_host_layers"] == 4 and found.to_dict()["fewest_host_layers"] == 3
    text = "\n".join(split_search.describe(found))
    assert "opt state host:4" in text and "host:3, the fewest host layers that fit, compiled slower (1900 ms)" in text
    # Monotone steps: the fewest that fit stays the pick and nothing more is said.
    monotone = split_search.search(row(Candidate.of("save_dots"), hbm(0), 1.0, 7.0), 8,
                                   fake_compiles(hbm, 7.0, []))
    assert monotone.best == 3 and monotone.fewest is None
    assert "not monotone" not in "\n".join(split_search.describe(monotone))


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
    as_fast_less_hbm = row(Candidate.of("recompute_all"), 85.0, 1.0, 80.0)
    assert split_search.base_plan([fast, as_fast_less_hbm, host]) is as_fast_less_hbm


HBM_LIMIT, HOST_RAM = 126.9, 1397.0   # one H200 at 0.9, and 1,500 GB of host RAM (GiB)


def host_bound_row(k: int | None, layers: int = 80, moved_gib: float = 14.0, shed_gib: float | None = None
                   ) -> PlanRow:
    """A made-up 70B-like plan: every layer's weights and state streamed (k = layers: 67.5 GiB of HBM, 1,432 GiB
    of host), each layer moved into HBM adding `moved_gib` there and taking `shed_gib` (default the same) from
    the host; k None: all on device."""
    shed_gib = moved_gib if shed_gib is None else shed_gib
    if k is None:
        candidate, hbm, host = Candidate.of("recompute_all"), 1363.0, 6.0
    else:
        candidate = (Candidate.of("recompute_all", "host", "host") if k == layers
                     else split_search.split_candidate("recompute_all", k, weights=True))
        hbm, host = 67.5 + (layers - k) * moved_gib, 1432.0 - (layers - k) * shed_gib
    r = PlanRow(candidate, "flash", {"hbm_bytes": hbm * GiB, "host_bytes": host * GiB}, None, {}, compute_s=1.0,
                compile_s=0.0, forward_s=1.0 + 0.01 * (k or 0), backward_s=0.0, update_s=0.0)
    r.fits = hbm <= HBM_LIMIT and host <= HOST_RAM
    return r


def test_a_streamed_plan_over_the_host_moves_its_first_layers_into_hbm_until_the_host_holds_the_rest():
    base, device = host_bound_row(80), host_bound_row(None)
    assert split_search.host_bound_bases([device, base], HBM_LIMIT * GiB, HOST_RAM * GiB, 1) == [base]
    compiled = []

    def compile_rows(candidates):
        compiled.extend(candidates)
        return [host_bound_row(int(c.optimizer_state.split(":")[1])) for c in candidates]

    found = split_search.search_toward_hbm(base, device, 80, HBM_LIMIT * GiB, compile_rows)
    # HBM holds 4 layers moved (67.5 + 4 x 14 = 123.5 GiB; 5: 137.5), and the host then holds 1,376 GiB
    assert found.best == 76 and found.rows[76].fits and not found.rows[75].fits
    assert all(c.params == c.optimizer_state for c in compiled)    # one split for weights and state
    assert 0 not in [int(c.optimizer_state.split(":")[1]) for c in compiled]
    assert len(compiled) <= split_search.MAX_SPLIT_COMPILES
    unknown_device = split_search.search_toward_hbm(base, None, 80, HBM_LIMIT * GiB, compile_rows)
    assert unknown_device.best == 76 and 0 not in unknown_device.rows   # refused uncompiled: known not to fit
    text = "\n".join(split_search.describe(found))
    assert "weights and opt state host:76" in text and "the first 4 layers' moved into HBM" in text


def test_a_host_excess_larger_than_hbm_can_take_is_not_searched_and_a_host_that_never_fits_is_said():
    too_far = host_bound_row(80)
    too_far.report["host_bytes"] = 1500.0 * GiB           # 103 GiB over, 59.4 GiB of HBM to spare
    assert split_search.host_bound_bases([too_far], HBM_LIMIT * GiB, HOST_RAM * GiB, 1) == []
    base, device = host_bound_row(80), host_bound_row(None)
    found = split_search.search_toward_hbm(
        base, device, 80, HBM_LIMIT * GiB,
        lambda cs: [host_bound_row(int(c.optimizer_state.split(":")[1]), shed_gib=5.0) for c in cs])
    # HBM holds 4 layers moved (123.5 GiB) and the host then still needs 1,412 GiB: fewer host layers HBM
    # cannot hold, more the host cannot
    assert found.best is None and found.rows[76].report["hbm_bytes"] <= HBM_LIMIT * GiB and not found.rows[76].fits
    text = "\n".join(split_search.describe(found))
    assert "no count of layers moved into HBM makes the host hold the rest" in text


def test_another_activation_plan_whose_state_alone_on_host_fits_is_searched_when_it_could_beat_the_pick():
    """The 8B at 8 micro-batches, in made-up numbers: save_all's pick needs its weights split (step 9.4),
    save_dots' device step is 7.6 and its state alone on host fits HBM: its state split is searched and wins."""
    from spillway.recipes.plan import planner

    limit = 126.9
    save_all_dev = row(Candidate.of("save_all"), 218.0, 7.5, limit)
    save_dots_dev = row(Candidate.of("save_dots"), 150.0, 7.6, limit)
    save_dots_host = row(Candidate.of("save_dots", "host"), 88.5, 9.6, limit)
    slow_dev = row(Candidate.of("recompute_all"), 130.0, 9.5, limit)          # slower than the pick: not searched
    slow_host = row(Candidate.of("recompute_all", "host"), 60.0, 11.0, limit)
    first = split_search.SplitSearch("save_all", 32, {0: save_all_dev}, None, weights=True)
    first.rows[25] = row(split_search.split_candidate("save_all", 25, True), 125.0, 9.4, limit)
    first.best = 25
    compiled = []

    def compile_rows(candidates):
        out = []
        for c in candidates:
            k = int(c.optimizer_state.split(":")[1])
            compiled.append((c.activations, k))
            out.append(row(c, 150.0 - 2.6 * k, 7.6 + 2.0 * k / 32, limit))   # 2.6 GiB and 63 ms a host layer
        return out

    rows = [save_all_dev, save_dots_dev, save_dots_host, slow_dev, slow_host]
    assert split_search.other_bases(rows, 9.4, {"save_all"}) == [save_dots_dev]
    found = planner._faster_state_split(first, rows, 32, compile_rows)
    fewest = next(k for k in range(33) if 150.0 - 2.6 * k <= limit)            # 9 host layers
    assert found.activations == "save_dots" and not found.weights and found.best == fewest
    assert {a for a, _ in compiled} == {"save_dots"}
    never_faster = planner._faster_state_split(first, [save_all_dev, slow_dev, slow_host], 32, compile_rows)
    assert never_faster is first
