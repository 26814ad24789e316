"""After every step the ranks agree, in one small collective, whether to go on.

Two things stop a run: a stop signal on any rank (SIGUSR1/SIGTERM: checkpoint, then exit), and a
non-finite loss or parameter on any rank (the run has diverged: stop *without* checkpointing, so the
last checkpoint on disk is the last good state). Both ride on the same allgather of a few bytes per
step, the only per-step collective the loop adds.

The loss is checked every step (its value is read for the log anyway); the parameters, a pass over the
whole model, every ``log_every`` steps and before every checkpoint. A NaN that reaches a rank's
parameters shows in that rank's loss on its next step, so a divergence is caught within one step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Verdict", "agree", "local_problem"]


@dataclass(frozen=True)
class Verdict:
    """What every rank agreed on after a step: a signal to stop on (0: none), and a divergence (rank, what)."""

    signal: int = 0
    problem: str = ""
    rank: int = -1


def local_problem(loss: float, params: torch.Tensor | None = None) -> str:
    """What is non-finite on this rank (``""`` if nothing): the loss, or (when given) the parameters."""
    if not math.isfinite(loss):
        return f"loss is {loss}"
    if params is not None and not bool(torch.isfinite(params).all()):
        bad = int((~torch.isfinite(params)).sum())
        return f"{bad} of {params.numel()} parameters are non-finite"
    return ""


def agree(mpi_comm, signum: int | None, problem: str) -> Verdict:
    """Collective: the highest stop signal of any rank and the first rank's divergence, on every rank."""
    reports = mpi_comm.allgather((signum or 0, problem))
    signal = max(s for s, _ in reports)
    for rank, (_, text) in enumerate(reports):
        if text:
            return Verdict(signal, text, rank)
    return Verdict(signal)
