"""Shared helpers for benchmarks: what machine ran it, where results go, one bar chart."""
from __future__ import annotations

import json
import os
import platform
import socket
import sys
from pathlib import Path
from typing import Any, Sequence


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def machine_info() -> dict[str, Any]:
    """Enough to tell whether two results are comparable."""
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(),
        "mem_bytes": _mem_bytes(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }
    try:
        import torch
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        info["torch"] = None
    return info


def write_result(out_dir: str | os.PathLike, name: str, data: dict[str, Any]) -> Path:
    """Write `<out_dir>/<name>.json` with the machine info attached; returns the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    record = {"bench": name, "machine": machine_info(), **data}
    path.write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def plot_bars(path: str | os.PathLike, labels: Sequence[str], values: Sequence[float],
              ylabel: str, title: str, errors: Sequence[float] | None = None) -> Path:
    """A labelled bar chart as PNG (Agg backend: no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    many = len(labels) > 6  # long label lists are rotated, on a wider figure
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(labels)), 4.5 if many else 3.5))
    palette = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3"]
    bars = ax.bar(list(labels), list(values), yerr=list(errors) if errors else None, capsize=4,
                  color=[palette[i % len(palette)] for i in range(len(labels))])
    ax.bar_label(bars, fmt="%.3g")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10 if many else None)
    if many:
        ax.tick_params(axis="x", labelrotation=45)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def free_port() -> int:
    """A loopback TCP port nobody listens on now (for a benchmark's own rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
