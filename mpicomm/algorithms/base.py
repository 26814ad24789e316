"""The Algorithm interface shared by every decentralized and centralized training algorithm.

Usage, identical for all algorithms::

    algo = make_algorithm("moniqua", model, communicator, lr=0.1, bits=1)
    for x, y in loader:
        algo.zero_grad()
        loss_fn(model(x), y).backward()
        algo.step()                      # communicate + update, on the flat parameter buffer

An algorithm owns a :class:`~mpicomm.flat.FlatParameters` (parameters as views of one buffer), talks to
the network only through the :class:`~mpicomm.comm.Communicator` it is given, and keeps everything it
needs to continue bit-exactly in ``state_dict()``.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..comm import Communicator, raise_together
from ..flat import FlatParameters

__all__ = ["Algorithm", "AlgorithmConfig", "check_range", "clone_optimizer_state"]


def check_range(name: str, value, lo=None, hi=None, lo_open=False, hi_open=False) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a finite number in the stated interval."""
    bad = (lo is not None and (value <= lo if lo_open else value < lo)) or \
          (hi is not None and (value >= hi if hi_open else value > hi))
    if bad or not math.isfinite(value):  # NaN fails every comparison; no option means anything at infinity
        left = "(-inf" if lo is None else ("(" if lo_open else "[") + str(lo)
        right = "inf)" if hi is None else str(hi) + (")" if hi_open else "]")
        raise ValueError(f"{name} must be in {left}, {right}, got {value!r}")


def clone_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """A deep copy of ``optimizer.state_dict()`` (torch returns references to live buffers)."""
    state = optimizer.state_dict()
    return {
        "state": {k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in s.items()}
                  for k, s in state["state"].items()},
        "param_groups": [dict(g) for g in state["param_groups"]],
    }


@dataclass(frozen=True)
class AlgorithmConfig:
    """Options every algorithm has. Subclasses add their own fields (all with defaults).

    lr: step size alpha. momentum: heavy-ball momentum of the local torch.optim step, where the
    algorithm takes one. weight_decay: L2 weight decay of that step. seed: for every random choice the
    algorithm makes (codec rounding, peer choice). broadcast_init: start every rank from rank 0's
    parameters (turn off only if they already agree).
    """

    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    seed: int = 0
    broadcast_init: bool = True

    def __post_init__(self):
        check_range("lr", self.lr, lo=0.0, lo_open=True)
        check_range("momentum", self.momentum, lo=0.0, hi=1.0, hi_open=True)
        check_range("weight_decay", self.weight_decay, lo=0.0)


