"""``mpicomm plot``: curves from one or several metrics files, so runs of different algorithms compare at a glance.

Three panels from the evaluation records: the metric against epoch, against wall-clock seconds and
against megabytes sent by rank 0. One line per file, labelled by the file's parent folder (or ``--labels``);
a resumed run is one line (see :func:`~mpicomm.training.metrics.continued`).
"""

from __future__ import annotations

import os

from .metrics import continued, read_metrics

_AXES = {"step", "epoch", "wall_s", "train_s", "bytes_sent", "bytes_received", "bytes_contributed"}

__all__ = ["plot_runs"]


def plot_runs(paths: list[str], output: str, metric: str = "test_accuracy", labels: list[str] | None = None) -> str:
    """Write a PNG with ``metric`` vs epoch, wall time and bytes sent for each metrics file; return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if labels is not None and len(labels) != len(paths):
        raise ValueError(f"--labels: got {len(labels)} labels for {len(paths)} metrics files")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, path in enumerate(paths):
        if not os.path.isfile(path):
            raise ValueError(f"metrics file {path!r} does not exist")
        every = [r for r in continued(read_metrics(path)) if r.get("event") == "eval"]
        evals = [r for r in every if metric in r]
        if not evals:
            found = sorted({k for r in every for k, v in r.items() if isinstance(v, (int, float))} - _AXES)
            raise ValueError(f"{path}: no evaluation records with {metric!r}; "
                             f"--metric can be one of {', '.join(found) or '(none: no evaluation ran)'}")
        label = labels[i] if labels else os.path.basename(os.path.dirname(os.path.abspath(path)))
        y = [r[metric] for r in evals]
        for ax, key, scale in ((axes[0], "epoch", 1), (axes[1], "wall_s", 1), (axes[2], "bytes_sent", 1e-6)):
            ax.plot([r[key] * scale for r in evals], y, marker="o", markersize=3, label=label)
    for ax, xlabel in zip(axes, ("epoch", "wall-clock seconds", "MB sent by rank 0")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(metric.replace("_", " "))
        ax.grid(alpha=0.3)
    axes[2].set_xscale("symlog", linthresh=0.01)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output
