"""Moniqua's guard: what a wrapped recovery costs, the record of wrapped parts, and the resync.

A wrap is seen by the codec's fingerprints (:mod:`mpicomm.codecs.moniqua`) before the model is touched;
the tensor's part is then left unmixed ("skip"), mixed at full precision (:func:`resync_parts`) or the
step raises :class:`ThetaBoundError`. The record counts the wrapped parts per tensor and per tensor group
(the first two levels of the parameter's module path, e.g. ``layers.0``, ``fc``) for ``metrics.jsonl`` and
for one summary that rank 0 logs at the end: the synchronous algorithms agree the wrap flags, so rank 0
speaks for all; Moniqua-AD-PSGD's ranks each count their own pulls, and :meth:`GuardRecord.summed` adds
them up first.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..shared.gossip import gossip_average

__all__ = ["GuardRecord", "ThetaBoundError", "resync_parts"]

log = logging.getLogger("mpicomm.algorithms.moniqua")



class ThetaBoundError(RuntimeError):
    """Moniqua's modulo recovery wrapped (|x_i - x_j|_inf exceeded the range) and ``guard="raise"``."""


def resync_parts(comm, x: torch.Tensor, step: int, parts: list[tuple[int, int]]) -> None:
    """Mix the flat slices ``parts`` of ``x`` at full precision: one fp32 neighbour exchange of just those slices."""
    topo, rank = comm.topology(step), comm.rank
    mine = torch.cat([x[a:b] for a, b in parts])
    rows = comm.neighbor_allgather(mine, step=step)
    gossip_average(mine, rows, topo.self_weight(rank), topo.neighbor_weights(rank))
    at = 0
    for a, b in parts:
        x[a:b].copy_(mine[at:at + b - a])
        at += b - a


class GuardRecord:
    """Wrapped parts per tensor (and group), resyncs and mixing steps (identical on every rank when synchronous)."""

    def __init__(self, names: list[str]):
        self.names = names
        self.group_of = [".".join(name.split(".")[:-1][:2]) or name for name in names]
        self.groups = sorted(set(self.group_of))
        self.wrapped = torch.zeros(len(names), dtype=torch.int64)
        self.resyncs, self.steps = 0, 0

    def add(self, wrapped: torch.Tensor) -> None:
        """Count one step's agreed wrap flags (bool per tensor)."""
        self.wrapped += wrapped.long()

    def total(self) -> int:
        """Wrapped parts so far."""
        return int(self.wrapped.sum())

    def describe(self, step: int, wrapped: torch.Tensor) -> str:
        """One line naming the step and (up to four of) the tensors that wrapped."""
        names = [name for name, w in zip(self.names, wrapped.tolist()) if w]
        return (f"Moniqua step {step}: the modulo recovery wrapped on {len(names)} tensor part(s) "
                f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}): |x_i - x_j|_inf exceeded theta")

    def group_counts(self) -> dict[str, int]:
        """Wrapped parts so far per tensor group."""
        out = dict.fromkeys(self.groups, 0)
        for group, n in zip(self.group_of, self.wrapped.tolist()):
            out[group] += n
        return out

    def metrics(self, theta: torch.Tensor) -> dict[str, Any]:
        """For ``metrics.jsonl``: the largest theta and the wrapped parts per group, their total and the resyncs."""
        largest = dict.fromkeys(self.groups, 0.0)
        for group, t in zip(self.group_of, theta.tolist()):
            largest[group] = max(largest[group], t)
        return {"moniqua_theta_max": largest, "moniqua_wrapped": self.group_counts(),
                "moniqua_wrapped_parts": self.total(), "moniqua_resyncs": self.resyncs}

    def summed(self, comm) -> GuardRecord:
        """Collective: a record of every rank's counts added up (for asynchronous algorithms, whose records differ)."""
        total = GuardRecord(self.names)
        counts = torch.cat([self.wrapped, torch.tensor([self.resyncs, self.steps])]).double()
        counts = comm.allreduce(counts).long()
        total.wrapped, total.resyncs, total.steps = counts[:-2], int(counts[-2]), int(counts[-1])
        return total

    def summarise(self, rank: int, guard: str) -> None:
        """Rank 0 logs one warning summing up the wrapped parts, if there were any."""
        if self.total() and rank == 0:
            action = {"skip": "left unmixed that step", "resync": "mixed at full precision"}[guard]
            log.warning("Moniqua guard: %d tensor parts wrapped over %d mixing steps and were %s (by group: %s); "
                        "each wrap doubled that tensor's theta", self.total(), self.steps, action,
                        ", ".join(f"{g} {n}" for g, n in self.group_counts().items() if n))

    def state_dict(self) -> dict[str, Any]:
        """Counters."""
        return {"wrapped": self.wrapped.clone(), "resyncs": self.resyncs, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        if state["wrapped"].numel() != len(self.names):
            raise ValueError(f"Moniqua state counts wraps of {state['wrapped'].numel()} tensors, "
                             f"the model has {len(self.names)}")
        self.wrapped, self.resyncs, self.steps = state["wrapped"].clone(), int(state["resyncs"]), int(state["steps"])
