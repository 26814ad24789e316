"""A user's ``torch.optim.Optimizer`` as an algorithm's local step: the checks that accept it on every rank,
the hook that refuses ``optimizer.step()`` outside the algorithm's step, and the step size read from it.

Part of :class:`~mpicomm.algorithms.base.Algorithm` (a base class of it), kept apart so each file has one job.
"""

from __future__ import annotations

import torch

from ...comm import raise_together
from ...errors import ScriptError
from ..shared.user_loop import UsedParameters, optimizer_params

__all__ = ["UserOptimizer"]


class UserOptimizer:
    """The user-optimizer part of :class:`~mpicomm.algorithms.base.Algorithm` (see :meth:`use_optimizer`)."""

    def use_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Collective: take ``optimizer`` (built over this model's parameters) as the local step.

        ``make_algorithm(..., optimizer=...)`` calls this. The parameters stay views of the flat buffer
        (their ``.data`` and ``.grad`` are slices of ``flat.data`` and ``flat.grad``), so the optimizer
        keeps its own parameter groups and updates the flat buffer in place through those views: no
        copy of its param_groups is made and its state is keyed by the model's own Parameters.

        What "the local step" then is depends on the family. Centralized algorithms average (or
        decode) the gradient into ``flat.grad`` and call ``optimizer.step()``. Decentralized ones use
        the optimizer's update at the current iterate, ``d_i = step(x_i, g_i) - x_i`` (computed on a
        scratch copy of x, so one model-sized temporary), in place of ``-lr g_i``: ``x_i <- mix(x)_i + d_i``.
        The built-in step (``lr``/``momentum``/``weight_decay``, weight decay folded into g at x_i) is the
        same equation with torch SGD. The optimizer's own weight decay (per group) replaces
        ``weight_decay``; the lr is read from ``param_groups`` at every step (group 0's is reported), so a
        ``torch.optim.lr_scheduler`` works, and :meth:`set_lr` writes one lr into every group.
        ``state_dict()`` carries the optimizer's state; a scheduler's state is the caller's to save. With
        ``shard=True`` its groups are cut to this rank's shard (:mod:`~mpicomm.algorithms.shared.sharding`).

        A parameter without a gradient in an update is not stepped, as in torch (``.grad`` None): centralized
        methods agree on it over the ranks as DDP does, the others decide on each rank
        (:class:`~mpicomm.algorithms.shared.user_loop.UsedParameters`). A parameter group added afterwards is
        refused at the next step.

        Raises ``ValueError`` on every rank if this algorithm's optimizer is part of the method, if the
        optimizer's parameters are not exactly the model's trainable ones, if ``lr``/``momentum``/
        ``weight_decay`` were also set, or if the ranks' optimizers differ (type or group options).
        """
        error = None
        try:
            self.check_takes_optimizer()
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
            set_fields = [f for f in self.builtin_optimizer_fields
                          if getattr(self.config, f) != getattr(self.config_class(), f)]
            if set_fields:
                raise ValueError(f"{self.name}: {', '.join(set_fields)} configure the built-in optimizer; with "
                                 "optimizer= set them in your optimizer's param groups instead")
            self._check_optimizer_params(optimizer)
            self._check_user_optimizer(optimizer)
            refusal = self.sharding.optimizer_refusal(optimizer) if self.sharding is not None else ""
            if refusal:
                raise ValueError(f"{self.name}: {refusal}")
        except ValueError as exc:
            error = exc
        raise_together(self.comm, error)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        mine = repr((type(optimizer).__name__, groups))
        first = self.comm.bcast_object(mine, 0, "the check that every rank built the same optimizer")
        raise_together(self.comm, None if mine == first else ValueError(
            f"optimizer mismatch: this rank has {mine}, rank 0 has {first}; every rank must build the same one"))
        self.optimizer = optimizer
        self.user_optimizer = True
        self._optimizer_params = optimizer_params(optimizer)
        self.used = UsedParameters(self)
        self.keep_hook(optimizer.register_step_pre_hook(self._refuse_outside_step))
        if self.sharding is not None:
            self.sharding.adopt(optimizer)

    def _refuse_outside_step(self, optimizer, args, kwargs) -> None:
        """The optimizer's step pre-hook: stepping it outside :meth:`step` would apply an update twice; inside,
        ``.grad = None`` for the parameters without a gradient (agreed over the ranks if centralized)."""
        if not self._stepping:
            raise ScriptError(f"optimizer.step() was called outside {self.name}'s step(): the algorithm steps "
                              "your optimizer itself, inside algo.step() (after communicating); remove the "
                              "optimizer.step() call, or the model would be updated twice")
        self.used.release(self.comm if self.centralized else None)

    def _check_user_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Hook: raise ``ValueError`` if this configuration cannot use ``optimizer`` (nothing here)."""

    def _check_optimizer_params(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise ``ValueError`` unless ``optimizer`` holds each trainable parameter of the model exactly once.

        It may also hold the model's frozen parameters (an optimizer built over ``model.parameters()``): they
        never get a gradient, so torch's optimizers skip them.
        """
        names = {id(p): layer.name for p, layer in zip(self.flat.params, self.flat.layers)}
        frozen = {id(p) for p in self.flat.frozen.values()}
        held = [id(p) for g in optimizer.param_groups for p in g["params"]]
        foreign = sum(1 for i in held if i not in names and i not in frozen)
        twice = len(held) - len(set(held))
        missing = [names[i] for i in names if i not in set(held)]
        if foreign or twice or missing:
            raise ValueError(
                f"optimizer must hold every trainable parameter of the model exactly once (build it over "
                f"model.parameters() or groups of them): {foreign} parameter(s) not of the model, {twice} held "
                f"twice, missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    def optimizer_description(self) -> str:
        """``"built-in"``, or the user optimizer's type, group count and weight decays (for the run's start record)."""
        if not self.user_optimizer:
            return "built-in"
        groups = self.optimizer.param_groups
        decays = ", ".join(f"{g.get('weight_decay', 0):g}" for g in groups)
        return f"{type(self.optimizer).__name__} over {len(groups)} parameter groups (weight_decay {decays})"

    @property
    def lr(self) -> float:
        """The step size: group 0's lr of a user optimizer (read at every step), else the built-in one."""
        if self.user_optimizer:
            return float(self.optimizer.param_groups[0]["lr"])
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._lr = float(value)
