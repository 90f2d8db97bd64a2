"""`spillway plan`'s table (and the `--search` table) as text; `--json` is `Plan.to_dict`, `--png` chart.py."""

from __future__ import annotations

from spillway.recipes.config import PENDING_HOST
from spillway.recipes.plan import compute_model, host_peak, split_search, turn_search
from spillway.recipes.plan.candidates import Candidate
from spillway.recipes.plan.result import (ASSUMPTIONS, Plan, PlanRow, dropped_offload, hbm_limit_words,
                                         nothing_fits_numbers)

GiB = 2**30
GB = 10**9


def _host_peak_cell(report: dict, devices: int) -> str:
    """The host's peak over a run's phases and the phase (recipes/plan/host_peak.py): "183.4 save"."""
    if not report:
        return "-"
    phase, peak = host_peak.host_peak(report, devices)
    return f"{peak / GiB:.1f} {phase.removeprefix('checkpoint ')}"


def _peak(target, compute_dtype: str) -> tuple[float, str]:
    flops, name = compute_model.peak_flops(target, compute_dtype)
    return flops / 1e12, name


def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def ms_text(seconds: float | None) -> str:
    """Milliseconds: one decimal from 10 ms, three below (a tiny model's step is a fraction of one)."""
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    return f"{ms:.1f}" if ms >= 10 or ms == 0 else f"{ms:.3f}"


def _phases(row: PlanRow) -> str:
    if row.forward_s is None:
        return "-"
    # whole milliseconds where the step is long enough for them; a step of a few ms gets the step's decimals
    decimals = 0 if (row.step_s or 0) >= 0.1 else 1 if (row.step_s or 0) >= 0.01 else 3
    return "/".join(f"{seconds * 1e3:.{decimals}f}" for seconds in (row.forward_s, row.backward_s, row.update_s))


# The settings columns: (header, least width). Each is as wide as its longest value in the table, so that
# a split (host:32) or a long activation plan does not push the figures after it out of their columns.
_SETTINGS_COLUMNS = (("plan", 36), ("state", 6), ("params", 7), ("upd_on_host", 11), ("update", 27))


def _settings_values(candidate: Candidate) -> tuple[str, ...]:
    """The plan's recipe values under the table's plan, state, params, upd_on_host and update columns (the
    update's pending gradients named where they wait in HBM, offload.pending_gradients=device)."""
    settings = candidate.settings()
    params = settings["offload.params"] + (f" keep={candidate.params_keep}" if candidate.params_keep else "")
    update = settings["offload.update"] + (f" pending={candidate.pending_gradients}"
                                           if candidate.pending_gradients != PENDING_HOST else "")
    return (settings["offload.activations"], settings["offload.optimizer_state"], params,
            settings["optimizer.update_on_host"], update)


def _settings_widths(candidates) -> tuple[int, ...]:
    values = [_settings_values(c) for c in candidates]
    return tuple(max([least, len(name)] + [len(v[i]) for v in values])
                 for i, (name, least) in enumerate(_SETTINGS_COLUMNS))


def _settings_cells(candidate: Candidate, widths: tuple[int, ...] | None = None) -> str:
    values = _settings_values(candidate)
    widths = widths or _settings_widths([candidate])
    return " ".join(f"{value:{width}s}" for value, width in zip(values, widths))


def render(p: Plan) -> str:
    s = p.summary()
    t = p.target
    lines = [
        f"spillway plan: {s['recipe']} on {p.devices} x {t.display_name} (deviceless compile, "
        f"jax {p.timing['jax_version']})",
        f"  model      {s['params'] / 1e9:.3f}B params, {s['layers']} layers, {s['param_dtype']} weights, "
        f"{s['dtype']} compute; attention {s['attention_impl']}",
        f"  step       {s['global_batch']} x {s['seq_len']} = {s['tokens_per_step']} tokens/step "
        f"(grad_accum {s['grad_accum']}); mesh " + " ".join(f"{k}={v}" for k, v in p.mesh.items()),
        f"  limits     HBM {hbm_limit_words(p)} per GPU; "
        f"host RAM {p.host_ram_bytes / GiB:.1f} GiB for {p.devices} GPU(s)",
        f"  rates      {t.host_link} {t.host_link_bytes_per_s / GB:.0f} GB/s per direction"
        f"{', both at once' if t.host_link_duplex else ', directions taking turns'}; "
        "{:.0f} TFLOP/s dense {}".format(*_peak(t, s["dtype"])),
    ]
    if p.compute_basis:
        lines.append(f"  compute    counted FLOPs at {p.compute_basis}")
    if p.host_update is not None and any(row.candidate.update_on_host for row in p.rows):
        h = p.host_update
        lines.append(f"  host CPU   update {h['params_per_s_per_core'] / 1e6:.0f} M params/s per core x "
                     f"{h['cores_per_gpu']:g} cores per GPU for the plans with optimizer.update_on_host=true "
                     f"({h['source']})")
    lines += [f"  warning    {w}" for w in p.warnings]
    widths = _settings_widths([row.candidate for row in p.rows])
    header = ("  " + " ".join(f"{name:{width}s}" for (name, _), width in zip(_SETTINGS_COLUMNS, widths))
              + f" {'attn':5s} "
              f"{'HBM GiB':>8s} {'host GiB':>8s} {'peak GiB':>17s} {'xfer GB':>8s} "
              f"{'xfer ms':>8s} {'comp ms':>8s} {'step ms':>8s} {'fwd/bwd/update ms':>18s}  fits")
    lines += ["", header, "  " + "-" * (len(header) - 2)]
    for row in p.rows:
        r = row.report or {}
        moved = None if not r else (r["device_to_host_bytes"] + r["host_to_device_bytes"]) / GB
        fits = "yes" if row.fits else f"no ({row.why_not})"
        lines.append(
            f"{'*' if row.pick else ' '} {_settings_cells(row.candidate, widths)} "
            f"{row.attention_impl:5s} {_gib(r.get('hbm_bytes')):>8s} {_gib(r.get('host_bytes')):>8s} "
            f"{_host_peak_cell(r, p.devices):>17s} "
            f"{'-' if moved is None else f'{moved:.2f}':>8s} "
            f"{ms_text(row.transfer_s):>8s} "
            f"{ms_text(row.compute_s):>8s} {ms_text(row.step_s):>8s} {_phases(row):>18s}  {fits}")
    picked = p.picked
    lines.append("")
    if picked is None:
        lines.append("  no plan fits: " + nothing_fits_numbers(p))
    else:
        lines.append(f"  * pick: {picked.candidate.label} (fastest estimated step among the plans that fit)")
        lines.append(f"  train it:  {p.train_command()}" + (
            "   (the recipe's own offload settings)" if not p.pick_set_arguments() else ""))
    if p.split is not None:
        lines += split_search.describe(p.split)
    if p.turn is not None:
        lines += turn_search.describe(p.turn)
    lines += _skipped_lines(p)
    lines.append("  " + ASSUMPTIONS)
    lines.append("  columns: plan = offload.activations, state = offload.optimizer_state, params = offload.params "
                 "(keep=K: offload.params_keep), upd_on_host = optimizer.update_on_host, update = offload.update; xfer GB: both directions "
                 "together; HBM/host GiB per GPU (2^30 bytes).")
    if p.search is not None:
        lines += ["", *render_search(p)]
    cached = p.timing.get("cached", 0)
    lines.append(f"  {p.timing['compiles']} compiles" + (f", {cached} from the compile cache" if cached else "")
                 + f" in {p.timing['total_s']:.1f} s "
                 f"({p.timing['workers']} compile process(es), start-up {p.timing['child_startup_s']:.1f} s)")
    return "\n".join(lines)


