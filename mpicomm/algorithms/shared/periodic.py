"""The step shared by CHOCO-SGD, PD-SGDM and CPD-SGDM: a local torch SGD step and, every p-th step, a gossip round.

Step t on rank i (g_i taken at x_i^t, plus weight_decay * x_i^t; momentum as torch.optim.SGD)::

    m_i <- mu m_i + g_i
    order="atc":  x_i <- x_i - alpha m_i;  then, if (t + 1) mod p == 0, gossip round r = (t + 1) / p - 1
    order="cta":  if (t + 1) mod p == 0, gossip round r;  then x_i <- x_i - alpha m_i

"atc" (adapt then combine) is how the CHOCO-SGD and PD-SGDM papers write the step: the local step's
result is what gets averaged. "cta" (combine then adapt) is D-PSGD's order (Lian et al. 2017): the
current iterate is averaged and the gradient taken there is applied afterwards; with p = 1 and a
lossless gossip it is the registered ``dpsgd`` to the last bit.

With a user optimizer (``optimizer=opt``) its update replaces ``-alpha m_i``: "atc" calls ``opt.step()``
at x_i; "cta" takes ``d_i = opt.step(x_i, g_i) - x_i`` at the pre-gossip iterate and adds it after the
round (as D-PSGD does). The optimizer's groups carry lr, momentum and weight decay.

Topology of a round: gossip round r (the r-th communication, counted from 0) uses the schedule's
topology at index r, i.e. ``comm.topology(r)``, not the one at the step number t. With p = 1 the two
coincide; with p > 1 this makes the rounds walk through a time-varying schedule (one-peer exponential
with p = period would otherwise use a single, possibly disconnected, graph of it forever).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from ..base import Algorithm, AlgorithmConfig, clone_optimizer_state

__all__ = ["ORDERS", "OrderConfig", "PeriodicGossip", "check_period"]

ORDERS = ("atc", "cta")


def check_period(period) -> None:
    """Raise ``ValueError`` unless ``period`` is an int >= 1."""
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(f"period must be an int >= 1 (communicate every period-th step), got {period!r}")


@dataclass(frozen=True)
class OrderConfig(AlgorithmConfig):
    """order: "atc" (local step, then gossip; the papers' form) or "cta" (gossip, then local step; D-PSGD's)."""

    order: str = "atc"

    def __post_init__(self):
        super().__post_init__()
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")


class PeriodicGossip(Algorithm):
    """Local torch SGD steps with a gossip round every ``config.period``-th step (1 without that field)."""

    resize_family = "decentralized"

    takes_optimizer = True

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        self.period = int(getattr(self.config, "period", 1))
        self.optimizer = self._local_sgd()

    def _round_at(self, step: int) -> int | None:
        """The gossip round step ``step`` ends with (``(step + 1) / p - 1``), or None for a local step only."""
        return (step + 1) // self.period - 1 if (step + 1) % self.period == 0 else None

    def _step(self, grad: torch.Tensor) -> None:
        self._decayed(grad)
        round_index, adapt_first = self._round_at(self.step_count), self.config.order == "atc"
        if adapt_first:
            self._local_step()
        update = None if adapt_first else self._user_update()
        if round_index is not None:
            self._gossip(round_index)
        if not adapt_first:
            self._apply_update(update)

    @abc.abstractmethod
    def _gossip(self, round_index: int) -> None:
        """Communication round ``round_index`` on ``self.flat.data`` over ``comm.topology(round_index)``."""

    def _extra_state(self):
        return {"optimizer": clone_optimizer_state(self.optimizer)}

    def _load_extra_state(self, extra):
        self.optimizer.load_state_dict(extra["optimizer"])
