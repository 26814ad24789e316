"""The methods and settings the planner weighs, each with its step's collective calls and codec work.

A :class:`Candidate` names the algorithm and the options to pass to ``mpicomm.wrap``; ``traffic`` gives
the calls of one communicating step (:class:`~.wire.Op`) and how many steps they serve (``period``);
``work`` gives the elements each codec encodes and decodes per communicating step. The Adam-type candidates
(AllReduce-Adam, APMSqueeze, 1-bit LAMB, 0/1 Adam) are weighed for tasks trained with Adam (masked-LM), the
others for SGD-trained ones (:mod:`.choose`). Decentralized methods
run on the ring (the apps' default topology); its out-degree is ``degree``. The warm-up of PowerSGD and
APMSqueeze (full-precision steps first) is not counted: the steady state is what a long run pays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

from ..algorithms.lowrank.layout import LowRankLayout
from ..codecs.chunked_topk import ChunkedTopKCodec
from . import wire
from .shapes import numel
from .wire import Op

__all__ = ["BUCKETS", "CANDIDATES", "STEP", "Candidate", "candidate"]

BUCKETS = "buckets"
"""Overlap kind: gradient buckets communicated during backward (DDP's bucketing, ``GradBuckets``)."""
STEP = "step"
"""Overlap kind: the exchange of the current iterate runs from before forward until after backward."""


@dataclass(frozen=True)
class Candidate:
    """One method and setting: ``key`` (unique), ``algorithm`` and ``options`` (for ``mpicomm.wrap``),
    ``setting`` (shown), ``overlap`` (how ``overlap=True`` hides the exchange: :data:`BUCKETS`, gradient buckets
    sent during backward as it makes them ready; :data:`STEP`, the exchange of x(t) started before the forward
    pass and finished after backward; ``""``: the method cannot overlap),
    ``traffic(layers, n, degree) -> (ops, period)`` and ``work(layers, n, degree) -> {codec: (enc, dec)}``."""

    key: str
    algorithm: str
    setting: str
    options: dict
    overlap: str
    traffic: Callable
    work: Callable = field(default=lambda layers, n, degree: {})
    decentralized: bool = False


def _sizes(layers):
    return [layer.numel for layer in layers]


def _allreduce_fp32(layers, n, degree):
    return [Op("allreduce", 4 * numel(layers))], 1


def _gossip_fp32(period: int = 1, floats: int = 4):
    return lambda layers, n, degree: ([Op("neighbor", floats * numel(layers), degree)], period)


def _gossip_qsgd4(period: int = 1):
    return lambda layers, n, degree: ([Op("neighbor", wire.qsgd_payload(numel(layers), 4, 512), degree)], period)


def _gossip_qsgd4_work(layers, n, degree):
    d = numel(layers)
    return {"qsgd4": (d, degree * d)}


def _moniqua(layers, n, degree):
    message = wire.moniqua_message_bytes(_sizes(layers), 4, 4)
    agreed = wire.moniqua_agreed_floats(len(layers), "observed")
    return [Op("neighbor", message, degree), Op("allreduce", 4 * agreed)], 1


def _moniqua_work(layers, n, degree):
    sent = sum(-(-size // 4) for size in _sizes(layers))  # one part in 4 of every tensor
    return {"moniqua4": (sent, degree * sent)}


def _allgather(payload: Callable[[int], int], codec: str):
    def traffic(layers, n, degree):
        return [Op("allgather", payload(numel(layers)))], 1

    def work(layers, n, degree):
        d = numel(layers)
        return {codec: (d, n * d)}  # every rank's payload is decoded, its own included
    return traffic, work


def _hsq_payload(layers):
    return wire.hsq_payload(_sizes(layers), 16, 256, 6, 1000)


def _hsq(layers, n, degree):
    return [Op("allgather", _hsq_payload(layers))], 1


def _hsq_work(layers, n, degree):
    d = numel(layers)
    return {"hsq": (d, n * d)}


def _powersgd_layout(layers, rank: int) -> LowRankLayout:
    return LowRankLayout(SimpleNamespace(layers=layers), rank, 2.0)


def _powersgd(rank: int):
    def traffic(layers, n, degree):
        lay = _powersgd_layout(layers, rank)
        return [Op("allreduce", 4 * (lay.p_numel + lay.plain_numel)), Op("allreduce", 4 * lay.q_numel)], 1

    def work(layers, n, degree):
        lay = _powersgd_layout(layers, rank)
        product = sum(m.rows * m.cols * m.rank for m in lay.matrices)  # M Q and M^T P, each rows x cols x r
        return {"powersgd": (product, product)}
    return traffic, work


def _apmsqueeze(layers, n, degree):
    _, payload = wire.apmsqueeze_chunk_payload(numel(layers), n)
    return [Op("alltoall", n * payload), Op("allgather", payload)], 1


def _apmsqueeze_work(layers, n, degree):
    chunk, _ = wire.apmsqueeze_chunk_payload(numel(layers), n)
    return {"sign": (n * chunk + chunk, 2 * n * chunk)}  # worker's chunks + server's; n chunks decoded twice


def _diloco(period: int):
    return lambda layers, n, degree: ([Op("allreduce", 4 * numel(layers))], period)


def _sparseloco(layers, n, degree):
    return [Op("allgather", ChunkedTopKCodec(0.02, 4096, 2).payload_bytes(numel(layers)))], 10


def _sparseloco_work(layers, n, degree):
    d = numel(layers)
    return {"chunked_topk": (d, n * d)}


_QSGD = _allgather(lambda d: wire.qsgd_payload(d, 4, 512), "qsgd4")
_TERNGRAD = _allgather(wire.terngrad_payload, "terngrad")
_EFSIGN = _allgather(wire.ef_signsgd_payload, "sign")
_POWER2, _POWER4 = _powersgd(2), _powersgd(4)

CANDIDATES: tuple[Candidate, ...] = (
    Candidate("allreduce_sgd", "allreduce_sgd", "fp32", {}, BUCKETS, _allreduce_fp32),
    Candidate("dpsgd", "dpsgd", "fp32, ring", {}, STEP, _gossip_fp32(), decentralized=True),
    Candidate("moniqua", "moniqua", "4-bit, 4 parts, ring", {}, STEP, _moniqua, _moniqua_work, True),
    Candidate("choco_qsgd4", "choco", "qsgd 4-bit, ring", {"codec": "qsgd", "codec_options": {"bits": 4}}, "",
              _gossip_qsgd4(), _gossip_qsgd4_work, True),
    Candidate("dcd_qsgd4", "dcd", "qsgd 4-bit, ring", {"codec": "qsgd", "codec_options": {"bits": 4}}, "",
              _gossip_qsgd4(), _gossip_qsgd4_work, True),
    Candidate("pdsgdm_p4", "pdsgdm", "period 4, ring", {"period": 4}, "", _gossip_fp32(4), decentralized=True),
    Candidate("cpdsgdm_p4", "cpdsgdm", "qsgd 4-bit, period 4, ring",
              {"period": 4, "codec": "qsgd", "codec_options": {"bits": 4}}, "", _gossip_qsgd4(4),
              _gossip_qsgd4_work, True),
    Candidate("qsgd4", "qsgd", "4-bit, bucket 512", {"bits": 4}, BUCKETS, *_QSGD),
    Candidate("terngrad", "terngrad", "2-bit, one scale", {}, "", *_TERNGRAD),
    Candidate("ef_signsgd", "ef_signsgd", "1-bit + scale", {}, "", *_EFSIGN),
    Candidate("powersgd_r2", "powersgd", "rank 2", {"rank": 2}, BUCKETS, *_POWER2),
    Candidate("powersgd_r4", "powersgd", "rank 4", {"rank": 4}, BUCKETS, *_POWER4),
    Candidate("hsq", "hsq", "d=16, K=256", {}, BUCKETS, _hsq, _hsq_work),
    Candidate("apmsqueeze", "apmsqueeze", "1-bit Adam (after warm-up)", {}, BUCKETS, _apmsqueeze, _apmsqueeze_work),
    Candidate("allreduce_adam", "allreduce_adam", "fp32 Adam", {}, BUCKETS, _allreduce_fp32),
    Candidate("onebit_lamb", "onebit_lamb", "1-bit LAMB (after the freeze)", {}, "", _apmsqueeze, _apmsqueeze_work),
    Candidate("zeroone_adam", "zeroone_adam", "0/1 Adam (after the freeze)", {}, "", _apmsqueeze, _apmsqueeze_work),
    Candidate("diloco_h10", "diloco", "H=10, fp32", {"period": 10}, "", _diloco(10)),
    Candidate("sparseloco_h10", "sparseloco", "H=10, top 2 %, 2-bit", {"period": 10}, "", _sparseloco,
              _sparseloco_work),
)
"""Every candidate, allreduce_sgd (the reference of the speed-ups) first."""


def candidate(key: str) -> Candidate:
    """The candidate called ``key`` (``ValueError`` naming the choices otherwise)."""
    for c in CANDIDATES:
        if c.key == key:
            return c
    raise ValueError(f"unknown candidate {key!r}; choose one of {', '.join(c.key for c in CANDIDATES)}")
