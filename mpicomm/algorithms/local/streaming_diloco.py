"""Streaming DiLoCo: DiLoCo synced one fragment at a time, each exchange overlapped with the next inner steps.

Douillard et al. "Streaming DiLoCo with overlapping communication: Towards a Distributed Free Lunch." 2025
(arXiv:2501.18512).

The parameter tensors form P = ``fragments`` contiguous groups of about d/P elements; fragment p is synced every
H = ``period`` steps at offset o_p = round(p H / P). Step t on rank i (tau = ``delay``, a = ``alpha``, x_g the
global copy, the same on every rank; eta = ``outer_lr``, mu = ``outer_momentum``)::

    x_i <- InnerOpt(x_i, g_i)                              (as in DiLoCo: torch.optim.SGD or yours)
    for p with (t + 1) mod H == o_p:                       (start, non-blocking)
        q_i = x_g,p - x_i,p (+ e_i,p);  send C(q_i)  (e_i,p <- q_i - C(q_i) with error_feedback)
    for p started at step t - tau:                         (wait, tau inner steps later)
        Delta_p = (1/n) sum_r C(q_r)                       (fp32, summed in MPICH's allreduce order)
        m_p <- mu m_p + Delta_p;  x~_p = x_g,p - eta (Delta_p + mu m_p)       (outer Nesterov SGD, per fragment)
        x_i,p <- a x_i,p + (1 - a) x~_p;   x_g,p <- x~_p

C is ``codec`` (4-bit ``uniform`` by default, as the paper's 4-bit outer gradients; None: the fp32 Delta_i
allreduced). Traffic: fragment p's sync is one allgather of ``codec.payload_bytes(d_p)`` (or one allreduce of
4 d_p), so the peak per step is about 1/P of DiLoCo's. P = 1, tau = 0, a = 0 with error feedback is ``diloco``
with the same codec bit for bit. Options and reasoning: ``docs/algorithms/diloco.md``.

``hierarchical`` (auto: on over several nodes of several ranks; :mod:`~mpicomm.algorithms.shared.hierarchy`):
a fragment's start takes the node's exact sum of each local rank's shard of q (a blocking reduce-scatter inside
the node, the fast link), and only the exchange between nodes stays in flight; at its due step the summed shard
goes back to the node's ranks (an allgather inside the node). The error, with error_feedback, is per node and
shard; the N nodes are the participants whose summed outer gradients are compressed.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from ...checkpoint.resize_rules import own_rank, residual_mean, saved_rank0
from ..base import check_bool, check_int, check_range
from ..shared.allgather_sum import tree_sum
from ..shared.codec_options import check_codec, make_rank_codec
from ..shared.hierarchy import HierarchicalConfig, two_level_for
from .diloco import OuterLoop, OuterMomentumConfig

__all__ = ["StreamingDiLoCo", "StreamingDiLoCoConfig", "fragment_cuts", "fragment_offsets"]

FOUR_BITS = {"bits": 4}


def fragment_cuts(numels: list[int], parts: int) -> list[int]:
    """Tensor indices 0 = c_0 < c_1 < ... < c_P = k: fragment p holds tensors c_p .. c_(p+1) - 1.

    c_p is the tensor boundary whose element count is nearest p d / P (the earlier one on a tie), kept strictly
    increasing so that no fragment is empty. ValueError unless 1 <= ``parts`` <= ``len(numels)``.
    """
    k = len(numels)
    if not 1 <= parts <= k:
        raise ValueError(f"fragments must be <= the model's {k} parameter tensors (and >= 1), got {parts}")
    cum = [0, *accumulate(numels)]
    cuts = [0]
    for p in range(1, parts):
        lo, hi = cuts[-1] + 1, k - (parts - p)
        cuts.append(min(range(lo, hi + 1), key=lambda i: (abs(cum[i] * parts - p * cum[-1]), i)))
    return [*cuts, k]


def fragment_offsets(period: int, parts: int) -> list[int]:
    """o_p = round(p H / P) mod H (halves rounded up): the staggered step offsets of the fragments' syncs."""
    return [(2 * p * period + parts) // (2 * parts) % period for p in range(parts)]


@dataclass(frozen=True)
class StreamingDiLoCoConfig(HierarchicalConfig, OuterMomentumConfig):
    """Streaming DiLoCo options (DiLoCo's outer Nesterov SGD at outer_lr 0.7, momentum 0.9; 4-bit outer gradients).

    fragments: P, the number of fragments (contiguous groups of parameter tensors of about equal size), >= 1 and
    at most the model's tensor count. delay: tau, inner steps between starting a fragment's exchange and applying
    it, an int with 0 <= tau < period / fragments (0: blocking). alpha: weight of the local fragment when the
    outer result is merged into it, in [0, 1) (0: replaced by it). codec: the outer gradients' codec of
    mpicomm.codecs.CODECS (none: fp32, allreduced). codec_options: its keyword arguments (no seed; default
    bits=4 for the default uniform codec). error_feedback: keep what the codec lost and add it to the next
    outer gradient of the fragment (the paper sends its 4-bit outer gradients without). hierarchical: see the
    module docstring.
    """

    fragments: int = 4
    delay: int = 1
    alpha: float = 0.5
    codec: str | None = "uniform"
    codec_options: dict = field(default_factory=lambda: dict(FOUR_BITS))
    error_feedback: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_int("fragments", self.fragments, 1)
        check_int("delay", self.delay, 0)
        if self.delay * self.fragments >= self.period:
            raise ValueError(f"delay must be < period / fragments = {self.period} / {self.fragments} (an exchange "
                             f"is applied before the next fragment's starts), got {self.delay}")
        check_range("alpha", self.alpha, lo=0.0, hi=1.0, hi_open=True)
        check_bool("error_feedback", self.error_feedback)
        if self.codec is None:
            if self.codec_options not in ({}, FOUR_BITS):
                raise ValueError(f"codec_options {self.codec_options!r} need a codec (codec is None: uncompressed)")
            object.__setattr__(self, "codec_options", {})
            return
        object.__setattr__(self, "codec_options", check_codec(self.codec, self.codec_options, self.seed))


class _Exchange:
    """One fragment's average: in flight (``handle``; ``gathered`` the allgather's rows) or received (None: the
    average is in ``outer_grad``'s slice), applied after step ``due``. ``target``: what the exchange sums in
    place (the fragment's slice, or the node's sum of this rank's shard of it)."""

    def __init__(self, fragment: int, due: int, handle=None, gathered=None, target=None):
        self.fragment, self.due, self.handle, self.gathered, self.target = fragment, due, handle, gathered, target


_DROPPED: list = []
"""Handles of exchanges still in flight when their algorithm was dropped without close(): MPI may still write into
their buffers, so they are kept alive (never waited) rather than freed under it."""


def _keep_in_flight(pending: list[_Exchange]) -> None:
    _DROPPED.extend(e.handle for e in pending if e.handle is not None)


class StreamingDiLoCo(OuterLoop):
    """Streaming DiLoCo: DiLoCo's outer step per fragment, staggered, exchanged while inner steps go on."""

    name = "streaming_diloco"
    config_class = StreamingDiLoCoConfig
    resize_sharded = True

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        cfg = self.config
        cuts = fragment_cuts([layer.numel for layer in self.flat.layers], cfg.fragments)
        self.bounds = [self.flat.layers[c].offset if c < len(self.flat.layers) else self.flat.numel for c in cuts]
        self.offsets = fragment_offsets(self.period, cfg.fragments)
        self._outer_params = [torch.nn.Parameter(self.global_params[a:b], requires_grad=False)
                              for a, b in self._spans()]
        mu = cfg.outer_momentum
        self.outer_optimizer = torch.optim.SGD(self._outer_params, lr=cfg.outer_lr, momentum=mu,
                                               nesterov=bool(mu and cfg.outer_nesterov))
        data = self.flat.data  # per fragment: its TwoLevel (None: flat) and where its error lives in self.error
        self.levels = [two_level_for(cfg, comm, b - a, data) for a, b in self._spans()]
        sizes = [b - a if lv is None else lv.hi - lv.lo for (a, b), lv in zip(self._spans(), self.levels)]
        self._error_at = list(zip([0, *accumulate(sizes)], accumulate(sizes)))
        self.codec, self.error = None, None
        if cfg.codec is not None:
            self.codec = make_rank_codec(cfg, self.comm.rank)
            if cfg.error_feedback:
                self.error = torch.zeros(sum(sizes), dtype=data.dtype, device=data.device)
        self._scratch: list[list[torch.Tensor]] = [[] for _ in range(cfg.fragments)]
        self.pending: list[_Exchange] = []
        self.peak_bytes, self.total_bytes = 0, 0
        weakref.finalize(self, _keep_in_flight, self.pending)

    def _spans(self) -> list[tuple[int, int]]:
        return list(zip(self.bounds, self.bounds[1:]))

    def _step(self, grad):
        self._decayed(grad)
        self._local_step()
        t = self.step_count
        for p, offset in enumerate(self.offsets):
            if (t + 1) % self.period == offset:
                self.pending.append(self._start(p, t + self.config.delay))
        for exchange in [e for e in self.pending if e.due == t]:
            self._apply(exchange)
        spent = self.comm.ledger.totals()["bytes_contributed"] - self._step_start["bytes_contributed"]
        self.peak_bytes, self.total_bytes = max(self.peak_bytes, spent), self.total_bytes + spent

    def _agrees_now(self) -> bool:
        """The ranks agree on what was reached when a fragment's exchange starts: what is reached later had a zero
        pseudo-gradient in it on every rank."""
        return any((self.step_count + 1) % self.period == offset for offset in self.offsets)

    def _start(self, p: int, due: int) -> _Exchange:
        """Fragment p's q_i into ``outer_grad``'s slice and its exchange started (in place there, or allgathered)."""
        a, b = self.bounds[p], self.bounds[p + 1]
        delta = self.outer_grad[a:b]
        torch.sub(self.global_params[a:b], self.flat.data[a:b], out=delta)
        levels = self.levels[p]
        comm, q = (self.comm, delta) if levels is None else (levels.cross, levels.reduce(delta))
        if self.codec is None:
            return _Exchange(p, due, comm.iallreduce(q), target=q)
        if self.error is not None:
            error = self.error[slice(*self._error_at[p])]
            q.add_(error)  # q = Delta + e
            payload = self.codec.encode(q)
            self.codec.decode(payload, q.numel(), out=error)
            torch.sub(q, error, out=error)  # e <- q - C(q)
        else:
            payload = self.codec.encode(q)
        gathered = torch.empty((comm.size, payload.numel()), dtype=payload.dtype, device=payload.device)
        return _Exchange(p, due, comm.iallgather(payload, out=gathered), gathered, q)

    def _receive(self, exchange: _Exchange) -> None:
        """Wait for ``exchange`` and leave the average in ``outer_grad``'s slice (nothing if already received)."""
        if exchange.handle is None:
            return
        exchange.handle.wait()
        p, n = exchange.fragment, self.comm.size
        a, b = self.bounds[p], self.bounds[p + 1]
        delta, q, gathered = self.outer_grad[a:b], exchange.target, exchange.gathered
        if gathered is not None:
            tree_sum(len(gathered), lambda r, buf: self.codec.decode(gathered[r], q.numel(), out=buf), q,
                     self._scratch[p])
        if self.levels[p] is not None:
            self.levels[p].spread(delta, q)
        delta.div_(n)
        exchange.handle = exchange.gathered = exchange.target = None

    def _receive_all(self) -> None:
        """Wait for every exchange in flight; their averages wait in ``outer_grad`` for their due steps."""
        for exchange in self.pending:
            self._receive(exchange)

    def _apply(self, exchange: _Exchange) -> None:
        """The outer step of the fragment on its average, then the merge into the local fragment."""
        self._receive(exchange)
        p = exchange.fragment
        a, b = self.bounds[p], self.bounds[p + 1]
        param = self._outer_params[p]
        param.grad = self.outer_grad[a:b]
        self.outer_optimizer.step()  # only this fragment has a gradient
        param.grad = None
        local, new = self.flat.data[a:b], self.global_params[a:b]
        if self.config.alpha:
            local.mul_(self.config.alpha).add_(new, alpha=1.0 - self.config.alpha)
        else:
            local.copy_(new)
        self.pending.remove(exchange)

    def _average(self, delta, round_index):
        raise NotImplementedError("streaming_diloco exchanges fragments with _start and _apply, not whole rounds")

    def close(self) -> None:
        """Collective: wait for the exchanges still in flight (received, not applied); call it before dropping
        the algorithm (the training loop does)."""
        self._receive_all()

    def metrics(self) -> dict:
        """The largest bytes one step handed to MPI (one fragment's message) and the mean over the steps taken."""
        return {"peak_bytes_per_step": self.peak_bytes,
                "mean_bytes_per_step": self.total_bytes / self.step_count if self.step_count else 0.0}

    def _extra_state(self):
        self._receive_all()  # an exchange in flight is saved as its received average, applied at its due step
        state = super()._extra_state()
        state.update(outer_grad=self.outer_grad.clone(),
                     pending=torch.tensor([[e.fragment, e.due] for e in self.pending], dtype=torch.int64)
                     .reshape(-1, 2),
                     schedule=torch.tensor([self.bounds, [*self.offsets, self.period]], dtype=torch.int64),
                     peak_bytes=self.peak_bytes, total_bytes=self.total_bytes)
        if self.codec is not None:
            state["codec"] = self.codec.state_dict()
        if self.error is not None:
            state["error"] = self.error.clone()
        return state

    def _resize_rules(self):
        """On a resize each rank's error-feedback residual is the saved residuals' mean (:func:`residual_mean`: what
        is still owed is kept) and its codec generator its own. The outer gradient is the saved rank 0's: the
        fragments in flight were received before saving, and their average, the same on every rank, is applied at
        its due step."""
        rules = {**super()._resize_rules(), "extra.outer_grad": saved_rank0}
        if self.codec is not None:
            rules["extra.codec"] = own_rank
        if self.error is not None:
            rules["extra.error"] = residual_mean
        return rules

    def _load_extra_state(self, extra):
        schedule = torch.tensor([self.bounds, [*self.offsets, self.period]], dtype=torch.int64)
        if not torch.equal(extra["schedule"], schedule):
            raise ValueError(f"state is for fragments and offsets {extra['schedule'].tolist()}, this run has "
                             f"{schedule.tolist()}")
        super()._load_extra_state(extra)
        self.outer_grad.copy_(extra["outer_grad"])
        self._receive_all()
        self.pending[:] = [_Exchange(int(p), int(due)) for p, due in extra["pending"].tolist()]
        self.peak_bytes, self.total_bytes = int(extra["peak_bytes"]), int(extra["total_bytes"])
        if self.codec is not None:
            self.codec.load_state_dict(extra["codec"])
        if self.error is not None:
            self.error.copy_(extra["error"])
