"""`spillway plan --png`: the plan table drawn as one figure (matplotlib).

Per candidate plan, two bars side by side: HBM per GPU split into what the
step's arguments and outputs hold (weights, gradients, optimizer state on
device: argument + output - alias) and its temporaries (activations,
workspace), and host bytes per GPU. Horizontal lines mark the HBM limit and
the host RAM share per GPU; the estimated step time is drawn as points on a
second axis, and the picked plan is starred. Plans that failed to compile
are left out (the text table names their error).
"""

from __future__ import annotations

from pathlib import Path

GiB = 2**30


def draw_plan(plan, path: str | Path) -> Path:
    """Draw `plan` (a recipes/plan/result.Plan) to the image file `path`; returns the path."""
    import matplotlib
    matplotlib.use("Agg")   # files only, never a window
    import matplotlib.pyplot as plt

    rows = [row for row in plan.rows if row.report is not None]
    if not rows:
        raise ValueError("--png: no plan compiled, nothing to draw (see the table's warnings)")
    labels = [f"{'* ' if row.pick else ''}{row.candidate.activations}\n"
              + row.candidate.placement_label.replace(" / ", "\n") for row in rows]
    temp = [row.report["temp_bytes"] / GiB for row in rows]
    held = [(row.report["hbm_bytes"] - row.report["temp_bytes"]) / GiB for row in rows]
    host = [row.report["host_bytes"] / GiB for row in rows]
    step_ms = [row.step_s * 1e3 if row.step_s is not None else float("nan") for row in rows]
    x = list(range(len(rows)))
    width = 0.38

    fig, ax = plt.subplots(figsize=(max(8.0, 1.1 * len(rows) + 3), 6.0))
    ax.bar([i - width / 2 for i in x], held, width, label="HBM: arguments + outputs", color="#4c72b0")
    ax.bar([i - width / 2 for i in x], temp, width, bottom=held, label="HBM: temporaries", color="#8fb0de")
    ax.bar([i + width / 2 for i in x], host, width, label="host (pinned)", color="#dd8452")
    limits = {"HBM limit": plan.hbm_limit_bytes / GiB, "host RAM per GPU": plan.host_ram_bytes / plan.devices / GiB}
    height, drawn = y_scale(max(max(h + t for h, t in zip(held, temp)), max(host)), limits)
    for (name, value), (color, style) in zip(limits.items(), (("#c44e52", "--"), ("#937860", ":"))):
        if name in drawn:
            ax.axhline(value, color=color, linestyle=style, label=f"{name} {value:.1f} GiB")
        else:
            ax.plot([], [], color=color, linestyle=style, label=f"{name} {value:.1f} GiB (above the chart)")
    ax.set_ylim(0, height)
    ax.set_ylabel("GiB per GPU")
    ax.set_xticks(x, labels, rotation=45, ha="right", fontsize=8)
    ax.set_title(f"{plan.recipe.name} on {plan.devices} x {plan.target.display_name} "
                 f"({plan.recipe.train.global_batch} x {plan.recipe.data.seq_len} tokens/step)")

    times = ax.twinx()
    times.plot(x, step_ms, "o", color="black", label="estimated step (ms)")
    for i, row in enumerate(rows):
        if not row.fits:
            times.plot([i], [step_ms[i]], "x", color="#c44e52", markersize=10)
    times.set_ylabel("estimated step time, ms (x: does not fit)")
    times.set_ylim(bottom=0)

    handles, names = ax.get_legend_handles_labels()
    more_handles, more_names = times.get_legend_handles_labels()
    ax.legend(handles + more_handles, names + more_names, loc="upper left", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def y_scale(tallest_bar: float, limits: dict[str, float]) -> tuple[float, set[str]]:
    """(the GiB axis' height, the limit lines drawn): the bars set the scale; a limit more than twice above
    them (a small model's 126 GiB of HBM beside 0.07) is named in the legend instead, else the bars would
    shrink to nothing under it."""
    top = 1.25 * max(tallest_bar, 1e-9)
    drawn = {name for name, value in limits.items() if value <= 2 * top}
    return 1.05 * max([top, *(limits[name] for name in drawn)]), drawn
