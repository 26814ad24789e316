"""Moniqua's mixing on one rank: theta agreed, the message encoded and recovered, the guard, then the mix.

Step k (W the mixing matrix of ``comm.topology(k)``, S_l the part of tensor l sent at step k)::

    q_i = MoniquaCodec.encode(x_i, k, theta)              sent to the out-neighbours in one collective
    x̂_j = recovery of q_j against x_i, for j in N(i) and j = i       (check: nothing touched yet)
    w_l = max over ranks and edges of [fingerprint mismatch on S_l]  (one allreduce(max) with theta's inputs)
    x_i[S_l] += gamma sum_j W_ij (x̂_j - x̂_i)                        only for tensors with w_l = 0 (then mix)

With ``overlap`` the allreduce is posted at step k and settled at step k + 1 (:mod:`.deferred`). The guard's
options and why the average stays exact: ``docs/algorithms/moniqua.md``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...codecs.moniqua import MoniquaCodec
from ..shared.gossip import gossip_average
from .config import IDENTITY_BITS, MoniquaConfig
from .deferred import DeferredAgreement
from .guard import GuardRecord, ThetaBoundError, resync_parts
from .theta import TensorTheta, local_step_sizes, mixing_time, tensor_inf

__all__ = ["ModuloGossip"]


class ModuloGossip:
    """Moniqua's mixing ``x[S] += gamma sum_j W_ij (x̂_j - x̂_i)`` on one rank, with theta per tensor and guard."""

    def __init__(self, comm, config: MoniquaConfig, flat):
        self.comm, self.config, self.gamma = comm, config, config.gamma
        self.identity = config.bits == IDENTITY_BITS
        self.record = GuardRecord([layer.name for layer in flat.layers])
        self.deferred: DeferredAgreement | None = None
        if self.identity:
            return
        device = flat.data.device
        self.codec = MoniquaCodec(flat.layers, config.bits, config.parts, config.rounding, seed=config.seed,
                                  rank_seed=config.seed + comm.rank, device=device)
        self.layout = self.codec.layout
        self.rule = TensorTheta(self.layout.count, config, config.parts * mixing_time(comm.schedule, config.gamma))
        self.send = torch.zeros(self.layout.message_bytes, dtype=torch.uint8, device=device)
        if getattr(config, "overlap", False):
            self.deferred = DeferredAgreement(self.layout.count)

    def step_sizes(self, grad: torch.Tensor, lr: float, optimizer=None) -> torch.Tensor:
        """``||lr (mu buf + grad)_l||_inf`` per tensor: the local step about to be taken (theta's statistic)."""
        if self.identity:
            return torch.zeros(0)
        return local_step_sizes(grad, lr, optimizer, self.layout.sizes)

    def begin(self, x: torch.Tensor, step: int):
        """Encode ``x`` and post its exchange over ``comm.topology(step)`` non-blocking, if theta is known yet.

        theta of step k depends only on what steps before k agreed (the running bounds, the observed
        distances, the guard's scale), so the message is a function of x(k) alone and can leave before the
        gradient is computed. Before the first agreement (adaptive or observed rule, first step) theta needs
        this step's statistic: then nothing is posted (None) and :meth:`mix` exchanges blocking. Returns what
        :meth:`mix` takes as ``pending``.
        """
        if self.identity:
            return self.comm.ineighbor_allgather(x, step=step)
        if not self.rule.ready():
            return None
        theta = self.rule.theta()
        increment = self._encode(x, step, theta)
        return self.comm.ineighbor_allgather(self.send, step=step), theta, increment

    def _encode(self, x: torch.Tensor, step: int, theta: torch.Tensor) -> torch.Tensor:
        """Encode ``x`` into ``self.send``; the increment, per code position, starts at -sum_j W_ij x̂_i."""
        increment = torch.empty(self.layout.codes, dtype=torch.float32, device=x.device)
        weights = self.comm.topology(step).neighbor_weights(self.comm.rank)
        self.codec.encode(x, step, theta, self.send, mixing=increment, factor=-math.fsum(weights))
        return increment

    def mix(self, x: torch.Tensor, step: int, step_inf: torch.Tensor, pending=None) -> bool:
        """One mixing round over ``comm.topology(step)`` on ``x`` (in place); True if some part wrapped.

        ``pending``: what :meth:`begin` returned for this step and ``x`` (its exchange is completed here),
        or None to encode and exchange now.
        """
        topo, rank = self.comm.topology(step), self.comm.rank
        self.record.steps += 1
        if self.identity:
            rows = self.comm.neighbor_allgather(x, step=step) if pending is None else pending.wait()
            gossip_average(x, rows, topo.self_weight(rank), topo.neighbor_weights(rank), self.gamma)
            return False
        statistic = self.rule.statistic(step_inf, tensor_inf(x, self.layout.sizes))
        if pending is None:
            if not self.rule.ready():
                self.rule.observe(self._agree(statistic))
            theta = self.rule.theta()
            increment = self._encode(x, step, theta)  # gains W_ij x̂_j per row in recover
            rows = self.comm.neighbor_allgather(self.send, step=step)
        else:
            handle, theta, increment = pending
            rows = handle.wait()
        self.last_theta = theta
        weights = topo.neighbor_weights(rank)
        local = self.codec.recover(rows, weights, increment, observed=self.rule.observed).cpu()
        count = self.layout.count
        values = torch.cat([local[:count], statistic, local[count:]])
        spans = [(start, stop, position) for (start, stop), position in zip(self.layout.parts_at(step),
                                                                            self.layout.positions)]
        if self.deferred is not None:  # overlap: settle step k - 1's agreement, mix, post this step's
            wrapped_before = self.settle(x)
            mine = local[:count] > 0
            self._apply(x, increment, spans, mine)
            self.deferred.post(self.comm, values, mine, increment, spans, step)
            return wrapped_before
        agreed = self._agree(values)
        wrapped = agreed[:count] > 0
        self._observe(agreed, wrapped)
        self._check_raise(step, wrapped)
        self._apply(x, increment, spans, wrapped)
        self._after_guard(x, step, wrapped)
        return bool(wrapped.any())

    def settle(self, x: torch.Tensor, resync: bool = True) -> bool:
        """Under ``overlap``: apply the agreement of the last mixing step, if one is pending (waiting for it):
        theta's inputs folded in, the parts that wrapped on another rank's edge un-mixed here, the guard's
        record, resync (unless ``resync`` is False: then those parts stay unmixed) and scales. True if some
        part wrapped. Collective over all ranks, like the step (the allreduce was posted by every rank)."""
        taken = None if self.deferred is None else self.deferred.take()
        if taken is None:
            return False
        agreed, undo, step = taken
        wrapped = agreed[:self.layout.count] > 0
        self._observe(agreed, wrapped)
        self._check_raise(step, wrapped)
        for start, stop, values in undo:
            x[start:stop].sub_(values, alpha=self.gamma)
        self._after_guard(x, step, wrapped, resync)
        return bool(wrapped.any())

    def _observe(self, agreed: torch.Tensor, wrapped: torch.Tensor) -> None:
        count = self.layout.count
        self.rule.observe(agreed[count:2 * count])
        if self.rule.observed:
            self.rule.observe_distance(agreed[2 * count:], wrapped)

    def _check_raise(self, step: int, wrapped: torch.Tensor) -> None:
        if self.config.guard == "raise" and bool(wrapped.any()):
            raise ThetaBoundError(self.record.describe(step, wrapped) + "; raise theta or theta_c, or use guard='skip'")

    def _apply(self, x: torch.Tensor, increment: torch.Tensor, spans, skipped: torch.Tensor) -> None:
        """``x[S_l] += gamma inc_l`` for every tensor l not ``skipped`` (bool per tensor)."""
        for flag, (start, stop, position) in zip(skipped.tolist(), spans):
            if not flag:
                x[start:stop].add_(increment[position:position + stop - start], alpha=self.gamma)

    def _after_guard(self, x: torch.Tensor, step: int, wrapped: torch.Tensor, resync: bool = True) -> None:
        """Record the wrapped parts of ``step``, resync them (guard "resync"), and update the guard's scales."""
        flags = wrapped.tolist()
        if any(flags):
            self.record.add(wrapped)
            if self.config.guard == "resync" and resync:
                resync_parts(self.comm, x, step, [self.layout.part(t, step) for t, w in enumerate(flags) if w])
                self.record.resyncs += 1
        self.rule.guard(wrapped)

    def _agree(self, values: torch.Tensor) -> torch.Tensor:
        return self.comm.allreduce(values.to(torch.float32).clone(), "max").double()

    def close(self) -> None:
        """Rank 0 logs one summary of the guard's wrapped parts (see :class:`GuardRecord`)."""
        self.record.summarise(self.comm.rank, self.config.guard)

    # ------------------------------------------------------------------ stats and state
    def metrics(self) -> dict[str, Any]:
        """For ``metrics.jsonl``: the largest theta and the wrapped parts per tensor group, and their total."""
        if self.identity or not hasattr(self, "last_theta"):
            return {}
        return self.record.metrics(self.last_theta)

    def stats(self) -> dict[str, Any]:
        """gamma, theta's range and the guard's counters."""
        out = {"gamma": self.gamma, "wrapped_parts": self.record.total(), "resyncs": self.record.resyncs}
        if not self.identity and hasattr(self, "last_theta"):
            out.update(theta_min=float(self.last_theta.min()), theta_max=float(self.last_theta.max()),
                       theta_scale_max=float(self.rule.scale.max()))
            if self.rule.distance is not None:
                out["theta_distance_max"] = float(self.rule.distance.max())
        return out

    def state_dict(self) -> dict[str, Any]:
        """Counters, the theta rule and the stochastic-rounding generator (the dither is keyed by the step)."""
        out: dict[str, Any] = {"record": self.record.state_dict()}
        if not self.identity:
            out["rule"] = self.rule.state_dict()
            if self.codec.noise is not None:
                out["noise"] = self.codec.noise.state_dict()
        if self.deferred is not None:
            out["deferred"] = self.deferred.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.record.load_state_dict(state["record"])
        if not self.identity:
            self.rule.load_state_dict(state["rule"])
            if self.codec.noise is not None:
                self.codec.noise.load_state_dict(state["noise"])
        if self.deferred is not None and "deferred" in state:  # absent: saved without overlap, nothing pending
            self.deferred.load_state_dict(state["deferred"])
