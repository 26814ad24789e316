"""Predicted step time of every candidate on a job, the ranking, and the automatic choice.

For a candidate whose communicating step makes the calls ``ops`` and serves ``period`` steps:

* bytes per step: the Ledger's ``contributed`` and ``sent`` of the calls (:mod:`.wire`), over ``period``;
* communication ``comm = sum(cost of each call) / period``, each call priced by the job's network model: the
  :class:`~mpicomm.net.CostModel` the Communicator charges ``--net`` with (allreduce: recursive doubling up to
  2 KiB, Rabenseifner above, ``2 ceil(log2 n) alpha + 2 (n-1)/n m / beta``), or the transport's measured
  calibration (:class:`~mpicomm.net.calibration.Calibration`); on the ``intra`` link when every rank is on
  one node, otherwise on ``inter``;
* the node's network card, shared: across nodes (``N`` nodes of ``L`` consecutive ranks), ``inter`` is one card
  per node. A flat allreduce pairs rank ``r`` with ``r XOR 2^k``, nearest first: its first ``log2 L`` steps
  stay in the node, on ``intra``, and its last ``log2 N`` cross the card from all ``L`` ranks at once; under
  Rabenseifner they carry, together, an ``N``-rank allreduce's volume, so the flat allreduce costs an
  ``L``-rank allreduce on ``intra`` plus an ``N``-rank one on ``inter`` (recursive doubling: plus the other
  ranks' whole buffers at each crossing step; :func:`~mpicomm.net.model.allreduce_across_nodes`). A flat
  allgather or alltoall is priced as ``L`` times its bytes on ``inter``; a neighbour exchange on the
  node-ordered ring crosses the card from two boundary ranks, one each way, and is priced as it is;
* a calibration timed at the job's layout (its ranks, and its ranks per node where it recorded them) already
  contains the card's sharing: a flat call is priced at what was measured, with no sharing added. Its in-node
  calls are priced on the calibration's in-node measurement, else on the modelled in-node link
  (:attr:`~mpicomm.net.calibration.Calibration.intra_source` says which). A calibration at another layout is
  the ``inter`` link's (scaled to the job's ranks) and is shared as a modelled one;
* two levels (every candidate takes ``hierarchical``; where the job spans several nodes with ``L > 1``
  ranks on each and every node as full): a reduce-scatter and an allgather of the full-precision vector
  inside the node on ``intra``, and the method's calls between the ``N`` nodes on ``inter``, each of the
  ``L`` local ranks carrying ``1/L`` of the vector through the shared card (so the calls of an ``N``-rank
  job with the whole vector); codec work ``1/L`` of the ``N``-rank job's. On a calibration at the job's layout
  an allreduce between the nodes is what the measured flat allreduce leaves after its in-node steps (the
  crossing steps the measurement contains). Two levels cannot overlap. The prediction takes two levels only
  where they are priced below flat, and says which (``hierarchical``); the automatic choice trains that one;
* the price's source (:attr:`Prediction.price_source`): ``modelled``, ``measured``, ``measured, scaled (...)``
  for a calibration at another rank count or layout, ``extrapolated (calibrated at R ranks, job n)`` for a job
  of more than :data:`EXTRAPOLATION_LIMIT` times the calibration's ranks (:attr:`Job.price_warning` is then a
  one-line warning), with the in-node source appended where in-node calls of a calibrated job were priced;
* codec work ``work = sum(encoded x encode cost + decoded x decode cost) / period`` (:mod:`.codec_cost`);
* exposed communication: ``comm`` without overlap; with ``overlap=True``, by the method's overlap kind,
  ``comm - h (comm - ideal)`` where ``ideal`` is what a transport moving data in the background would leave
  exposed and ``h`` the hidden fraction of the transport: measured by its calibration (the share of a
  non-blocking exchange that completes while the rank computes), 1 for a modelled ``--net`` (its transfers
  complete on the clock whatever the rank does). ``ideal``:

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

import math
from dataclasses import dataclass

from ..algorithms.shared.buckets import OverlapConfig, bucket_ranges
from ..net import CostModel, NetLinks, parse_net
from ..net.model import allreduce_across_nodes, card_shared_extra
from ..topology import ring_degree
from .accuracy import IMAGE, NOISE_POINTS, UNMEASURED, AccuracyCost, accuracy_costs
from .candidates import BUCKETS, CANDIDATES, STEP, Candidate
from .shapes import numel
from .wire import Op

__all__ = ["BACKWARD_SHARE", "EXTRAPOLATION_LIMIT", "MAX_STEP_TIME_S", "WORTH_SWITCHING", "Job", "Prediction",
           "auto_choice", "check_step_time", "check_tolerance", "predict", "rank_candidates"]

BACKWARD_SHARE = 2 / 3
"""The share of the compute time that backward takes, which overlap can hide communication behind."""

_BUCKETS = OverlapConfig()
"""The bucket sizes the methods cut gradients into by default (DDP's)."""

EXTRAPOLATION_LIMIT = 4
"""A calibration used for a job of more than this many times its ranks prices by extrapolation, and says so."""

_TIE = 1e-9
"""Two levels are taken only where they are priced below flat by more than this share (rounding is no saving)."""

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
    calibration: object | None = None  # a measured transport (mpicomm.net.Calibration): prices instead of net

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        for name in ("ranks", "ranks_per_node", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        check_step_time(self.step_time)
        if self.calibration is None and parse_net(self.net) is None:  # a calibration prices; net is its label
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

    @property
    def nodes(self) -> int:
        """Nodes the job spans."""
        return -(-self.ranks // self.ranks_per_node)

    @property
    def two_level(self) -> bool:
        """Whether two levels apply: several nodes, more than one rank on each, every node full (the layout
        on which ``hierarchical`` auto runs them)."""
        return self.ranks > self.ranks_per_node > 1 and self.ranks % self.ranks_per_node == 0

    @property
    def nic_share(self) -> int:
        """Ranks sharing a node's network card in a flat allreduce, allgather or alltoall (1 on one node)."""
        return self.ranks_per_node if self.link == "inter" else 1

    def hidden_fraction(self, kind: str) -> float:
        """Share of an overlapped exchange of overlap ``kind`` (:data:`~.candidates.STEP`: a neighbour exchange;
        :data:`~.candidates.BUCKETS`: allreduces) the transport moves while the rank computes: the calibration's
        measurement (the neighbour exchange's where the allreduce's is missing), else 1 (a modelled network's
        transfers complete on the clock)."""
        cal = self.calibration
        if cal is None:
            return 1.0
        if kind == BUCKETS and cal.bucket_hidden_fraction is not None:
            return cal.bucket_hidden_fraction
        return 1.0 if cal.hidden_fraction is None else cal.hidden_fraction

    def network(self) -> CostModel:
        """The network model of both link classes (the calibration's, when measured: its tables on ``inter``, its
        in-node measurement or modelled in-node link on ``intra``, that of ``net`` where ``net`` is
        ``intra=...,inter=...``)."""
        if self.calibration is None:
            return CostModel(parse_net(self.net))
        try:
            spec = parse_net(self.net)
        except ValueError:  # the calibration's label (its summary), not a setting
            spec = None
        return self.calibration.cost_model(spec.intra if isinstance(spec, NetLinks) else None)

    def cost_model(self) -> CostModel:
        """The network model flat collectives are priced on: the calibration's tables when measured, else the
        model of the link they cross."""
        network = self.network()
        return network if self.calibration is not None else network.on(self.link)

    @property
    def at_calibrated_layout(self) -> bool:
        """Whether the job is priced on a calibration timed at its layout: its ranks, and its ranks per node where
        the calibration recorded them (then its flat calls already contain the card's sharing)."""
        cal = self.calibration
        return cal is not None and cal.ranks == self.ranks and cal.ranks_per_node in (None, self.ranks_per_node)

    @property
    def price_source(self) -> str:
        """Where the network prices come from: ``modelled``; ``measured``; ``measured, scaled (...)`` for a
        calibration at another rank count (up to :data:`EXTRAPOLATION_LIMIT` times) or ranks per node;
        ``extrapolated (calibrated at R ranks, job n)`` beyond."""
        cal = self.calibration
        if cal is None:
            return "modelled"
        if self.ranks > EXTRAPOLATION_LIMIT * cal.ranks:
            return f"extrapolated (calibrated at {cal.ranks:,} ranks, job {self.ranks:,})"
        if self.ranks != cal.ranks:
            return f"measured, scaled (calibrated at {cal.ranks:,} ranks, job {self.ranks:,})"
        if not self.at_calibrated_layout:
            return (f"measured, scaled (calibrated at {cal.ranks_per_node:,} ranks per node, job "
                    f"{self.ranks_per_node:,})")
        return "measured"

    @property
    def price_warning(self) -> str:
        """One line where the calibration is extrapolated to more than :data:`EXTRAPOLATION_LIMIT` times its ranks,
        else ``""``."""
        cal = self.calibration
        if cal is None or self.ranks <= EXTRAPOLATION_LIMIT * cal.ranks:
            return ""
        return (f"warning: the calibration was taken at {cal.ranks:,} ranks and the job has {self.ranks:,} (more "
                f"than {EXTRAPOLATION_LIMIT}x): its prices are extrapolated; calibrate at the job's rank count")


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
    hierarchical: bool | None = None
    price_source: str = "modelled"
    """Where the network prices come from (:attr:`Job.price_source`, with ``; in-node ...`` appended where a
    calibrated job's in-node calls were priced: on its in-node measurement or on the modelled in-node link)."""

    @property
    def options(self) -> dict:
        """The options that train what was priced: the candidate's, ``hierarchical`` where two levels were
        weighed, ``overlap=True`` where it hides something."""
        options = dict(self.candidate.options)
        if self.hierarchical is not None:
            options["hierarchical"] = self.hierarchical
        if self.overlap_helps:
            options["overlap"] = True
        return options

    @property
    def overlap_helps(self) -> bool:
        """Whether ``overlap=True`` hides something: the method can overlap and its overlapped figure is the
        smaller (what the automatic choice passes to ``mpicomm.wrap``)."""
        return bool(self.candidate.overlap) and not self.hierarchical and self.exposed_overlap_s < self.comm_s

    @property
    def sent_per_step(self) -> float:
        """Bytes sent per step and rank, averaged over the period."""
        return self.sent_per_sync / self.period


def _work(job: Job, cand: Candidate, n: int, degree: int) -> float:
    costs = job.codec_costs or {}
    total = 0.0
    for key, (encoded, decoded) in cand.work(job.layers, n, degree).items():
        if key in costs:
            total += encoded * costs[key][0] + decoded * costs[key][1]
    return total


def _shares_card(job: Job, op: Op) -> bool:
    """Whether a flat call of ``op`` is priced with the node's card shared: across nodes, not a neighbour
    exchange, and not already measured so (a calibration at the job's layout)."""
    return job.nic_share > 1 and op.kind != "neighbor" and not job.at_calibrated_layout


def _flat_seconds(job: Job, op: Op, model: CostModel, intra: CostModel | None = None) -> float:
    """One flat call's seconds (see the module docstring): as measured at the job's layout; across nodes an
    allreduce's steps inside the node on ``intra`` and its crossing steps through the shared card on ``model``,
    an allgather's or alltoall's bytes ``L`` times over."""
    if not _shares_card(job, op):
        return op.seconds(model, job.ranks)
    if op.kind == "allreduce":
        inside = intra if intra is not None else job.network().on("intra")
        return allreduce_across_nodes(inside, model, op.nbytes, job.nodes, job.ranks_per_node)
    return Op(op.kind, op.nbytes * job.nic_share, op.degree).seconds(model, job.ranks)


def _bucketed_exposed(job: Job, ops: list[Op], period: int, model: CostModel,
                      intra: CostModel | None = None) -> float:
    """Seconds of the bucketed exchange that run past the end of backward (see the module docstring)."""
    d = job.numel
    backward = BACKWARD_SHARE * job.step_time
    done = 0.0  # when the previous bucket's calls end, counted from the start of backward
    ready = 0   # elements whose gradients backward has made so far
    for lo, hi in bucket_ranges(job.layers, _BUCKETS.bucket_numel, _BUCKETS.first_bucket_numel):
        ready += hi - lo
        calls = sum(_flat_seconds(job, Op(op.kind, -(-op.nbytes * (hi - lo) // d), op.degree), model, intra)
                    for op in ops)
        done = max(done, backward * ready / d) + calls
    return max(0.0, done - backward) / period


def _exposed_with_overlap(job: Job, cand: Candidate, ops: list[Op], period: int, model: CostModel,
                          comm: float, intra: CostModel | None = None) -> float:
    """Exposed seconds per step with ``overlap=True`` (``comm`` for a method that cannot overlap): what a
    transport moving data in the background leaves exposed, less only the transport's hidden fraction of the
    rest. The bucketed figure may exceed ``comm`` (a latency per bucket), and then overlap is not worth choosing."""
    if cand.overlap == BUCKETS and job.ranks > 1:
        ideal = _bucketed_exposed(job, ops, period, model, intra)
    elif cand.overlap == STEP:
        ideal = comm - min(comm, job.step_time)
    else:
        return comm
    return comm - job.hidden_fraction(cand.overlap) * (comm - ideal)


def _between_seconds(job: Job, op: Op, intra: CostModel, inter: CostModel) -> float:
    """One call of the second level, over the ``N`` nodes with the whole vector through each card; on a
    calibration at the job's layout an allreduce is the measured flat one less its in-node steps (at least
    nothing)."""
    nodes, per_node = job.nodes, job.ranks_per_node
    if op.kind != "allreduce" or not job.at_calibrated_layout:
        return op.seconds(inter, nodes)
    measured = inter.allreduce(op.nbytes, job.ranks)
    inside = intra.allreduce(op.nbytes, per_node) + card_shared_extra(inter, op.nbytes, nodes, per_node)
    return max(0.0, measured - inside)


def _two_level_seconds(job: Job, cand: Candidate, intra: CostModel, inter: CostModel) -> tuple[float, float]:
    """Communication and codec work per step of ``cand`` in two levels (see the module docstring)."""
    per_node, nodes = job.ranks_per_node, job.nodes
    ops, period = cand.traffic(job.layers, nodes, ring_degree(nodes))
    vector = 4 * job.numel
    inside = intra.reduce_scatter(vector, per_node) + intra.allgatherv(-(-vector // per_node), per_node)
    between = sum(_between_seconds(job, op, intra, inter) for op in ops)  # L shards of 1/L: the whole vector
    work = _work(job, cand, nodes, ring_degree(nodes)) / per_node
    return (inside + between) / period, work / period


def predict(job: Job, cand: Candidate, accuracy: dict | None = None) -> Prediction:
    """The predicted step of ``cand`` on ``job`` (``accuracy``: :func:`~.accuracy.accuracy_costs`, read if None)."""
    n, degree = job.ranks, ring_degree(job.ranks)
    ops, period = cand.traffic(job.layers, n, degree)
    network = job.network()
    model = network if job.calibration is not None else network.on(job.link)
    intra, inter = network.on("intra"), network.on("inter")
    comm = sum(_flat_seconds(job, op, model, intra) for op in ops) / period
    work = _work(job, cand, n, degree) / period if n > 1 else 0.0
    exposed = _exposed_with_overlap(job, cand, ops, period, model, comm, intra)
    step = job.step_time + work + min(comm, exposed)  # overlap is chosen only where it helps
    hierarchical = None
    in_node = any(op.kind == "allreduce" and _shares_card(job, op) for op in ops)  # priced its in-node steps
    if job.two_level:
        two_comm, two_work = _two_level_seconds(job, cand, intra, inter)
        hierarchical = job.step_time + two_work + two_comm < step * (1 - _TIE)
        if hierarchical:
            comm, work, exposed = two_comm, two_work, two_comm
            step = job.step_time + work + comm
            in_node = True
    source = job.price_source
    if job.calibration is not None and in_node:
        source += f"; in-node {job.calibration.intra_source}"
    accuracy = accuracy_costs() if accuracy is None else accuracy
    return Prediction(
        candidate=cand, period=period,
        contributed_per_sync=sum(op.contributed() for op in ops), sent_per_sync=sum(op.sent(n) for op in ops),
        bits_per_param=8 * sum(op.contributed() for op in ops) / period / job.numel,
        comm_s=comm, work_s=work, exposed_overlap_s=exposed, step_s=step,
        compute_s=job.step_time, throughput=n * job.batch_size / step, efficiency=job.step_time / step,
        accuracy=accuracy.get(cand.key, UNMEASURED), hierarchical=hierarchical, price_source=source)


def rank_candidates(job: Job, candidates=CANDIDATES, task: str = IMAGE) -> list[Prediction]:
    """Every candidate's prediction, fastest first, with its speed-up over allreduce_sgd's predicted step and its
    accuracy cost for ``task`` (:data:`~.accuracy.TASKS`; unmeasured there: ``UNMEASURED`` of that task)."""
    accuracy = accuracy_costs(task)
    unmeasured = AccuracyCost(None, "unmeasured", task=task)
    preds = [predict(job, c, {**{c.key: unmeasured}, **accuracy}) for c in candidates]
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


def auto_choice(preds: list[Prediction], tolerance: float = NOISE_POINTS,
                baseline: str = "allreduce_sgd") -> tuple[Prediction, str]:
    """The fastest prediction whose measured accuracy cost is not significantly above ``tolerance`` points (its
    one-sided 95 % bound is at most the tolerance, :meth:`~.accuracy.AccuracyCost.above`), and why; the
    full-precision ``baseline`` instead when that one saves less than :data:`WORTH_SWITCHING` of its step.

    ``ValueError`` (one line) when ``tolerance`` is negative or no measured candidate is within it.
    """
    check_tolerance(tolerance)
    within = [p for p in preds if p.accuracy.measured and not p.accuracy.above(tolerance)]
    if not within:
        measured = [p.accuracy.low for p in preds if p.accuracy.measured]
        if not measured:
            task = preds[0].accuracy.task if preds else IMAGE
            raise ValueError(f"no candidate has a measured accuracy cost for {task} (the accuracy table "
                             "mpicomm/plan/accuracy_costs.json is missing or has none for it)")
        raise ValueError(f"every measured candidate's accuracy cost is significantly above {tolerance} points (the "
                         f"least 95 % bound is {min(measured):+.2f}); raise --tolerance")
    best = min(within, key=lambda p: (p.step_s, p.candidate.key))
    reference = next((p for p in within if p.candidate.key == baseline), None)
    if reference is not None and best is not reference and best.step_s >= (1 - WORTH_SWITCHING) * reference.step_s:
        return reference, (f"{baseline} ({1e3 * reference.step_s:.1f} ms): the fastest candidate within "
                           f"{tolerance} accuracy points ({best.candidate.key}, {1e3 * best.step_s:.1f} ms) is "
                           f"predicted to save less than {100 * WORTH_SWITCHING:g} % of its step")
    faster = [p for p in preds if p.step_s < best.step_s]
    reason = (f"fastest predicted step ({1e3 * best.step_s:.1f} ms, {best.speedup:.2f}x allreduce_sgd) among the "
              f"measured candidates not significantly above {tolerance} accuracy points (it cost "
              f"{best.accuracy.evidence()})")
    if faster:
        reason += f"; {len(faster)} faster candidate(s) are unmeasured or cost significantly more accuracy"
    return best, reason
