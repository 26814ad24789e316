"""Predicted step time of every candidate on a job, the ranking, and the automatic choice.

For a candidate whose communicating step makes the calls ``ops`` and serves ``period`` steps:

* bytes per step: the Ledger's ``contributed`` and ``sent`` of the calls (:mod:`.wire`), over ``period``;
* communication ``comm = sum(cost of each call) / period``, each call priced by the
  :class:`~mpicomm.net.CostModel` the Communicator charges ``--net`` with: on the ``intra`` link when every
  rank is on one node, otherwise on ``inter`` (a flat collective over several nodes is as slow as its
  slowest link);
* codec work ``work = sum(encoded x encode cost + decoded x decode cost) / period`` (:mod:`.codec_cost`);
* exposed communication: ``comm`` without overlap; with ``overlap=True``, by the method's overlap kind:

  - gradient buckets (:data:`~.candidates.BUCKETS`: allreduce_sgd, qsgd, powersgd, hsq, apmsqueeze): the
    flat gradient is cut into the buckets the method would launch (``bucket_ranges`` with the
    ``OverlapConfig`` defaults: a first bucket of at least 1 MiB of fp32 from the last layer down, then
    25 MiB ones); backward (2/3 of the compute) makes the gradients ready at a constant rate per element,
    last layer first; each bucket's calls (the step's calls, their bytes scaled to the bucket's share)
    start when it is ready and the previous bucket is done; exposed is what runs past the end of
    backward. The last bucket is ready only when backward ends, so it is always exposed, and a model
    smaller than the first bucket hides nothing;
  - the step (:data:`~.candidates.STEP`: dpsgd, moniqua): the exchange of x(t) starts before the forward
    pass and is waited for after backward: ``comm - min(comm, compute)``;
* predicted step: ``compute + work + exposed``, the smaller of the two exposed figures (the automatic
  choice turns overlap on only where it hides something).

Throughput is ``ranks x batch / step``; scaling efficiency is one rank's step (the compute alone) over the
predicted step.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..algorithms.shared.buckets import OverlapConfig, bucket_ranges
from ..net import CostModel, parse_net
from ..topology import ring
from .accuracy import NOISE_POINTS, UNMEASURED, AccuracyCost, accuracy_costs
from .candidates import BUCKETS, CANDIDATES, STEP, Candidate
from .shapes import numel
from .wire import Op

__all__ = ["BACKWARD_SHARE", "MAX_STEP_TIME_S", "WORTH_SWITCHING", "Job", "Prediction", "auto_choice",
           "check_step_time", "check_tolerance", "predict", "rank_candidates"]

BACKWARD_SHARE = 2 / 3
"""The share of the compute time that backward takes, which overlap can hide communication behind."""

_BUCKETS = OverlapConfig()
"""The bucket sizes the methods cut gradients into by default (DDP's)."""

WORTH_SWITCHING = 0.02
"""The least predicted saving (a share of allreduce_sgd's step) for which the automatic choice leaves
allreduce_sgd, the method that changes nothing about the training: a smaller one is within the model's error."""


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
        check_step_time(self.step_time)
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
    exposed_overlap_s: float
    step_s: float
    compute_s: float
    throughput: float
    efficiency: float
    accuracy: AccuracyCost
    speedup: float = 1.0

    @property
    def overlap_helps(self) -> bool:
        """Whether ``overlap=True`` hides something: the method can overlap and its overlapped figure is the
        smaller (what the automatic choice passes to ``mpicomm.wrap``)."""
        return bool(self.candidate.overlap) and self.exposed_overlap_s < self.comm_s

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


def _bucketed_exposed(job: Job, ops: list[Op], period: int, model: CostModel) -> float:
    """Seconds of the bucketed exchange that run past the end of backward (see the module docstring)."""
    n, d = job.ranks, job.numel
    backward = BACKWARD_SHARE * job.step_time
    done = 0.0  # when the previous bucket's calls end, counted from the start of backward
    ready = 0   # elements whose gradients backward has made so far
    for lo, hi in bucket_ranges(job.layers, _BUCKETS.bucket_numel, _BUCKETS.first_bucket_numel):
        ready += hi - lo
        calls = sum(Op(op.kind, -(-op.nbytes * (hi - lo) // d), op.degree).seconds(model, n) for op in ops)
        done = max(done, backward * ready / d) + calls
    return max(0.0, done - backward) / period


def _exposed_with_overlap(job: Job, cand: Candidate, ops: list[Op], period: int, model: CostModel,
                          comm: float) -> float:
    """Exposed seconds per step with ``overlap=True`` (``comm`` for a method that cannot overlap); the bucketed
    figure may exceed ``comm`` (a latency per bucket), and then overlap is not worth choosing."""
    if cand.overlap == BUCKETS and job.ranks > 1:
        return _bucketed_exposed(job, ops, period, model)
    if cand.overlap == STEP:
        return comm - min(comm, job.step_time)
    return comm


def predict(job: Job, cand: Candidate, accuracy: dict | None = None) -> Prediction:
    """The predicted step of ``cand`` on ``job`` (``accuracy``: :func:`~.accuracy.accuracy_costs`, read if None)."""
    n, degree = job.ranks, ring_degree(job.ranks)
    ops, period = cand.traffic(job.layers, n, degree)
    model = job.cost_model()
    comm = sum(op.seconds(model, n) for op in ops) / period
    work = _work(job, cand, degree) / period if n > 1 else 0.0
    exposed = _exposed_with_overlap(job, cand, ops, period, model, comm)
    step = job.step_time + work + min(comm, exposed)  # overlap is chosen only where it helps
    accuracy = accuracy_costs() if accuracy is None else accuracy
    return Prediction(
        candidate=cand, period=period,
        contributed_per_sync=sum(op.contributed() for op in ops), sent_per_sync=sum(op.sent(n) for op in ops),
        bits_per_param=8 * sum(op.contributed() for op in ops) / period / job.numel,
        comm_s=comm, work_s=work, exposed_overlap_s=exposed, step_s=step,
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


MAX_STEP_TIME_S = 3600.0
"""The longest compute step the planner takes (an hour per forward and backward pass)."""


def check_step_time(step_time: float) -> None:
    """``ValueError`` (one line) unless ``step_time`` is a number of seconds in (0, :data:`MAX_STEP_TIME_S`]."""
    if not 0 < step_time <= MAX_STEP_TIME_S:
        raise ValueError(f"--step-time must be a number of seconds in (0, {MAX_STEP_TIME_S:g}], got {step_time!r}")


def check_tolerance(tolerance: float) -> None:
    """``ValueError`` (one line) unless ``tolerance`` is a finite number of accuracy points >= 0."""
    if not math.isfinite(tolerance):
        raise ValueError(f"--tolerance must be a finite number of accuracy points, got {tolerance}")
    if tolerance < 0:
        raise ValueError(f"--tolerance must be >= 0 accuracy points, got {tolerance}")


def auto_choice(preds: list[Prediction], tolerance: float = NOISE_POINTS) -> tuple[Prediction, str]:
    """The fastest prediction whose measured accuracy cost is at most ``tolerance`` points, and why;
    allreduce_sgd instead when that one saves less than :data:`WORTH_SWITCHING` of its step.

    ``ValueError`` (one line) when ``tolerance`` is negative or no measured candidate is within it.
    """
    check_tolerance(tolerance)
    within = [p for p in preds if p.accuracy.measured and p.accuracy.points <= tolerance]
    if not within:
        measured = [p.accuracy.points for p in preds if p.accuracy.measured]
        if not measured:
            raise ValueError("no candidate has a measured accuracy cost (docs/results/*.json not found)")
        raise ValueError(f"no measured candidate costs at most {tolerance} accuracy points (the least is "
                         f"{min(measured):+.2f}); raise --tolerance")
    best = min(within, key=lambda p: (p.step_s, p.candidate.key))
    reference = next((p for p in within if p.candidate.key == "allreduce_sgd"), None)
    if reference is not None and best is not reference and best.step_s >= (1 - WORTH_SWITCHING) * reference.step_s:
        return reference, (f"allreduce_sgd ({1e3 * reference.step_s:.1f} ms): the fastest candidate within "
                           f"{tolerance} accuracy points ({best.candidate.key}, {1e3 * best.step_s:.1f} ms) is "
                           f"predicted to save less than {100 * WORTH_SWITCHING:g} % of its step")
    faster = [p for p in preds if p.step_s < best.step_s]
    reason = (f"fastest predicted step ({1e3 * best.step_s:.1f} ms, {best.speedup:.2f}x allreduce_sgd) among the "
              f"measured candidates within {tolerance} accuracy points (it cost {best.accuracy.points:+.2f})")
    if faster:
        reason += f"; {len(faster)} faster candidate(s) are unmeasured or cost more accuracy"
    return best, reason