def render_search(p: Plan) -> list[str]:
    search = p.search
    axis = search["axis"]
    unit = "tokens" if axis == "seq_len" else "sequences"
    lines = [f"  search: largest {axis} that fits, per plan (multiples of {search['step']} {unit}, "
             f"cap {search['cap']})"]
    results = search["results"]
    candidates = [Candidate.from_dict(r) for r in results]   # each row's, read once
    # columns as wide as their longest entry: a recipe's activation plan or split placement outgrew fixed widths
    plan_width = max([len("plan"), *(len(r["activations"]) for r in results)])
    settings_width = max([len("settings"), *(len(c.placement_label) for c in candidates)])
    header = (f"  {'plan':{plan_width}s} {'settings':{settings_width}s} {axis:>10s}  {'compiles':>8s} "
              f"{'seconds':>8s}  notes")
    lines += [header, "  " + "-" * (len(header) - 2)]
    best_baseline = max((r["best"] or 0 for r, c in zip(results, candidates) if c.no_offload), default=0)
    # a plan whose offload XLA dropped (the table above) offloads nothing at any length: said beside its figure
    dropped = {row.candidate.label for row in p.rows if dropped_offload(row.candidate, row.report)}
    for r, candidate in zip(results, candidates):
        notes = []
        if candidate.label in dropped:
            notes.append("offload dropped in the compiled step (table above): not a plan to take")
        if r["at_cap"]:
            notes.append("fits at the cap")
        elif not r["resolved"]:
            notes.append(f"unresolved between {r['best']} and {r['first_fail']}")
        if r["errors"]:
            notes.append(r["errors"][0].splitlines()[0][:120])
        if candidate.no_offload:
            notes.append("no offload")
        elif best_baseline and r["best"]:
            notes.append(f"{r['best'] / best_baseline:.1f}x the best without offload")
        lines.append(f"  {r['activations']:{plan_width}s} {candidate.placement_label:{settings_width}s} "
                     f"{'none' if r['best'] is None else r['best']:>10} {r['compiles']:8d} {r['seconds']:8.1f}  "
                     + "; ".join(notes))
    return lines


def _skipped_lines(p: Plan) -> list[str]:
    """The candidates not compiled, in two lines: those a faster plan that fits beats, and those whose bounds
    cannot fit (the reason of each: a host peak at save or restore names its phase and bytes)."""
    beaten = [entry for entry in p.skipped if not entry.get("cannot_fit")]
    refused = [entry for entry in p.skipped if entry.get("cannot_fit")]
    lines = []
    if beaten:
        by_plan: dict[str, list[str]] = {}
        for entry in beaten:
            by_plan.setdefault(entry["activations"], []).append(Candidate.from_dict(entry).placement_label)
        lines.append(f"  not compiled ({len(beaten)}), as the same activations with less in host memory (or, "
                     f"for a host-CPU update, streamed) fit and are at least as fast (--all-plans compiles them "
                     f"too): "
                     + "; ".join(f"{plan_spec} with {', '.join(placements)}"
                                 for plan_spec, placements in by_plan.items()))
    if refused:
        lines.append(f"  not compiled ({len(refused)}), as they cannot fit whatever their step holds: "
                     + "; ".join(f"{entry['label']} ({_bare_reason(entry['because'])})"
                                 for entry in refused))
    return lines


def _bare_reason(because: str) -> str:
    """A refusal's reason without the words its line already says ("cannot fit: ...", "whatever the step holds")."""
    return because.removeprefix("cannot fit: ").removesuffix(", whatever the step holds")
