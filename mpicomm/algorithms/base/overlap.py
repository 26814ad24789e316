"""Overlapping an algorithm's exchange with the forward and backward pass: :meth:`begin_step` posts the
exchange of the current iterate before the forward pass, the step completes it.

Part of :class:`~mpicomm.algorithms.base.Algorithm` (a base class of it), kept apart so each file has one job.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["OverlappedExchange"]


class OverlappedExchange:
    """The overlap part of :class:`~mpicomm.algorithms.base.Algorithm` (see :meth:`begin_step`)."""

    def begin_step(self) -> None:
        """Start this step's exchange of the current iterate now, before the forward pass (where supported).

        A decentralized method built with ``overlap=True`` whose message depends only on x(t) (and state
        agreed at earlier steps) encodes and posts it here, non-blocking; :meth:`step` then waits for it and
        finishes the update, so the transfer runs while the gradient is computed. The result is bit for bit
        that of the blocking step. Without ``overlap`` (or for a method that cannot overlap) nothing happens,
        and :meth:`step` without a ``begin_step()`` before it exchanges blocking, exactly as always.

        Call it once per update, before the first micro-batch's forward pass; further calls until the
        update are no-ops (so a forward pre-hook, :meth:`overlap_with`, may call it on every forward).
        Until :meth:`step` has taken the update the parameters must not change (the message is read from
        them in flight), and ``state_dict``/``load_state_dict``/``averaged_model`` refuse to run: save
        between steps. Collective over the neighbours, like :meth:`step`.
        """
        if self._begun:
            return
        self.check_model("begin_step()")
        self._begun = True
        start = self.comm.ledger.totals()
        self._pending = self._begin_exchange()
        self._begun_start = start if self._pending is not None else None

    def _begin_exchange(self) -> Any:
        """Hook: post this step's exchange non-blocking and return what :meth:`_take_pending` gives ``_step``
        (None: nothing was started, the step exchanges blocking). Nothing here."""
        return None

    def _take_pending(self) -> Any:
        """For ``_step``: what :meth:`begin_step` started for this update (None: exchange blocking now)."""
        pending, self._pending = self._pending, None
        return pending

    @property
    def exchange_in_flight(self) -> bool:
        """Whether :meth:`begin_step` started an exchange that :meth:`step` has not completed yet."""
        return self._pending is not None

    def _refuse_in_flight(self, what: str) -> None:
        if self._pending is not None:
            raise RuntimeError(f"{self.name}: {what} while this step's exchange is in flight (begin_step() was "
                               "called and step() has not run yet); do it between steps")

    def overlap_with(self, model: torch.nn.Module | None = None):
        """Install a forward pre-hook on ``model`` (default: the algorithm's) that calls :meth:`begin_step`.

        For loops of your own: the exchange then starts at the first forward pass of each update that runs
        in training mode with gradients enabled (evaluation under ``torch.no_grad()`` or ``model.eval()``
        starts nothing). Returns torch's handle; ``handle.remove()`` uninstalls it.
        """
        model = self.model if model is None else model

        def hook(module, args):
            if module.training and torch.is_grad_enabled():
                self.begin_step()

        handle = model.register_forward_pre_hook(hook)
        self.keep_hook(handle)
        return handle
