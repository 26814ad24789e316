"""PowerSGD: rank-r power-iteration compression of each gradient matrix, with warm start and error feedback.

Vogels, Karimireddy, Jaggi. "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019 (Algorithms 1 and 2).

Steps t < warmup_steps: exactly AllReduce-SGD. From then on, on rank i, with the matrices M and the
uncompressed slices u of :mod:`.layout`::

    M_i <- g_i + e_i  (error feedback; e_i = 0 without it)    Q: warm-started (or redrawn), orthogonalized
    allreduce #1:  [P_i = M_i Q for every matrix | u_i]  ->  P = sum_i P_i,   u = (1/n) sum_i u_i
    P̂ = orthogonalize(P);   Q_i = M_i^T P̂;   e_i <- M_i - P̂ Q_i^T
    allreduce #2:  Q = (1/n) sum_i Q_i;    Delta = P̂ Q^T per matrix, u elsewhere
    Delta <- Delta + weight_decay * x;   m <- mu m + Delta;   x <- x - alpha m      (torch.optim.SGD)

A column of P̂ that finds no direction (P = 0 there: a matrix whose gradients, plus errors, sum to 0 on
this step, such as an unused or frozen layer) is set to 0 (nothing is sent or applied along it, e_i keeps
M_i), and the column of Q, then 0, is redrawn from the shared generator after the step, so the next step
compresses the matrix again (:meth:`PowerSGD.redraw_lost`; torch's ``powerSGD_hook`` there gives NaN
with epsilon 0 and, with epsilon > 0, never updates the matrix again). Parameters stay identical on all
ranks. ``overlap=True`` runs both allreduces bucket by bucket during backward, as torch's hook does,
bit-identical to the step above (:mod:`.bucketed`). How it differs from torch's ``powerSGD_hook``, traffic
and the exact reduction: ``docs/algorithms/lowrank.md``.

``hierarchical`` (auto: on over several nodes of several ranks; :mod:`~mpicomm.algorithms.shared.hierarchy`):
the L local ranks of a node split the tensors into L groups of whole tensors (a matrix keeps its shape); rank
(node a, local j) takes its node's exact sum of group j (reduce-scatter inside the node), runs the step above
on it among the N ranks of local rank j (M_a = sum_{i on a} g_i + e_a, the error per node and group; the
allreduces between nodes, divided by n), and the node allgathers the groups. It is PowerSGD with N workers,
each the sum of L gradients: Vogels et al.'s error-feedback argument is unchanged (it needs only a
compressor with bounded relative error on what each worker compresses), with e_a per node. The warm-up's
allreduce goes in two exact levels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...checkpoint.resize_rules import residual_mean
from ..base import Algorithm, check_bool, check_int, check_range, clone_optimizer_state
from ..shared.buckets import LaunchedTraffic
from ..shared.hierarchy import ShardOfFlat, TwoLevelConfig, group_layers, mean_over_ranks, two_level_for
from .bucketed import BucketedPowerSGD
from .layout import LowRankLayout, orthogonalize, zero_lost_columns

__all__ = ["PowerSGD", "PowerSGDConfig"]


@dataclass(frozen=True)
class PowerSGDConfig(TwoLevelConfig):
    """PowerSGD options.

    rank: r of every compressed matrix (default 4: torch's ``powerSGD_hook`` defaults to 1 after 1,000 steps of
    plain allreduce; from the first step, on the ResNet app's digits at 2 ranks and 120 steps, rank 1 reached
    69.6 %, rank 4 97.2 % at a tenth of AllReduce-SGD's bytes). warmup_steps: fp32 AllReduce-SGD steps first.
    min_compression_rate: compress a matrix only if it shrinks by more than this. error_feedback: add
    what compression dropped to the next step's gradient. warm_start: reuse Q across steps. epsilon:
    added to column norms when orthogonalizing. overlap: both allreduces bucket by bucket during backward
    (:mod:`.bucketed`; bucket sizes: see OverlapConfig). hierarchical: see the module docstring.
    """

    rank: int = 4
    warmup_steps: int = 0
    min_compression_rate: float = 2.0
    error_feedback: bool = True
    warm_start: bool = True
    epsilon: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        check_int("rank", self.rank, 1)
        check_int("warmup_steps", self.warmup_steps, 0)
        check_int("seed", self.seed, 0)
        check_range("min_compression_rate", self.min_compression_rate, lo=0.0)
        check_bool("error_feedback", self.error_feedback)
        check_bool("warm_start", self.warm_start)
        check_range("epsilon", self.epsilon, lo=0.0)


class PowerSGD(LaunchedTraffic, Algorithm):
    """AllReduce-SGD warm-up, then rank-r PowerSGD with warm-started Q and error feedback."""

    name = "powersgd"
    config_class = PowerSGDConfig
    centralized = True
    clips_average = True
    takes_optimizer = True
    resize_sharded = True

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        cfg = self.config
        self.two_level = levels = two_level_for(cfg, comm, self.flat.numel, self.flat.grad, layers=self.flat.layers)
        part = self.flat if levels is None else ShardOfFlat(levels.shard, group_layers(self.flat.layers, levels.lo,
                                                                                       levels.hi))
        self.exchange = self.comm if levels is None else levels.cross  # whom the P and Q allreduces span
        self.layout = LowRankLayout(part, cfg.rank, cfg.min_compression_rate)
        like = {"dtype": self.flat.data.dtype, "device": self.flat.data.device}
        lay = self.layout
        self.p_and_plain = torch.zeros(lay.p_numel + lay.plain_numel, **like)  # allreduce #1
        self.q = torch.zeros(lay.q_numel, **like)                             # allreduce #2 (and warm start)
        self.error = torch.zeros(part.data.numel(), **like) if cfg.error_feedback else None
        self.generator = torch.Generator().manual_seed(cfg.seed)
        lay.draw_q(self.q, self.generator)
        self.optimizer = self._local_sgd()
        self.bucketed = BucketedPowerSGD(self, cfg.bucket_numel, cfg.first_bucket_numel) if cfg.overlap else None

    @property
    def phase(self) -> str:
        """``"warmup"`` or ``"compression"``: the phase the next :meth:`step` runs in."""
        return "warmup" if self.step_count < self.config.warmup_steps else "compression"

    def _prepare(self, grad: torch.Tensor) -> None:
        """With overlap each bucket was divided by the micro-batch count at its launch: nothing here."""
        if self.bucketed is None:
            super()._prepare(grad)

    def _step(self, grad: torch.Tensor) -> None:
        levels = self.two_level
        self._first_launch = None
        if self.bucketed is not None:
            self._first_launch = self.bucketed.finish(grad)
        elif self.phase == "warmup":
            mean_over_ranks(grad, self.comm, levels)
        elif levels is None:
            self._compress(grad)
        else:  # the node's sum of my group of tensors, compressed between nodes, then every group back
            shard = levels.reduce(grad)
            self._compress(shard)
            levels.spread(grad, shard)
        self._clip(grad)
        self._decayed(grad)
        self._local_step()

    def _compress(self, grad: torch.Tensor) -> None:
        """Replace ``grad`` (rank i's g_i, or its node's sum of this rank's group) by the aggregated low-rank
        Delta (the mean over all ranks), updating Q and e_i."""
        cfg, lay, n = self.config, self.layout, self.comm.size
        if self.error is not None:
            grad.add_(self.error)                                        # M_i = g_i + e_i
        if not cfg.warm_start and self.step_count > cfg.warmup_steps:
            lay.draw_q(self.q, self.generator)
        p = self.p_and_plain[:lay.p_numel]
        self.project(lay.matrices, grad, p)
        plain = lay.gather_plain(grad, self.p_and_plain[lay.p_numel:])
        self.exchange.allreduce(self.p_and_plain)
        lay.scatter_plain(plain.div_(n), grad)
        self.back_project(lay.matrices, grad, p)
        self.exchange.allreduce(self.q)
        self.q.div_(n)
        for mat in lay.matrices:
            torch.matmul(mat.p(p), mat.q(self.q).t(), out=mat.view(grad))  # Delta = P̂ Q^T
        self.redraw_lost()

    def project(self, matrices, grad: torch.Tensor, p: torch.Tensor) -> None:
        """P_i = M_i orthogonalize(Q) for each of ``matrices`` (views of ``grad``), into the P buffer ``p``."""
        for mat in matrices:
            torch.matmul(mat.view(grad), orthogonalize(mat.q(self.q), self.config.epsilon), out=mat.p(p))

    def back_project(self, matrices, grad: torch.Tensor, p: torch.Tensor) -> None:
        """With P summed in ``p``: P̂ = orthogonalize(P), Q_i = M_i^T P̂ into Q and e_i = M_i - P̂ Q_i^T."""
        for mat in matrices:
            p_hat = zero_lost_columns(orthogonalize(mat.p(p), self.config.epsilon))
            m = mat.view(grad)
            q = torch.matmul(m.t(), p_hat, out=mat.q(self.q))            # Q_i = M_i^T P̂
            if self.error is not None:
                torch.addmm(m, p_hat, q.t(), alpha=-1, out=mat.view(self.error))   # e_i = M_i - P̂ Q_i^T

    def redraw_lost(self) -> None:
        """After Delta: redraw the columns of Q that came out zero (P̂ found no direction there) from the shared
        generator. Q and the generator are the same on every rank that shares Q, so are the draws."""
        lost = self.layout.lost_columns(self.q)
        if lost is not None:
            self.layout.redraw_columns(self.q, lost, self.generator)

    def stats(self):
        """Base stats plus ``phase`` (of the next step) and the layout: compressed matrices and buffer sizes."""
        out = super().stats()
        lay = self.layout
        out.update(phase=self.phase, compressed_matrices=len(lay.matrices), p_numel=lay.p_numel,
                   q_numel=lay.q_numel, plain_numel=lay.plain_numel)
        return out

    def _extra_state(self):
        state = {"optimizer": clone_optimizer_state(self.optimizer), "q": self.q.clone(),
                 "generator": self.generator.get_state()}
        if self.error is not None:
            state["error"] = self.error.clone()
        return state

    def _resize_rules(self):
        """On a resize each rank's error-feedback residual is the saved residuals' mean (:func:`residual_mean`: what
        is still owed is kept). Q (the same on every rank) is carried."""
        rules = super()._resize_rules()
        if self.error is not None:
            rules["extra.error"] = residual_mean
        return rules

    def _load_extra_state(self, extra):
        if tuple(extra["q"].shape) != tuple(self.q.shape):
            raise ValueError(f"state's q has {extra['q'].numel()} entries, this layout needs {self.q.numel()}: "
                             "it was saved with another model, rank or min_compression_rate")
        self.optimizer.load_state_dict(extra["optimizer"])
        self.q.copy_(extra["q"])
        self.generator.set_state(extra["generator"])
        if self.error is not None:
            self.error.copy_(extra["error"])
