"""HSQ-SGD: every rank sends its gradient hyper-sphere quantized; all ranks apply the decoded average.

Dai, Yan, Zhou, Yang, Ng, Cheng, Fan. "Hyper-Sphere Quantization: Communication-Efficient SGD for
Federated Learning." arXiv, November 2019.

Step t, with S_t the participating ranks (all unless ``participation`` < 1) and Q_i rank i's HSQ encoder
(:class:`~mpicomm.codecs.hsq.HSQCodec`, shared codebook, rank-specific random draws)::

    payload_i = Q_i(g_i(x))                          for i in S_t (the others send an all-zero payload)
    g_bar     = (1/|S_t|) sum_{i in S_t, rank order} decode(payload_i)  +  weight_decay * x
    m <- mu m + g_bar;   x <- x - alpha m            (torch.optim.SGD; plain SGD when mu = 0)

Aggregation "allgather" (every rank decodes) or "server" (rank 0 decodes and broadcasts g_bar). Every
rank applies the same g_bar, so the models stay identical. ``optimizer=`` and ``clip_grad_norm_`` are
refused. Participation, seeds and wire bytes: ``docs/algorithms/hsq.md``. ``overlap=True`` encodes and
allgathers the gradient bucket by bucket during backward (:mod:`.bucketed_hsq`), bit for bit the blocking
step; not with ``hierarchical``.

``hierarchical`` (auto: on over several nodes of several ranks; :mod:`~mpicomm.algorithms.shared.hierarchy`):
with L ranks on each of N nodes, rank (node a, local j) quantizes s_a, the node's exact sum of shard j of the
gradient (reduce-scatter inside the node), with an HSQ codec over the shard's parts of the layers (chunks
start again at the shard's edges), exchanges it among the N ranks of local rank j, and the node allgathers
the shards of::

    g_bar[shard j] = (1/(|S_t| L)) sum_{a in S_t} decode(Q_a(s_a))   +  weight_decay * x

S_t are then nodes (``participation`` draws nodes; "server" decodes on node 0's rank of each shard). The
encoder sees N vectors, each the sum of L gradients: HSQ's unbiased mode stays unbiased
(E[Q(s_a)] = s_a, Dai et al. 2019, Lemma 1, applied per chunk) and its variance bound counts N quantized
vectors instead of n.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...checkpoint.resize_rules import own_rank
from ...codecs.hsq import HSQCodec, check_hsq_options
from ...comm import raise_together
from ..base import Algorithm, check_range, clone_optimizer_state
from ..shared.buckets import LaunchedTraffic, OverlapConfig
from ..shared.hierarchy import HierarchicalConfig, shard_layers, two_level_for
from .bucketed_hsq import BucketedHSQ

__all__ = ["AGGREGATIONS", "HSQ", "HSQConfig", "codec_seed", "participants"]

AGGREGATIONS = ("allgather", "server")


def codec_seed(seed: int, rank: int) -> int:
    """Seed of rank ``rank``'s codec draws (norm rounding, index sampling)."""
    return seed * 1_000_003 + rank


def participants(seed: int, step: int, size: int, participation: float) -> list[int]:
    """The ranks (sorted) that contribute at ``step``: all of them, or a seeded max(1, floor(p*n)) subset."""
    m = max(1, math.floor(participation * size + 1e-9))
    if m >= size:
        return list(range(size))
    gen = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + step) % (1 << 63))
    return sorted(torch.randperm(size, generator=gen)[:m].tolist())


@dataclass(frozen=True)
class HSQConfig(HierarchicalConfig, OverlapConfig):
    """HSQ options (see :class:`~mpicomm.codecs.hsq.HSQCodec`).

    d: chunk dimension. K: codebook size (None: 256 for gaussian/kmeans, d for orthonormal/rotation/
    identity). codebook: one of ``CODEBOOKS``. mode: ``"greedy"`` or ``"unbiased"``. n_bit: bits per
    quantized norm (1..8). min_compress: layers with at most this many parameters travel as float32.
    aggregation: ``"allgather"`` or ``"server"``. participation: fraction of ranks (nodes, in two levels)
    contributing per step. hierarchical: see :class:`~mpicomm.algorithms.shared.hierarchy.HierarchicalConfig`.
    overlap: encode and allgather gradient buckets during backward (bucket sizes: see OverlapConfig).
    """

    d: int = 16
    K: int | None = None
    codebook: str = "gaussian"
    mode: str = "greedy"
    n_bit: int = 6
    min_compress: int = 1000
    aggregation: str = "allgather"
    participation: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        check_hsq_options(self.d, self.K, self.codebook, self.mode, self.n_bit, self.min_compress)
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        check_range("participation", self.participation, lo=0.0, hi=1.0, lo_open=True)


