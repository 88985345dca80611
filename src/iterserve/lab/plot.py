"""Slot occupancy over steps (a Gantt chart) for each batching mode, as a PNG.

One row per slot, one bar per request phase in that slot; short answers, long answers and
prefill phases have their own colours. Titles carry the mode's steps, utilisation and mean
latency, and the panels share the step axis so static and continuous batching compare at a
glance. matplotlib is imported lazily (Agg backend: no display needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from iterserve.lab.simulator import SimResult

COLORS = {"short": "#4c9be8", "long": "#f28e2b", "prefill": "#59a14f"}


def write_plot(results: dict[str, SimResult], summaries: dict[str, dict[str, Any]],
               path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    modes = list(results)
    slots = max(res.settings.slots for res in results.values())
    height = min(2.0 + 0.25 * slots, 9.0)
    fig, axes = plt.subplots(len(modes), 1, figsize=(12, height * len(modes)), sharex=True,
                             squeeze=False)
    for ax, mode in zip(axes[:, 0], modes):
        res = results[mode]
        if res.segments is None:
            raise ValueError("a plot needs runs made with record=True")
        per_slot: dict[int, tuple[list, list]] = {}
        for spec, segs in zip(res.specs, res.segments):
            for seg in segs:
                bars, colors = per_slot.setdefault(seg["slot"], ([], []))
                bars.append((seg["start"], seg["end"] - seg["start"]))
                kind = "prefill" if seg["kind"] == "prefill" else (
                    "long" if spec.long else "short")
                colors.append(COLORS[kind])
        for slot, (bars, colors) in per_slot.items():
            ax.broken_barh(bars, (slot - 0.4, 0.8), facecolors=colors,
                           edgecolors="white", linewidth=0.3)
        s = summaries[mode]
        ax.set_title(f"{mode} batching: {s['steps']:,} steps, utilisation "
                     f"{s['utilization']:.1%}, mean latency {s['mean_latency']:.0f} steps")
        ax.set_ylabel("slot")
        ax.set_ylim(-0.6, res.settings.slots - 0.4)
        if res.settings.slots <= 32:
            ax.set_yticks(range(res.settings.slots))
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("step")
    handles = [Patch(color=COLORS["short"], label="short answer"),
               Patch(color=COLORS["long"], label="long answer")]
    if any(not r.settings.prefill_ignored for r in results.values()):
        handles.append(Patch(color=COLORS["prefill"], label="prefill"))
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=100)
    plt.close(fig)
