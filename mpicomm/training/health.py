"""After every step the ranks agree, in one small collective, whether to go on (in lockstep; free-running
ranks agree only after the rounds that reach an event, see :mod:`.pace`).

Two things stop a run: a stop signal on any rank (SIGUSR1/SIGTERM: checkpoint, then exit), and a
non-finite loss or parameter on any rank (the run has diverged: stop *without* checkpointing, so the
last checkpoint on disk is the last good state). Both ride on the same allgather of a few bytes per
step, the only per-step collective the loop adds.

The check reads the sum of the losses since the last log line (it stays on the device between checks:
no host sync per step) and the parameters, a pass over the whole model, every ``log_every`` steps and
before every checkpoint: a checkpoint never holds a diverged state, and a divergence is caught within
``log_every`` steps. The stop-signal part of the agreement runs every step (host data only).
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
    """What is non-finite on this rank (``""`` if nothing): the loss (a sum since the last check), or the parameters."""
    if not math.isfinite(loss):
        return f"loss is {loss}"
    if params is not None and not bool(torch.isfinite(params).all()):
        bad = int((~torch.isfinite(params)).sum())
        return f"{bad} of {params.numel()} parameters are non-finite"
    return ""


def agree(comm, signum: int | None, problem: str) -> Verdict:
    """Collective over the Communicator ``comm``: the highest stop signal of any rank and the first rank's
    problem (a divergence, a metrics file that cannot be written), on every rank."""
    reports = comm.allgather_object((signum or 0, problem), "the step's agreement")
    signal = max(s for s, _ in reports)
    for rank, (_, text) in enumerate(reports):
        if text:
            return Verdict(signal, text, rank)
    return Verdict(signal)