class HSQ(LaunchedTraffic, Algorithm):
    """Synchronous SGD on the average of hyper-sphere-quantized gradients (allgather or server aggregation)."""

    name = "hsq"
    config_class = HSQConfig
    centralized = True
    optimizer_refusal = ("the server momentum is part of the method (applied to the decoded average); "
                         "set lr, momentum and weight_decay instead")

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        cfg = self.config
        self.two_level = two_level_for(cfg, comm, self.flat.numel, self.flat.grad)
        levels = self.two_level
        layers = self.flat.layers if levels is None else shard_layers(self.flat.layers, levels.lo, levels.hi)
        numel = self.flat.numel if levels is None else levels.hi - levels.lo
        self.codec = HSQCodec(
            layers, d=cfg.d, K=cfg.K, codebook=cfg.codebook, mode=cfg.mode, n_bit=cfg.n_bit,
            min_compress=cfg.min_compress, seed=codec_seed(cfg.seed, comm.rank), codebook_seed=cfg.seed,
        )
        digests = comm.allgather_object(self.codec.codebook_digest(), "the check that every rank built one codebook")
        error = None
        if len(set(digests)) != 1:
            error = ValueError(f"HSQ codebooks differ across ranks (SHA-256 by rank: {digests}); every rank "
                               "must run the same torch build to build the same seeded codebook")
        raise_together(comm, error)
        self.payload_bytes = self.codec.payload_bytes(numel)
        self.zero_payload = torch.zeros(self.payload_bytes, dtype=torch.uint8, device=self.flat.data.device)
        self.decoded = torch.empty(numel, dtype=torch.float32, device=self.flat.data.device)  # decode scratch
        self.last_participants: list[int] = []
        self.optimizer = self._local_sgd()
        self.bucketed = BucketedHSQ(self, cfg.bucket_numel, cfg.first_bucket_numel) if cfg.overlap else None

    def _prepare(self, grad: torch.Tensor) -> None:
        """With overlap each bucket was divided by the micro-batch count at its launch: nothing here."""
        if self.bucketed is None:
            super()._prepare(grad)

    def choose_participants(self, size: int | None = None) -> list[int]:
        """This step's contributing ranks (of ``size``, default the communicator's), kept as ``last_participants``."""
        cfg = self.config
        self.last_participants = participants(cfg.seed, self.step_count, size or self.comm.size, cfg.participation)
        return self.last_participants

    def _step(self, grad: torch.Tensor) -> None:
        levels = self.two_level
        self._first_launch = None
        if self.bucketed is not None:
            self._first_launch = self.bucketed.finish(grad)
        elif levels is None:
            self._average(self.comm, grad, 1)
        else:
            shard = levels.reduce(grad)
            self._average(levels.cross, shard, levels.layout.local_size)
            levels.spread(grad, shard)
        self._decayed(grad)
        self._sgd_step(self.optimizer, self.lr)

    def _average(self, comm, vec: torch.Tensor, summed: int) -> None:
        """Collective over ``comm``: ``vec`` <- (1/(|S| summed)) sum_{r in S} decode(Q_r(vec_r)), S this step's
        participants among ``comm``'s ranks, each ``vec_r`` a sum of ``summed`` gradients."""
        cfg, rank = self.config, comm.rank
        chosen = self.choose_participants(comm.size)
        payload = self.codec.encode(vec) if rank in chosen else self.zero_payload
        gathered = comm.allgather(payload)
        if cfg.aggregation == "allgather" or rank == 0:
            vec.zero_()
            for r in chosen:
                vec.add_(self.codec.decode(gathered[r], vec.numel(), out=self.decoded))
            vec.div_(len(chosen) * summed)
        if cfg.aggregation == "server":
            comm.bcast(vec, root=0)

    def _extra_state(self):
        return {"optimizer": clone_optimizer_state(self.optimizer), "codec": self.codec.state_dict()}

    def _resize_rules(self):
        """On a resize each rank's codec generators stay its own (:func:`own_rank`)."""
        return {**super()._resize_rules(), "extra.codec": own_rank}

    def _load_extra_state(self, extra):
        self.optimizer.load_state_dict(extra["optimizer"])
        self.codec.load_state_dict(extra["codec"])
