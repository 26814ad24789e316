"""What the training loop reports: evaluation of the averaged model, metrics lines, the progress bar.

Time per step is split three ways from the Communicator's clock: ``compute`` (outside communication
calls), ``comm`` (modelled transfer time the rank waited for; without ``--net``, all time blocked in
communication) and ``wait`` (blocked beyond the modelled transfer: slower peers, MPI's own copies). Under
``--net`` a fourth figure, ``hidden``, is the modelled transfer time of the step that compute hid (the step's
modelled cost less ``comm``; zero without overlap, and without a modelled network).
Monitoring collectives (the loss averages of a log line) go through the Communicator's control plane and
are not booked in the Ledger; evaluation runs unmetered (see :mod:`mpicomm.training.loop`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from .batchnorm import recomputed_statistics

__all__ = ["DRIFT_GAP", "Progress", "account", "drifted", "eval_line", "evaluate", "log_window"]

DRIFT_GAP = 0.10
"""How far (as a fraction: 10 points) the averaged model's accuracy may fall below the worst rank's own model
before :func:`drifted` calls the ranks drifted apart. Ranks that train well stay close and their average scores
as well as they do: on MNIST-1D at 8 ranks (docs/results/mnist1d.md) every method's averaged model ended within
0.1 points of its worst rank's. Ranks that drift apart each fit the data, but their average is none of their
models: Moniqua-AD-PSGD's bound-rule theta there left the average at chance, 48-73 points below every rank's own
model, in runs that otherwise ended normally."""


def _with_params(algo, flat: torch.Tensor, fn: Callable[[], dict]) -> dict:
    """Run ``fn`` with ``flat`` temporarily loaded into the model's flat buffer."""
    saved = algo.flat.data.clone()
    algo.flat.data.copy_(flat)
    try:
        was_training = algo.model.training
        algo.model.eval()
        with torch.no_grad():
            return fn()
    finally:
        algo.model.train(was_training)
        algo.flat.data.copy_(saved)


def evaluate(task, algo, bn_batches: int = 0) -> tuple[dict[str, float], dict]:
    """Collective: metrics of the averaged model, plus min/max of each metric over the ranks' own models;
    and the model that was evaluated (``{"params": flat, "buffers": {name: tensor}}``, the same on every rank
    when ``bn_batches`` > 0), which the final checkpoint keeps so that an export scores what the run reported.

    ``bn_batches`` > 0: the averaged model is evaluated with BatchNorm statistics recomputed for its own
    weights from that many training batches per rank (:mod:`.batchnorm`); 0: with this rank's statistics.
    The ranks' own models keep their own statistics.
    """
    average = algo.consensus_model()
    evaluated = {"params": average}

    def averaged() -> dict[str, float]:
        with recomputed_statistics(algo.model, task, bn_batches, algo.comm):
            evaluated["buffers"] = {name: b.detach().clone() for name, b in algo.model.named_buffers()}
            return task.evaluate(algo.model)

    out = _with_params(algo, average, averaged)
    own = _with_params(algo, algo.flat.data, lambda: task.evaluate(algo.model))
    everyone = algo.comm.allgather_object(own, "the evaluation's allgather")
    for key in own:
        values = [o[key] for o in everyone]
        out[f"{key}_rank_min"], out[f"{key}_rank_max"] = min(values), max(values)
    out["consensus_distance"] = algo.consensus_distance()
    return out, evaluated


def drifted(result: dict[str, float]) -> str:
    """The reason an evaluation's averaged model is not a trained model, or "" (see :data:`DRIFT_GAP`): an
    accuracy of the averaged model more than DRIFT_GAP below every rank's own model's."""
    for key, value in result.items():
        worst = result.get(f"{key}_rank_min")
        if key.endswith("accuracy") and worst is not None and value < worst - DRIFT_GAP:
            distance = result.get("consensus_distance")
            spread = "" if distance is None else f" (consensus distance {distance:.4g})"
            return (f"the averaged model scores {100 * value:.2f} % {key.replace('_', ' ')} while every rank's own "
                    f"model scores at least {100 * worst:.2f} %: the ranks' models have drifted apart{spread} and "
                    "their average is none of them")
    return ""


def eval_line(step: int, total: int, result: dict[str, float]) -> str:
    """One console line for an evaluation: its step and the averaged model's metrics (accuracies in %)."""
    shown = []
    for key, value in result.items():
        if key.endswith(("_rank_min", "_rank_max")) or not isinstance(value, (int, float)):
            continue
        shown.append(f"{key.replace('_', ' ')} {100 * value:.2f} %" if "accuracy" in key else
                     f"{key.replace('_', ' ')} {value:.4g}")
    return f"step {step}/{total}: " + ", ".join(shown)


class Progress:
    """tqdm on rank 0 when enabled and installed; silent otherwise."""

    def __init__(self, enabled: bool, total: int, initial: int):
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, initial=initial, unit="step", file=sys.stdout, dynamic_ncols=True)

    def update(self, n: int, **postfix) -> None:
        """Advance by ``n`` steps and show ``postfix``."""
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(n)

    def close(self) -> None:
        """Close the bar."""
        if self.bar is not None:
            self.bar.close()


def account(window: dict, elapsed: float, blocked: float, slept: float, cost: float | None) -> None:
    """Split one step's ``elapsed`` seconds into compute, comm and wait, and book the ``hidden`` part of its
    modelled transfer ``cost`` (None: no modelled network); see the module docstring."""
    comm = blocked if cost is None else slept
    window["step_s"] += elapsed
    window["compute_s"] += elapsed - blocked
    window["comm_s"] += comm
    window["wait_s"] += blocked - comm
    window["hidden_s"] += 0.0 if cost is None else max(0.0, cost - slept)
    window["n"] += 1


def log_window(metrics, progress, algo, step, epoch, window, counters, wall) -> None:
    """Collective: average the window over ranks, write a metrics line, advance the bar, reset the window."""
    n = max(window["n"], 1)
    timings = ("compute_s", "comm_s", "wait_s", "step_s", "hidden_s")
    local = [float(window["loss"]) / n] + [window[k] / n for k in timings]
    local += [float(counters[k]) for k in sorted(counters)]
    summed = [sum(vals) for vals in zip(*algo.comm.allgather_object(local, "the log line's allgather"))]
    size = algo.comm.size
    record = {"event": "train", "step": step, "epoch": epoch, "lr": algo.lr, "wall_s": wall,
              "loss": summed[0] / size, **{f"{k}_per_step": v / size for k, v in zip(timings, summed[1:])},
              **algo.comm.ledger.totals(), **algo.metrics()}
    for key, value in zip(sorted(counters), summed[1 + len(timings):]):
        record[f"sum_{key}"] = value
    if "correct" in counters and "count" in counters:
        record["train_accuracy"] = record["sum_correct"] / max(record["sum_count"], 1)
    metrics.write(record)
    progress.update(window["n"], loss=f"{record['loss']:.3f}", MB_sent=f"{record['bytes_sent'] / 1e6:.1f}")
    window.update(loss=0.0, compute_s=0.0, comm_s=0.0, wait_s=0.0, step_s=0.0, hidden_s=0.0, n=0)
    counters.clear()
