"""`--plot`: the KV blocks of a run over time, as a PNG (the matplotlib extra).

Reads only what the engine recorded (its StepLog's timeline, thinned to a few thousand points on a
long run, and its memory plan), like the report. The PNG is
written like every file a run writes (io/file_safety.py): its path checked before the run and again
here, then a temporary file renamed over it, never through a link.
"""
from __future__ import annotations

import io
from pathlib import Path

from pagedrun.io.file_safety import check_plot, replace_file


def plot_blocks(engine, path: Path, out: Path | None = None, inputs: tuple[Path, ...] = ()) -> None:
    """Blocks in use (and free blocks still cached) against capacity over time, preemptions marked.
    `out`, `inputs`: the run's -o and input files, which the plot may not replace."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = engine.steps.timeline()  # at most a few thousand points, whatever the run's length
    t = [p.t_end for p in points]
    used = [p.blocks_in_use for p in points]
    cached = [p.blocks_in_use + p.blocks_cached_free for p in points]
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.fill_between(t, used, cached, step="post", alpha=0.25, color="tab:green", label="free, prefix-cached")
    ax.step(t, used, where="post", color="tab:blue", label="blocks in use")
    ax.axhline(engine.memory.num_gpu_blocks, color="k", ls="--", lw=1, label="capacity")
    for attr, color, label in (("preempted_recompute", "tab:red", "preemption (recompute)"),
                               ("preempted_swap", "tab:orange", "preemption (swap)")):
        # A point carries the preemptions of the steps it stands for (report/metrics.py).
        pts = [(p.t_end, p.blocks_in_use) for p in points if getattr(p, attr)]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker="x", color=color, zorder=3, label=label)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel(f"KV blocks ({engine.memory.block_size} tokens)")
    ax.set_ylim(0, engine.memory.num_gpu_blocks * 1.08)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4, fontsize="small", frameon=False)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    if out is not None:
        check_plot(path, out, inputs)  # again: the run took a while, the path may have changed
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, png.getvalue())
