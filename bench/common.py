"""The benchmarks' shared harness: where results go, what they were measured on, tables, JSON and plots.

Every script under ``bench/<what it measures>/`` puts the repository on ``sys.path`` and imports from here.
Figures the docs quote go to ``docs/results/`` (committed); a script's own JSON to ``bench/results/``; the
raw runs of the wall-clock benchmarks to ``bench/results/runs/`` (both ignored).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "docs", "results")
BENCH_RESULTS = os.path.join(REPO, "bench", "results")
RUNS = os.path.join(BENCH_RESULTS, "runs")

__all__ = ["BENCH_RESULTS", "REPO", "RESULTS", "RUNS", "enter_loopback_namespace", "machine", "markdown_table",
           "plot_series", "write_json", "write_outputs", "write_table"]


def enter_loopback_namespace() -> None:
    """Re-run this script inside a loopback-only network namespace when root (no MPI byte leaves the machine)."""
    if os.environ.get("MPICOMM_NETNS") or os.geteuid() != 0 or shutil.which("unshare") is None:
        return
    os.environ["MPICOMM_NETNS"] = "loopback"
    script = 'ip link set lo up && exec "$0" "$@"'
    os.execvp("unshare", ["unshare", "-n", "bash", "-c", script, sys.executable, *sys.argv])


def machine() -> dict:
    """What the numbers were measured on."""
    import platform

    import torch

    return {"cpus": os.cpu_count(), "cpu_model": _cpu_model(), "python": platform.python_version(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "omp_num_threads": 1}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def plot_series(path: str, panels: list[dict], title: str) -> None:
    """Save side-by-side line plots; each panel: ``{"title", "xlabel", "ylabel", "series": {label: (x, y)}}``.

    Optional panel keys: ``hline`` (a dotted reference line), ``logx``, ``legend`` (the last panel always has one).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for label, (x, y) in panel["series"].items():
            ax.plot(x, y, marker=".", label=label)
        if panel.get("hline") is not None:
            ax.axhline(panel["hline"], color="grey", linestyle=":", linewidth=1)
        if panel.get("logx"):
            ax.set_xscale("log")
        ax.set_title(panel["title"], fontsize=10)
        ax.set_xlabel(panel["xlabel"])
        ax.set_ylabel(panel["ylabel"])
        ax.grid(alpha=0.3)
        if panel.get("legend") or panel is panels[-1]:
            ax.legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(path: str, payload: dict) -> None:
    """Write ``payload`` as indented JSON (creating the folder)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)


def write_table(name: str, title: str, table: str, payload: dict) -> None:
    """docs/results/<name>.md (title + table) and .json (payload + machine); print both."""
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write(f"{title}\n\n{table}\n")
    write_json(os.path.join(RESULTS, f"{name}.json"), {"title": title, "machine": machine(), **payload})
    print(f"{title}\n\n{table}\nwrote {RESULTS}/{name}.{{md,json}}")


def write_outputs(name: str, title: str, table: str, payload: dict, panels: list[dict]) -> None:
    """:func:`write_table`, plus docs/results/<name>.png (the panels)."""
    write_table(name, title, table, payload)
    plot_series(os.path.join(RESULTS, f"{name}.png"), panels, title)
