"""Goodput vs GPUs (log x) for both recovery schemes; matplotlib imported only here."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .model import Result


def plot_goodput(path: Path, results: Sequence[Result], mark: int | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = [r.gpus for r in results]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(gpus, [r.ckpt_restart_goodput * 100 for r in results], "o-", color="#dd8452",
            label="checkpoint-restart")
    ax.plot(gpus, [r.hpct_goodput * 100 for r in results], "o-", color="#4c72b0",
            label="hpct-slurm")
    ax.plot(gpus, [r.hpct_goodput_incl_spares * 100 for r in results], ":", color="#4c72b0",
            label="hpct-slurm, idle spares charged")
    # The published anchor: HyperPod checkpointless > 95% goodput at 2,304 GPUs.
    ax.axhline(95, color="grey", lw=0.8, ls="--")
    ax.axvline(2304, color="grey", lw=0.8, ls="--")
    if mark is not None:
        ax.axvline(mark, color="black", lw=0.8)
    ax.set(xscale="log", xlabel="GPUs in the job", ylabel="goodput, %", ylim=(0, 100),
           title="Goodput vs job size (model; see defaults.json for sources)")
    ax.legend(loc="lower left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
