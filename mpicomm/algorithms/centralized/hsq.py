"""HSQ-SGD: every rank sends its gradient hyper-sphere quantized; all ranks apply the decoded average.

Dai, Yan, Zhou, Yang, Ng, Cheng, Fan. "Hyper-Sphere Quantization: Communication-Efficient SGD for
Federated Learning." arXiv, November 2019.

Step t, with S_t the participating ranks (all ranks unless ``participation`` < 1) and Q_i rank i's
HSQ encoder (:class:`~mpicomm.codecs.hsq.HSQCodec`, shared codebook, rank-specific random draws)::

    payload_i = Q_i(g_i(x))                          for i in S_t (the others send an all-zero payload)
    g_bar     = (1/|S_t|) sum_{i in S_t, rank order} decode(payload_i)  +  weight_decay * x
    m <- mu m + g_bar;   x <- x - alpha m            (torch.optim.SGD; plain SGD when mu = 0)

Every rank holds the same x (rank 0's after the initial broadcast) and applies the same g_bar, so the
models stay identical. Aggregation:

* ``"allgather"``: one allgather of the payloads; every rank decodes all participants' payloads in
  rank order and averages. Wire: B bytes contributed per rank (B = ``codec.payload_bytes``).
* ``"server"``: the parameter-server pattern with the primitives the Communicator has: the same
  allgather (the Communicator has no gather), rank 0 alone decodes and averages, then broadcasts
  g_bar as float32. Wire: B per rank plus 4*numel from rank 0; strictly more than ``"allgather"``
  and bit-identical in result. A true gather would cut the uplink to B bytes per rank in total.

``participation`` = p picks m = max(1, floor(p*n)) ranks per step uniformly without replacement from
a generator seeded with (seed, t), identical on all ranks and stateless. Non-participants do not
encode (their codec draws do not advance) and contribute an all-zero payload of B bytes to the
equal-size allgather; they are excluded from the average and still apply g_bar.

Seeds: the codebook is built from ``seed`` on every rank; rank r's codec draws use
``codec_seed(seed, r) = seed * 1_000_003 + r``.

``optimizer=`` is refused (``ValueError``): the server momentum on the decoded average is part of
the method; it accepts lr, momentum and weight_decay. ``clip_grad_norm_`` is refused too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..codecs.hsq import HSQCodec, check_hsq_options
from ..comm import raise_together
from .base import Algorithm, AlgorithmConfig, check_range, clone_optimizer_state
from .registry import register

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
class HSQConfig(AlgorithmConfig):
    """HSQ options (see :class:`~mpicomm.codecs.hsq.HSQCodec`).

    d: chunk dimension. K: codebook size (None: 256 for gaussian/kmeans, d for orthonormal/rotation/
    identity). codebook: one of ``CODEBOOKS``. mode: ``"greedy"`` or ``"unbiased"``. n_bit: bits per
    quantized norm (1..8). min_compress: layers with at most this many parameters travel as float32.
    aggregation: ``"allgather"`` or ``"server"``. participation: fraction of ranks contributing per step.
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


@register
class HSQ(Algorithm):
    """Synchronous SGD on the average of hyper-sphere-quantized gradients (allgather or server aggregation)."""

    name = "hsq"
    config_class = HSQConfig
    centralized = True
    optimizer_refusal = ("the server momentum is part of the method (applied to the decoded average); "
                         "set lr, momentum and weight_decay instead")

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        cfg = self.config
        self.codec = HSQCodec(
            self.flat.layers, d=cfg.d, K=cfg.K, codebook=cfg.codebook, mode=cfg.mode, n_bit=cfg.n_bit,
            min_compress=cfg.min_compress, seed=codec_seed(cfg.seed, comm.rank), codebook_seed=cfg.seed,
        )
        digests = comm.comm.allgather(self.codec.codebook_digest())
        error = None
        if len(set(digests)) != 1:
            error = ValueError(f"HSQ codebooks differ across ranks (SHA-256 by rank: {digests}); every rank "
                               "must run the same torch build to build the same seeded codebook")
        raise_together(comm.comm, error)
        self.payload_bytes = self.codec.payload_bytes(self.flat.numel)
        self._zeros = torch.zeros(self.payload_bytes, dtype=torch.uint8, device=self.flat.data.device)
        self._decoded = torch.empty(self.flat.numel, dtype=torch.float32, device=self.flat.data.device)
        self.last_participants: list[int] = []
        self.optimizer = self._local_sgd()

    def _step(self, grad: torch.Tensor) -> None:
        cfg, rank = self.config, self.comm.rank
        chosen = participants(cfg.seed, self.step_count, self.comm.size, cfg.participation)
        self.last_participants = chosen
        payload = self.codec.encode(grad) if rank in chosen else self._zeros
        gathered = self.comm.allgather(payload)
        if cfg.aggregation == "allgather" or rank == 0:
            grad.zero_()
            for r in chosen:
                grad.add_(self.codec.decode(gathered[r], self.flat.numel, out=self._decoded))
            grad.div_(len(chosen))
        if cfg.aggregation == "server":
            self.comm.bcast(grad, root=0)
        self._decayed(grad)
        self._sgd_step(self.optimizer, self.lr)

    def _extra_state(self):
        return {"optimizer": clone_optimizer_state(self.optimizer), "codec": self.codec.state_dict()}

    def _load_extra_state(self, extra):
        self.optimizer.load_state_dict(extra["optimizer"])
        self.codec.load_state_dict(extra["codec"])
