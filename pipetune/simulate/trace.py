"""Pictures of timed schedules: a Gantt PNG (ranks as rows, like PipeTune Fig. 2) and a Chrome trace.

Both take a list of ``TimedAction`` (from the simulator or measured by the runtime), so simulated
and measured timelines look the same and can be laid side by side.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipetune.schedule.table import Op
from pipetune.simulate.simulator import TimedAction

COLOURS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "input gradient": "#E8A87C",
    "weight gradient": "#B05A28",
    "encoder": "#55A868",
    "precomputed encoder": "#8C8C8C",
    "encoder backward": "#C44E52",
    "idle": "#F2F2F2",
}


def kind_of(t: TimedAction) -> str:
    """Legend entry of an action: backbone forward / backward (or its input- and weight-gradient
    halves), encoder forward (pre-computed or not) or encoder backward, on any chunk."""
    a = t.action
    if a.is_encoder:
        return "encoder backward" if a.op is Op.BACKWARD else ("precomputed encoder" if t.precomputed else "encoder")
    return {Op.FORWARD: "forward", Op.BACKWARD: "backward", Op.BACKWARD_INPUT: "input gradient",
            Op.BACKWARD_WEIGHT: "weight gradient"}[a.op]


def chrome_trace(actions: list[TimedAction], *, title: str = "pipeline") -> dict:
    """Chrome/Perfetto trace events (``ph: X``), one thread per rank, times in microseconds."""
    ranks = sorted({t.rank for t in actions})
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": title}}]
    events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}} for r in ranks]
    for t in actions:
        events.append({
            "name": str(t.action),
            "cat": kind_of(t),
            "ph": "X",
            "pid": 0,
            "tid": t.rank,
            "ts": t.start * 1e6,
            "dur": (t.end - t.start) * 1e6,
            "args": {"module": "encoder" if t.action.is_encoder else "backbone", "chunk": t.action.chunk,
                     ("sub_micro_batch" if t.action.is_encoder else "micro_batch"): t.action.unit},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(actions: list[TimedAction], path: str | Path, *, title: str = "pipeline") -> Path:
    """Write ``.json`` (Chrome trace) or ``.png`` (Gantt chart), chosen by the file suffix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        path.write_text(json.dumps(chrome_trace(actions, title=title)))
    elif path.suffix == ".png":
        gantt_png(actions, path, title=title)
    else:
        raise ValueError(f"{path}: trace output must end in .json (Chrome trace) or .png (Gantt chart)")
    return path


def gantt_png(actions: list[TimedAction], path: str | Path, *, title: str = "pipeline") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted({t.rank for t in actions})
    end = max(t.end for t in actions)
    fig, ax = plt.subplots(figsize=(14, 0.7 * len(ranks) + 1.6))
    for r in ranks:
        ax.barh(r, end, left=0, height=0.8, color=COLOURS["idle"], edgecolor="none")
    for t in actions:
        width = t.end - t.start
        ax.barh(t.rank, width, left=t.start, height=0.8, color=COLOURS[kind_of(t)], edgecolor="white", linewidth=0.5)
        if width > end / 90:
            ax.text(t.start + width / 2, t.rank, str(t.action.unit), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel("time (s)")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="upper center",
              bbox_to_anchor=(0.5, -0.35 if len(ranks) < 4 else -0.18), ncol=6, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
