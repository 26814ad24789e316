"""``mpicomm plot``: curves from one or several metrics files, so runs of different algorithms compare at a glance.

Four panels: the training loss against the step (every logged window), and the evaluated metric against
the epoch, against wall-clock seconds and against megabytes sent by rank 0 (one point per evaluation:
every epoch by default). One line per file, labelled by the file's parent folder (or ``--labels``); a
resumed run is one line (see :func:`~mpicomm.training.metrics.continued`). Without ``--metric`` each file's
own app's metric is drawn (:data:`APP_METRICS`: the ResNet app's test accuracy, BERT's masked-token
accuracy).
"""

from __future__ import annotations

import os

from .metrics import continued, read_metrics

_AXES = {"step", "epoch", "wall_s", "train_s", "bytes_sent", "bytes_received", "bytes_contributed"}
_PANELS = (("epoch", 1, "epoch"), ("wall_s", 1, "wall-clock seconds"), ("bytes_sent", 1e-6, "MB sent by rank 0"))

APP_METRICS = ("test_accuracy", "val_mlm_accuracy")
"""What each app evaluates, in the order a file is searched for one when no metric is named."""

__all__ = ["APP_METRICS", "curves", "plot_runs"]


def _records(path: str, metric: str | None) -> tuple[list[dict], list[dict], str]:
    """(train records with a loss, eval records with the metric, the metric) of one metrics file; ``metric``
    None: the first of :data:`APP_METRICS` the file holds. A clear error if none."""
    if not os.path.isfile(path):
        raise ValueError(f"metrics file {path!r} does not exist")
    records = continued(read_metrics(path))
    every = [r for r in records if r.get("event") == "eval"]
    if metric is None:
        metric = next((m for m in APP_METRICS if any(m in r for r in every)), APP_METRICS[0])
    evals = [r for r in every if metric in r]
    if not evals:
        found = sorted({k for r in every for k, v in r.items() if isinstance(v, (int, float))} - _AXES)
        raise ValueError(f"{path}: no evaluation records with {metric!r}; "
                         f"--metric can be one of {', '.join(found) or '(none: no evaluation ran)'}")
    return [r for r in records if r.get("event") == "train" and r.get("loss") is not None], evals, metric


def curves(paths: list[str], metric: str | None = None, labels: list[str] | None = None) -> list[dict]:
    """What :func:`plot_runs` draws, per metrics file: ``label``, ``metric`` (the one drawn), ``loss`` (steps,
    losses) and, for each x axis (``epoch``, ``wall_s``, ``bytes_sent`` in MB), the points (x, metric)."""
    if labels is not None and len(labels) != len(paths):
        raise ValueError(f"--labels: got {len(labels)} labels for {len(paths)} metrics files")
    out = []
    for i, path in enumerate(paths):
        train, evals, drawn = _records(path, metric)
        run = {"label": labels[i] if labels else os.path.basename(os.path.dirname(os.path.abspath(path))),
               "metric": drawn, "loss": ([r["step"] for r in train], [r["loss"] for r in train])}
        for key, scale, _ in _PANELS:
            run[key] = ([r.get(key, 0) * scale for r in evals], [r[drawn] for r in evals])
        out.append(run)
    return out


def plot_runs(paths: list[str], output: str, metric: str | None = None, labels: list[str] | None = None) -> str:
    """Write a PNG of the training loss and ``metric`` (vs epoch, wall time and bytes) per metrics file; its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = curves(paths, metric, labels)
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    for run in runs:
        axes[0].plot(*run["loss"], label=run["label"])
        for ax, (key, _, _) in zip(axes[1:], _PANELS):
            ax.plot(*run[key], marker="o", markersize=3, label=run["label"])
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("training loss (mean over ranks)")
    for ax, (_, _, xlabel) in zip(axes[1:], _PANELS):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(" / ".join(dict.fromkeys(run["metric"] for run in runs)).replace("_", " "))
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[3].set_xscale("symlog", linthresh=0.01)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output
