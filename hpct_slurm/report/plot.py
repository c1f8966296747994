"""The PNG timeline of a report: one lane per rank with a marker per completed step, recovery
phases as vertical bands, faults as dashed lines named after the node. matplotlib (Agg) is
imported here only, so the CLI stays fast."""
from __future__ import annotations

from pathlib import Path

from ..errors import HpctError
from .model import PHASES, Report

PHASE_COLORS = {"detect_to_stop": "#d62728", "fence": "#ff7f0e",
                "survivors_ready": "#bcbd22", "reform_restore_first_step": "#2ca02c"}


def plot_timeline(rep: Report, path: Path) -> Path:
    """Write the timeline of `rep` to `path` (PNG) and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rep.steps and not rep.faults:
        raise HpctError(f"run dir {rep.run_dir!r} has no completed step and no fault: "
                        f"nothing to plot")
    path = Path(path)
    if not path.parent.is_dir():
        raise HpctError(f"--png {str(path)!r}: directory {str(path.parent)!r} does not exist")
    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.45 * max(1, _lanes(rep))))
    kept = [(s.t_s, r, s.step) for s in rep.steps if not s.recomputed for r in s.ranks]
    redone = [(s.t_s, r) for s in rep.steps if s.recomputed for r in s.ranks]
    if kept:
        sc = ax.scatter([k[0] for k in kept], [k[1] for k in kept], c=[k[2] for k in kept],
                        cmap="viridis", marker="|", s=120, linewidths=1.2)
        fig.colorbar(sc, ax=ax, pad=0.01).set_label("step")
    if redone:
        ax.scatter([k[0] for k in redone], [k[1] for k in redone], color="red", marker="x",
                   s=30, label="completion later recomputed")
    for rec in rep.recoveries:
        t = rec.detect_s
        for phase in PHASES:
            width = rec.phases.get(phase)
            if width is None:
                continue
            ax.axvspan(t, t + width, color=PHASE_COLORS[phase], alpha=0.35, lw=0,
                       label=phase.replace("_", " "))
            t += width
        if not rec.phases:
            ax.axvspan(rec.detect_s, rec.detect_s + 0.01, color="grey", alpha=0.5,
                       label="recovery (unfinished)")
    top = _lanes(rep) - 0.4
    for f in rep.faults:
        ax.axvline(f.t_s, color="black", ls="--", lw=1)
        ax.text(f.t_s, top, f" {f.node}: {f.reason}", rotation=90, va="top", ha="right",
                fontsize=8)
    for g in rep.generations:
        ax.axvline(g.start_s, color="grey", lw=0.6, alpha=0.6)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    if unique:
        ax.legend(unique.values(), unique.keys(), loc="upper left", fontsize=8,
                  bbox_to_anchor=(0, -0.18), ncol=min(5, len(unique)), frameon=False)
    ax.set_xlabel("seconds since the controller started")
    ax.set_ylabel("rank: node(s)")
    ax.set_ylim(-0.6, _lanes(rep) - 0.4)
    ax.set_yticks(range(_lanes(rep)), [_lane_label(rep, r) for r in range(_lanes(rep))])
    good = "-" if rep.goodput is None else f"{100 * rep.goodput:.1f}%"
    ax.set_title(f"job {rep.job_id}: {rep.steps_completed} steps, {rep.steps_recomputed} "
                 f"recomputed, {len(rep.faults)} fault(s), goodput {good}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _lanes(rep: Report) -> int:
    return 1 + max((r for s in rep.steps for r in s.ranks), default=0)


def _lane_label(rep: Report, rank: int) -> str:
    """`2: n3>n5`: the nodes that held a rank, in generation order."""
    nodes: list[str] = []
    for g in rep.generations:
        per_node = max(1, _lanes(rep) // max(1, len(g.members)))
        if rank // per_node < len(g.members):
            node = g.members[rank // per_node]
            if not nodes or nodes[-1] != node:
                nodes.append(node)
    return f"{rank}: {'>'.join(nodes)}" if nodes else str(rank)
