"""Predicted step time of every candidate on a job, the ranking, and the automatic choice.

For a candidate whose communicating step makes the calls ``ops`` and serves ``period`` steps:

* bytes per step: the Ledger's ``contributed`` and ``sent`` of the calls (:mod:`.wire`), over ``period``;
* communication ``comm = sum(cost of each call) / period``, each call priced by the
  :class:`~mpicomm.net.CostModel` the Communicator charges ``--net`` with: on the ``intra`` link when every
  rank is on one node, otherwise on ``inter`` (a flat collective over several nodes is as slow as its
  slowest link);
* codec work ``work = sum(encoded x encode cost + decoded x decode cost) / period`` (:mod:`.codec_cost`);
* exposed communication: ``comm`` without overlap; with overlap (methods that take ``overlap=True``)
  ``comm - min(comm, backward)``, backward taken as 2/3 of the compute time;
* predicted step: ``compute + work + exposed`` (the overlapped figure where the method overlaps).

Throughput is ``ranks x batch / step``; scaling efficiency is one rank's step (the compute alone) over the
predicted step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..net import CostModel, parse_net
from ..topology import ring
from .accuracy import NOISE_POINTS, UNMEASURED, AccuracyCost, accuracy_costs
from .candidates import CANDIDATES, Candidate
from .shapes import numel

__all__ = ["BACKWARD_SHARE", "Job", "Prediction", "auto_choice", "predict", "rank_candidates"]

BACKWARD_SHARE = 2 / 3
"""The share of the compute time that backward takes, which overlap can hide communication behind."""


@dataclass(frozen=True)
class Job:
    """What the planner is told: the model's ``layers``, ``ranks``, ``ranks_per_node``, ``net`` (a ``--net``
    setting), ``step_time`` (compute seconds per step), ``batch_size`` (per rank) and ``codec_costs``
    (:func:`~.codec_cost.codec_costs`; an empty dict counts no codec work)."""

    layers: tuple
    ranks: int
    net: str
    step_time: float
    ranks_per_node: int = 1
    batch_size: int = 32
    codec_costs: dict | None = None

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        for name in ("ranks", "ranks_per_node", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if not self.step_time > 0:
            raise ValueError(f"--step-time must be > 0 seconds, got {self.step_time!r}")
        if parse_net(self.net) is None:
            raise ValueError("--net is required: a setting such as 1gbit,100us, a name (fast, gbit, slow, ib, pcie, "
                             "nvlink) or intra=...,inter=...")

    @property
    def numel(self) -> int:
        """Parameters of the model."""
        return numel(self.layers)

    @property
    def link(self) -> str:
        """The link class flat collectives are priced on: intra on one node, else inter."""
        return "intra" if self.ranks <= self.ranks_per_node else "inter"

    def cost_model(self) -> CostModel:
        """The network model of the link the job's collectives cross."""
        return CostModel(parse_net(self.net)).on(self.link)


@functools.lru_cache(maxsize=64)
def ring_degree(n: int) -> int:
    """Out-degree of the ring on ``n`` ranks (0 for one rank)."""
    return len(ring(n).out_neighbors(0)) if n > 1 else 0


@dataclass(frozen=True)
class Prediction:
    """One candidate's predicted step on a job (seconds; bytes per step and rank; see the module docstring)."""

    candidate: Candidate
    period: int
    contributed_per_sync: int
    sent_per_sync: int
    bits_per_param: float
    comm_s: float
    work_s: float
    exposed_s: float
    exposed_overlap_s: float
    step_s: float
    compute_s: float
    throughput: float
    efficiency: float
    accuracy: AccuracyCost
    speedup: float = 1.0

    @property
    def sent_per_step(self) -> float:
        """Bytes sent per step and rank, averaged over the period."""
        return self.sent_per_sync / self.period


def _work(job: Job, cand: Candidate, degree: int) -> float:
    costs = job.codec_costs or {}
    total = 0.0
    for key, (encoded, decoded) in cand.work(job.layers, job.ranks, degree).items():
        if key in costs:
            total += encoded * costs[key][0] + decoded * costs[key][1]
    return total


def predict(job: Job, cand: Candidate, accuracy: dict | None = None) -> Prediction:
    """The predicted step of ``cand`` on ``job`` (``accuracy``: :func:`~.accuracy.accuracy_costs`, read if None)."""
    n, degree = job.ranks, ring_degree(job.ranks)
    ops, period = cand.traffic(job.layers, n, degree)
    model = job.cost_model()
    comm = sum(op.seconds(model, n) for op in ops) / period
    work = _work(job, cand, degree) / period if n > 1 else 0.0
    hidden = min(comm, BACKWARD_SHARE * job.step_time) if cand.overlap else 0.0
    step = job.step_time + work + comm - hidden
    accuracy = accuracy_costs() if accuracy is None else accuracy
    return Prediction(
        candidate=cand, period=period,
        contributed_per_sync=sum(op.contributed() for op in ops), sent_per_sync=sum(op.sent(n) for op in ops),
        bits_per_param=8 * sum(op.contributed() for op in ops) / period / job.numel,
        comm_s=comm, work_s=work, exposed_s=comm, exposed_overlap_s=comm - hidden, step_s=step,
        compute_s=job.step_time, throughput=n * job.batch_size / step, efficiency=job.step_time / step,
        accuracy=accuracy.get(cand.key, UNMEASURED))


def rank_candidates(job: Job, candidates=CANDIDATES) -> list[Prediction]:
    """Every candidate's prediction, fastest first, with its speed-up over allreduce_sgd's predicted step."""
    accuracy = accuracy_costs()
    preds = [predict(job, c, accuracy) for c in candidates]
    reference = next((p.step_s for p in preds if p.candidate.key == "allreduce_sgd"), None)
    if reference is not None:
        preds = [Prediction(**{**p.__dict__, "speedup": reference / p.step_s}) for p in preds]
    return sorted(preds, key=lambda p: (p.step_s, p.candidate.key))


def auto_choice(preds: list[Prediction], tolerance: float = NOISE_POINTS) -> tuple[Prediction, str]:
    """The fastest prediction whose measured accuracy cost is at most ``tolerance`` points, and why.

    ``ValueError`` (one line) when ``tolerance`` is negative or no measured candidate is within it.
    """
    if not tolerance >= 0:
        raise ValueError(f"--tolerance must be >= 0 accuracy points, got {tolerance}")
    within = [p for p in preds if p.accuracy.measured and p.accuracy.points <= tolerance]
    if not within:
        measured = [p.accuracy.points for p in preds if p.accuracy.measured]
        if not measured:
            raise ValueError("no candidate has a measured accuracy cost (docs/results/*.json not found)")
        raise ValueError(f"no measured candidate costs at most {tolerance} accuracy points (the least is "
                         f"{min(measured):+.2f}); raise --tolerance")
    best = min(within, key=lambda p: (p.step_s, p.candidate.key))
    faster = [p for p in preds if p.step_s < best.step_s]
    reason = (f"fastest predicted step ({1e3 * best.step_s:.1f} ms, {best.speedup:.2f}x allreduce_sgd) among the "
              f"measured candidates within {tolerance} accuracy points (it cost {best.accuracy.points:+.2f})")
    if faster:
        reason += f"; {len(faster)} faster candidate(s) are unmeasured or cost more accuracy"
    return best, reason