class Algorithm(abc.ABC):
    """Base class: flat parameters, a communicator, a validated config, a step counter, traffic stats.

    Subclasses set ``name`` and ``config_class``, implement :meth:`step`, and extend
    :meth:`_extra_state` / :meth:`_load_extra_state` with whatever else they keep.
    """

    name: ClassVar[str] = "algorithm"
    config_class: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig

    def __init__(self, model: torch.nn.Module, comm: Communicator, config: AlgorithmConfig | None = None):
        config = self.config_class() if config is None else config
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} takes a {self.config_class.__name__}, got {type(config).__name__}")
        self.model = model
        self.comm = comm
        self.config = config
        self.flat = FlatParameters(model)
        self.step_count = 0
        self.lr = config.lr
        self._step_start = comm.ledger.totals()
        self._last_step: dict[str, int] = {k: 0 for k in self._step_start}
        self._check_same_everywhere()
        if config.broadcast_init:
            self.comm.bcast(self.flat.data, root=0)
            self.comm.ledger.reset()

    # ------------------------------------------------------------------ construction checks
    def _check_same_everywhere(self) -> None:
        """Collective: every rank must wrap the same architecture with the same config."""
        mine = (self.flat.signature(), repr(self.config))
        first = self.comm.comm.bcast(mine, root=0)
        error = None
        if mine[0] != first[0]:
            error = ValueError(
                f"model mismatch: this rank has {mine[0][0]} parameters in {len(mine[0][1])} tensors, "
                f"rank 0 has {first[0][0]} in {len(first[0][1])}; every rank must build the same model"
            )
        elif mine[1] != first[1]:
            error = ValueError(f"config mismatch: this rank has {mine[1]}, rank 0 has {first[1]}")
        raise_together(self.comm.comm, error)

    # ------------------------------------------------------------------ the training-loop surface
    def zero_grad(self) -> None:
        """Zero the gradient buffer (call before ``backward()``)."""
        self.flat.zero_grad()

    def step(self) -> None:
        """Consume the gradients of the last backward pass: communicate and update the parameters."""
        self._step_start = self.comm.ledger.totals()
        self._step(self.flat.gather_grads())
        self.step_count += 1
        now = self.comm.ledger.totals()
        self._last_step = {k: now[k] - self._step_start[k] for k in now}

    @abc.abstractmethod
    def _step(self, grad: torch.Tensor) -> None:
        """One step of the algorithm on ``self.flat.data`` given the flat gradient ``grad``."""

    def _local_sgd(self, momentum: float | None = None) -> torch.optim.SGD:
        """A ``torch.optim.SGD`` over the flat buffer (one parameter whose grad is the flat grad).

        Weight decay is not passed to torch: :meth:`_decayed` folds it into the gradient at the
        current iterate, so every algorithm applies it at the same point of its update.
        """
        param = torch.nn.Parameter(self.flat.data, requires_grad=False)
        param.grad = self.flat.grad
        mu = self.config.momentum if momentum is None else momentum
        return torch.optim.SGD([param], lr=self.lr, momentum=mu)

    def _decayed(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad += weight_decay * x`` in place (the L2 term of the local objective); returns ``grad``."""
        if self.config.weight_decay:
            grad.add_(self.flat.data, alpha=self.config.weight_decay)
        return grad

    @staticmethod
    def _sgd_step(optimizer: torch.optim.SGD, lr: float) -> None:
        """One torch SGD step at step size ``lr`` (momentum as configured)."""
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()

    def close(self) -> None:
        """Collective: release communication resources (asynchronous algorithms free their windows)."""

    def metrics(self) -> dict[str, Any]:
        """Algorithm-specific fields for each ``metrics.jsonl`` record (rank 0's; not collective). None here."""
        return {}

    def set_lr(self, lr: float) -> None:
        """Change the step size (learning-rate schedules call this every step)."""
        check_range("lr", lr, lo=0.0)
        self.lr = float(lr)

    # ------------------------------------------------------------------ evaluation and stats
    def consensus_model(self) -> torch.Tensor:
        """Collective: the average of all ranks' flat parameters (what decentralized methods evaluate)."""
        avg = self.flat.data.detach().clone()
        self.comm.allreduce(avg)
        return avg.div_(self.comm.size)

    def consensus_distance(self) -> float:
        """Collective: sqrt(mean_i ||x_i - x_bar||^2), the spread of the ranks' models."""
        avg = self.consensus_model()
        local = torch.tensor([float((self.flat.data - avg).pow(2).sum())], dtype=torch.float64)
        self.comm.allreduce(local)
        return float(local.item() / self.comm.size) ** 0.5

    def stats(self) -> dict[str, Any]:
        """Traffic of the last step and in total (from the Ledger), step counter and learning rate."""
        totals = self.comm.ledger.totals()
        out: dict[str, Any] = {"step": self.step_count, "lr": self.lr}
        out.update({f"step_{k}": v for k, v in self._last_step.items()})
        out.update({f"total_{k}": v for k, v in totals.items()})
        out["bits_per_parameter"] = 8.0 * self._last_step["bytes_contributed"] / self.flat.numel
        return out

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-exactly: parameters, step, lr, and the subclass's state."""
        return {
            "algorithm": self.name,
            "config": dataclasses.asdict(self.config),
            "step": self.step_count,
            "lr": self.lr,
            "params": self.flat.data.detach().clone(),
            "extra": self._extra_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (on a freshly built algorithm of the same kind)."""
        if state.get("algorithm") != self.name:
            raise ValueError(f"state is for algorithm {state.get('algorithm')!r}, this is {self.name!r}")
        params = state["params"]
        if params.numel() != self.flat.numel:
            raise ValueError(f"state holds {params.numel()} parameters, the model has {self.flat.numel}")
        self.flat.data.copy_(params)
        self.step_count = int(state["step"])
        self.lr = float(state["lr"])
        self._load_extra_state(state["extra"])

    def _extra_state(self) -> dict[str, Any]:
        """Subclass state (buffers, optimizer state, generators); override and call super()."""
        return {}

    def _load_extra_state(self, extra: dict[str, Any]) -> None:
        """Restore :meth:`_extra_state`; override and call super()."""
