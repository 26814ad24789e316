"""The Algorithm interface shared by every decentralized and centralized training algorithm.

Usage, identical for all algorithms::

    algo = make_algorithm("moniqua", model, communicator, lr=0.1, bits=1)
    for x, y in loader:
        algo.zero_grad()
        loss_fn(model(x), y).backward()
        algo.step()                      # communicate + update, on the flat parameter buffer

Your own optimizer (the peers' idiom; see :meth:`Algorithm.use_optimizer` for what "the local step"
then means)::

    groups = [{"params": decayed, "weight_decay": 0.01}, {"params": biases_and_norms, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    algo = make_algorithm("dpsgd", model, communicator, optimizer=optimizer)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    algo.accumulate(4)                   # step() communicates and updates once every 4 micro-batches
    algo.clip_grad_norm_(1.0)            # clip every step's gradient (see clip_grad_norm_ for which one)

The exchange of the current iterate overlapped with the forward and backward pass (decentralized methods
built with ``overlap=True``; see :meth:`Algorithm.begin_step`)::

    algo = make_algorithm("dpsgd", model, communicator, lr=0.1, overlap=True)
    for x, y in loader:
        algo.begin_step()                # start sending x(t); or once: algo.overlap_with(model)
        algo.zero_grad()
        loss_fn(model(x), y).backward()
        algo.step()                      # wait for the neighbours' x(t), mix, update

An algorithm owns a :class:`~mpicomm.flat.FlatParameters` (parameters as views of one buffer), talks to
the network only through the :class:`~mpicomm.comm.Communicator` it is given, and keeps everything it
needs to continue bit-exactly in ``state_dict()``.

It keeps the whole model in step, as DDP does: at construction every rank gets rank 0's parameters,
frozen ones included, and rank 0's buffers (``broadcast_init``); the frozen parameters are checkpointed.
Which parameters are trained is fixed then: every :meth:`Algorithm.step` checks (cheaply) that the model
still holds them where they were put, and ends the job with one line if one was re-homed, replaced,
frozen or unfrozen. Wrapping the same model again retires the earlier algorithm (its hooks are removed;
using it is one line), so the newest wrap is the one that trains.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import math
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..checkpoint.resize_rules import Resize, check_rule_paths, replica_mean, reshard_tree
from ..comm import Communicator, raise_together
from ..errors import ScriptError
from ..flat import FlatParameters
from .shared.user_loop import UsedParameters, dtype_problem, optimizer_params, optimizer_problem, sparse_problem

__all__ = ["Algorithm", "AlgorithmConfig", "GossipOverlapConfig", "check_bool", "check_int", "check_range",
           "clone_optimizer_state"]


def check_range(name: str, value, lo=None, hi=None, lo_open=False, hi_open=False) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a finite number in the stated interval."""
    bad = (lo is not None and (value <= lo if lo_open else value < lo)) or \
          (hi is not None and (value >= hi if hi_open else value > hi))
    if bad or not math.isfinite(value):  # NaN fails every comparison; no option means anything at infinity
        left = "(-inf" if lo is None else ("(" if lo_open else "[") + str(lo)
        right = "inf)" if hi is None else str(hi) + (")" if hi_open else "]")
        raise ValueError(f"{name} must be in {left}, {right}, got {value!r}")


def check_int(name: str, value, lo: int) -> None:
    """ValueError naming ``name`` unless ``value`` is an int (not a bool) >= ``lo``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")


def check_bool(name: str, value) -> None:
    """ValueError naming ``name`` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


_LIVE: weakref.WeakSet = weakref.WeakSet()  # every algorithm built in this process and not retired


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


@dataclass(frozen=True)
class GossipOverlapConfig(AlgorithmConfig):
    """overlap: start the exchange of the current iterate in begin_step(), before the forward pass, and finish
    it in step(), so the transfer runs while the gradient is computed (bit for bit the blocking step; a loop
    that does not call begin_step() gets the blocking exchange)."""

    overlap: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_bool("overlap", self.overlap)


class Algorithm(abc.ABC):
    """Base class: flat parameters, a communicator, a validated config, a step counter, traffic stats.

    Subclasses set ``name`` and ``config_class``, implement :meth:`step`, and extend
    :meth:`_extra_state` / :meth:`_load_extra_state` with whatever else they keep. ``centralized``
    says whether every rank applies one averaged (or decoded) gradient (it decides which gradient
    :meth:`clip_grad_norm_` clips); ``takes_optimizer`` whether :meth:`use_optimizer` accepts a user's
    ``torch.optim.Optimizer``, and ``optimizer_refusal`` says what such an algorithm accepts instead.
    ``asynchronous``: its step holds no collective, so its ranks may run free (the loop's ``free_running``).
    """

    name: ClassVar[str] = "algorithm"
    config_class: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig
    centralized: ClassVar[bool] = False
    clips_average: ClassVar[bool] = False
    takes_optimizer: ClassVar[bool] = False
    asynchronous: ClassVar[bool] = False
    optimizer_refusal: ClassVar[str] = ("its local step is not converted to a user optimizer yet; "
                                        "it builds its own from lr, momentum and weight_decay")
    builtin_optimizer_fields: ClassVar[tuple[str, ...]] = ("lr", "momentum", "weight_decay")

    def __init__(self, model: torch.nn.Module, comm: Communicator, config: AlgorithmConfig | None = None):
        config = self.config_class() if config is None else config
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} takes a {self.config_class.__name__}, got {type(config).__name__}")
        self.model = model
        self.comm = comm
        self.config = config
        self.flat = FlatParameters(model)
        self._hooks: list = []  # what this algorithm installed on the model and optimizer (removed when retired)
        self._retired = False
        self._retire_earlier_wraps()
        self._calls = 0  # step() calls, micro-batches included (what a user loop counts)
        self.step_count = 0
        self.user_optimizer = False
        self.lr = config.lr
        self.accumulation = 1
        self.max_grad_norm: float | None = None
        self.last_grad_norm: torch.Tensor | None = None
        self._micro = 0
        self._stepping = False
        self._begun = False  # begin_step() ran for the coming update
        self._pending: Any = None  # what _begin_exchange() started (None: nothing in flight)
        self._begun_start: dict[str, int] | None = None  # ledger totals before it was posted
        self._step_start = comm.ledger.totals()
        self._last_step: dict[str, int] = {k: 0 for k in self._step_start}
        self._check_same_everywhere()
        if config.broadcast_init:
            self.comm.bcast(self.flat.data, root=0)
            self._broadcast_kept_alike()
            self.comm.ledger.reset()

    # ------------------------------------------------------------------ the model every rank holds alike
    def _kept_alike(self) -> list[tuple[str, torch.Tensor]]:
        """The frozen parameters and the buffers, by name: not trained, but equal on every rank from the start."""
        return [*(("parameter " + n, p) for n, p in self.flat.frozen.items()),
                *(("buffer " + n, b) for n, b in self.model.named_buffers())]

    def _broadcast_kept_alike(self) -> None:
        """Collective: rank 0's frozen parameters and buffers on every rank (as DDP broadcasts buffers), in one
        message of their bytes."""
        tensors = [t for _, t in self._kept_alike()]
        if not tensors:
            return
        device = self.flat.data.device
        packed = torch.cat([t.detach().reshape(-1).view(torch.uint8).to(device) for t in tensors])
        self.comm.bcast(packed, root=0)
        offset = 0
        with torch.no_grad():
            for t in tensors:
                size = t.numel() * t.element_size()
                t.copy_(packed[offset:offset + size].clone().view(t.dtype).view(t.shape))
                offset += size

    def _retire_earlier_wraps(self) -> None:
        """Retire every earlier algorithm that trains any of this model's parameters (the model was wrapped again)."""
        mine = {id(p) for p in self.flat.params}
        for other in list(_LIVE):
            if any(id(p) in mine for p in other.flat.params):
                other.retire()
        _LIVE.add(self)

    def retire(self) -> None:
        """Stop being the model's algorithm (the model was wrapped again): remove this algorithm's hooks; from
        now on using it raises one line naming the newer wrap."""
        self._retired = True
        _LIVE.discard(self)
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def keep_hook(self, handle) -> None:
        """Record a hook this algorithm installed on the model or optimizer (removed by :meth:`retire`)."""
        self._hooks.append(handle)

    def check_model(self, what: str = "step()") -> None:
        """Raise :class:`~mpicomm.errors.ScriptError` if this algorithm was retired or the model no longer holds its
        parameters where ``wrap`` put them (see :meth:`mpicomm.flat.FlatParameters.model_problem`)."""
        if self._retired:
            raise ScriptError(f"{self.name}.{what} was called after the same model was wrapped again: the "
                              "newest mpicomm.wrap(...) trains the model; use the algorithm it returned")
        problem = dtype_problem(self.flat) or self.flat.model_problem(self.model)
        if not problem and self.user_optimizer:
            problem = optimizer_problem(self.optimizer, self._optimizer_params)
        if problem:
            raise ScriptError(f"{self.name}.{what}: {problem}")

    @classmethod
    def check_communicator(cls, config: AlgorithmConfig, comm: Communicator) -> None:
        """Raise ``ValueError`` if ``config`` cannot run on ``comm``'s topology (no collective: every rank checks).

        ``make_algorithm`` calls this before anything is built, so that a topology the method cannot use
        is one agreed error rather than one traceback per rank. Nothing to check here.
        """

    @classmethod
    def check_takes_optimizer(cls) -> None:
        """Raise ``ValueError`` naming this algorithm and what it accepts unless it takes a user optimizer."""
        if not cls.takes_optimizer:
            raise ValueError(f"{cls.name} does not accept optimizer=: {cls.optimizer_refusal}")

    # ------------------------------------------------------------------ construction checks
    def _check_same_everywhere(self) -> None:
        """Collective: every rank must wrap the same architecture with the same config."""
        kept = tuple((name, tuple(t.shape), str(t.dtype)) for name, t in self._kept_alike())
        mine = (self.flat.signature(), repr(self.config), kept, str(self.flat.data.dtype))
        first = self.comm.bcast_object(mine, 0, "the check that every rank built the same model and config")
        error = None
        if mine[0] != first[0]:
            error = ValueError(
                f"model mismatch: this rank has {mine[0][0]} parameters in {len(mine[0][1])} tensors, "
                f"rank 0 has {first[0][0]} in {len(first[0][1])}; every rank must build the same model"
            )
        elif mine[3] != first[3]:
            error = ValueError(f"model mismatch: parameter {self.flat.layers[0].name!r} is {mine[3]} on this rank, "
                               f"{first[3]} on rank 0; every rank must build the model in the same dtype")
        elif mine[2] != first[2]:
            differ = sorted(set(mine[2]) ^ set(first[2]))[:3]
            error = ValueError(f"model mismatch: this rank's frozen parameters and buffers differ from rank 0's "
                               f"(e.g. {', '.join(f'{n} {list(s)} {d}' for n, s, d in differ)}); every rank must "
                               "build the same model and freeze the same parameters")
        elif mine[1] != first[1]:
            error = ValueError(f"config mismatch: this rank has {mine[1]}, rank 0 has {first[1]}")
        raise_together(self.comm, error)

    # ------------------------------------------------------------------ a user's optimizer
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
        ``state_dict()`` carries the optimizer's state; a scheduler's state is the caller's to save.

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

    # ------------------------------------------------------------------ accumulation and clipping
    def accumulate(self, n: int) -> None:
        """Communicate and update once every ``n`` calls of :meth:`step` (micro-batches).

        Between them :meth:`zero_grad` does nothing, so backward sums the micro-batches' gradients
        locally; the step then uses the sum divided by ``n``, so ``n`` micro-batches of b samples (each
        loss a mean over its b) give the gradient of one batch of ``n b``. ``step_count`` counts the
        updates, not the micro-batches. ``allreduce_sgd(overlap=True)`` launches its buckets during the
        last micro-batch's backward only. Checkpoint between updates (``pending_micro_batches == 0``):
        ``state_dict()`` does not hold a partial sum.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"accumulate: n must be an int >= 1 (micro-batches per step), got {n!r}")
        if self._micro:
            raise RuntimeError(f"accumulate: {self._micro} micro-batch(es) are pending; change n between steps")
        self.accumulation = n

    @property
    def pending_micro_batches(self) -> int:
        """Micro-batches whose gradients are summed but not yet stepped (0 right after an update)."""
        return self._micro

    def clip_grad_norm_(self, max_norm: float | None) -> None:
        """Clip every step's gradient to 2-norm ``max_norm`` as ``torch.nn.utils.clip_grad_norm_`` does.

        Centralized algorithms clip the *averaged* gradient (its norm is the same on every rank, as
        with DDP followed by ``clip_grad_norm_``); decentralized ones clip each rank's local gradient
        (after accumulation, before weight decay and mixing). The norm before clipping is
        ``last_grad_norm`` (and ``grad_norm`` in :meth:`stats`). ``None`` turns clipping off.
        """
        if max_norm is None:
            self.max_grad_norm = None
            return
        check_range("clip_grad_norm_: max_norm", max_norm, lo=0.0, lo_open=True)
        if self.centralized and not self.clips_average:
            raise ValueError(f"{self.name} does not support clip_grad_norm_: its update is not a step on one "
                             "averaged gradient that could be clipped")
        self.max_grad_norm = float(max_norm)

    def _clip(self, grad: torch.Tensor) -> None:
        """Clip ``grad`` (the flat gradient, through the parameters' views) when clipping is on."""
        if self.max_grad_norm is not None:
            self.last_grad_norm = torch.nn.utils.clip_grad_norm_(self.flat.params, self.max_grad_norm)

    def _prepare(self, grad: torch.Tensor) -> None:
        """Before :meth:`_step`: the mean of the accumulated micro-batches and, if decentralized, clipping."""
        if self.accumulation > 1:
            grad.div_(self.accumulation)
        if not self.centralized:
            self._clip(grad)

    # ------------------------------------------------------------------ overlapping the exchange with compute
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

    # ------------------------------------------------------------------ the training-loop surface
    def zero_grad(self) -> None:
        """Zero the gradient buffer (call before ``backward()``); a no-op while micro-batches accumulate. As with
        torch's ``optimizer.zero_grad()``, a parameter backward then does not reach has no gradient this update."""
        problem = dtype_problem(self.flat)  # re-attaching the gradient views would fail in torch
        if problem:
            raise ScriptError(f"{self.name}.zero_grad(): {problem}")
        if not self._micro:
            self.flat.zero_grad()
            if self.user_optimizer:
                self.used.reset()

    def step(self) -> None:
        """Consume the gradients of the last backward pass: communicate and update the parameters.

        With :meth:`accumulate` (n) only every n-th call does so; the others just count the micro-batch.
        Each call first checks that the model still holds the parameters ``wrap`` flattened
        (:meth:`check_model`). In a loop of the user's own (no app loop naming the step), the hang guard's
        message names this call's number.
        """
        self.check_model()
        self._calls += 1
        guard = getattr(self.comm, "guard", None)
        if guard is None or guard.step is not None:
            self._count_or_update()
            return
        with guard.doing(f"{self.name}.step() call {self._calls} of this rank's loop, after {self.step_count} "
                         "update(s)"):
            self._count_or_update()

    def _count_or_update(self) -> None:
        """Count the micro-batch; at the last one, communicate and update (the body of :meth:`step`)."""
        self._micro += 1
        if self._micro < self.accumulation:
            return
        self._micro = 0
        self._step_start = self._begun_start if self._begun_start is not None else self.comm.ledger.totals()
        problem = sparse_problem(self.flat)
        if problem:
            raise ScriptError(f"{self.name}.step(): {problem}")
        if self.user_optimizer:
            self.used.close()
        grad = self.flat.gather_grads()
        self._prepare(grad)
        self._stepping = True
        try:
            self._step(grad)
        finally:
            self._stepping = False
            self._begun, self._begun_start = False, None
        if self._pending is not None:  # a subclass that started an exchange must consume it in _step
            raise RuntimeError(f"{self.name}: the exchange begin_step() started was not completed by the step")
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
        mu = self.config.momentum if momentum is None else momentum
        return torch.optim.SGD([self._flat_parameter()], lr=self.lr, momentum=mu)

    def _flat_parameter(self) -> torch.nn.Parameter:
        """The flat buffer as one parameter whose grad is the flat grad, for a built-in torch optimizer."""
        param = torch.nn.Parameter(self.flat.data, requires_grad=False)
        param.grad = self.flat.grad
        return param

    def _decayed(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad += weight_decay * x`` in place (the L2 term of the local objective); returns ``grad``.

        Nothing with a user optimizer: its param groups carry their own weight decay.
        """
        if self.config.weight_decay and not self.user_optimizer:
            grad.add_(self.flat.data, alpha=self.config.weight_decay)
        return grad

    @staticmethod
    def _sgd_step(optimizer: torch.optim.SGD, lr: float) -> None:
        """One torch SGD step at step size ``lr`` (momentum as configured)."""
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()

    def _local_step(self) -> None:
        """``x <- x + update`` from ``flat.grad``: the user optimizer's step, or the built-in SGD at ``lr``."""
        if self.user_optimizer:
            self.optimizer.step()
        else:
            self._sgd_step(self.optimizer, self.lr)

    def _user_update(self) -> torch.Tensor | None:
        """A user optimizer's update at the current iterate, ``step(x) - x``, leaving x as it is.

        The optimizer steps a scratch copy of x (the parameters point at it meanwhile), so its state
        advances exactly once. None with the built-in optimizer (see :meth:`_apply_update`).
        """
        if not self.user_optimizer:
            return None
        scratch = self.flat.data.clone()
        with self.flat.redirected(scratch):
            self.optimizer.step()
        return scratch.sub_(self.flat.data)

    def _apply_update(self, update: torch.Tensor | None) -> None:
        """After mixing: ``x += update`` (from :meth:`_user_update`), or the built-in SGD step."""
        if update is None:
            self._sgd_step(self.optimizer, self.lr)
        else:
            self.flat.data.add_(update)

    def close(self) -> None:
        """Collective: release communication resources (asynchronous algorithms free their windows)."""

    def metrics(self) -> dict[str, Any]:
        """Algorithm-specific fields for each ``metrics.jsonl`` record (rank 0's; not collective). None here."""
        return {}

    def set_lr(self, lr: float) -> None:
        """Change the step size (the app's schedule calls this every step); with a user optimizer, of every group."""
        check_range("lr", lr, lo=0.0)
        self.lr = float(lr)
        if self.user_optimizer:
            for group in self.optimizer.param_groups:
                group["lr"] = float(lr)

    # ------------------------------------------------------------------ evaluation and stats
    def consensus_model(self) -> torch.Tensor:
        """Collective: the average of all ranks' flat parameters (what decentralized methods evaluate)."""
        avg = self.flat.data.detach().clone()
        self.comm.allreduce(avg)
        return avg.div_(self.comm.size)

    @contextlib.contextmanager
    def averaged_model(self, buffers: str = "average"):
        """Collective: within the block ``self.model`` holds the average of every rank's parameters; restored after.

        What decentralized methods evaluate and save (their ranks' models differ); for centralized ones it is
        the model every rank already holds. ``buffers``: ``"average"`` (BatchNorm running statistics and other
        floating-point buffers averaged over the ranks too) or ``"own"`` (this rank's). Yields the model::

            with algo.averaged_model() as model:
                torch.save(model.state_dict(), "model.pt")   # on rank 0, say
        """
        if buffers not in ("average", "own"):
            raise ValueError(f"averaged_model: buffers must be 'average' or 'own', got {buffers!r}")
        self.check_model("averaged_model()")
        self._refuse_in_flight("averaged_model() was entered")
        saved = self.flat.data.clone()
        floating = [b for b in self.model.buffers() if b.is_floating_point()] if buffers == "average" else []
        kept = [b.clone() for b in floating]
        self.flat.data.copy_(self.consensus_model())
        for b in floating:  # summed in float64 whatever the buffer's dtype (MPI reduces no half precision)
            b.copy_(self.comm.allreduce(b.detach().to(torch.float64)).div_(self.comm.size))
        try:
            yield self.model
        finally:
            self.flat.data.copy_(saved)
            for b, value in zip(floating, kept):
                b.copy_(value)

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
        if self.last_grad_norm is not None:
            out["grad_norm"] = float(self.last_grad_norm)
        return out

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-exactly: parameters, step, lr, and the subclass's state.

        Between steps only: with an exchange in flight (:meth:`begin_step`) it raises ``RuntimeError``.
        """
        self.check_model("state_dict()")
        self._refuse_in_flight("state_dict() was called")
        return {
            "algorithm": self.name,
            "config": dataclasses.asdict(self.config),
            "step": self.step_count,
            "lr": self.lr,
            "params": self.flat.data.detach().clone(),
            "frozen": {name: p.detach().clone() for name, p in self.flat.frozen.items()},
            "extra": self._extra_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (on a freshly built algorithm of the same kind)."""
        self.check_model("load_state_dict()")
        self._refuse_in_flight("load_state_dict() was called")
        if state.get("algorithm") != self.name:
            raise ValueError(f"state is for algorithm {state.get('algorithm')!r}, this is {self.name!r}")
        params = state["params"]
        if params.numel() != self.flat.numel:
            raise ValueError(f"state holds {params.numel()} parameters, the model has {self.flat.numel}")
        frozen = state.get("frozen", {})  # absent from checkpoints written before frozen parameters were kept
        if frozen and set(frozen) != set(self.flat.frozen):
            raise ValueError(f"state holds frozen parameters {sorted(frozen)}, the model's are "
                             f"{sorted(self.flat.frozen)}")
        self.flat.data.copy_(params)
        with torch.no_grad():
            for name, value in frozen.items():
                self.flat.frozen[name].copy_(value)
        self.step_count = int(state["step"])
        self.lr = float(state["lr"])
        self._load_extra_state(state["extra"])

    def _extra_state(self) -> dict[str, Any]:
        """Subclass state (buffers, optimizer state, generators); override and call super()."""
        return {}

    # ------------------------------------------------------------------ another world size
    resize_family: ClassVar[str] = "centralized"
    """Which rule of docs/checkpoints.md (Another world size) this method follows on a resize."""
    resize_sharded: ClassVar[bool] = False
    """Whether the method keeps error buffers or public copies per node shard under a two-level exchange."""

    def resize_refusal(self) -> str:
        """Why this method cannot continue a checkpoint of another world size (``""``: it can)."""
        if self.resize_sharded and self._two_level_in_use():
            return (f"{self.name} with a two-level (hierarchical) exchange cannot change world size: its error "
                    "buffers or public copies are kept per node shard, whose layout changes with the size; "
                    "resume at the saved size, or with hierarchical=off on both sides")
        return ""

    def _two_level_in_use(self) -> bool:
        """Whether this algorithm exchanges in two levels (a node layout) at this world size."""
        levels = [getattr(self, "two_level", None), getattr(self, "node_gossip", None),
                  *(getattr(self, "levels", None) or [])]
        return any(level is not None for level in levels)

    def _resize_rules(self) -> dict:
        """Dotted paths of :meth:`state_dict` with the rule that builds them on a resize
        (:mod:`~mpicomm.checkpoint.resize_rules`); an entry no path covers must be identical on every saved rank.
        The family's rules: none for a centralized method (everything is agreed); a consensus restart for a
        decentralized one (the replica and every per-rank floating-point entry of ``extra`` averaged); the
        DiLoCo family averages the inner model and inner optimizer. Override and extend."""
        if self.resize_family == "decentralized":
            return {"params": replica_mean, "extra": replica_mean}
        if self.resize_family == "outer":
            return {"params": replica_mean, "extra.optimizer": replica_mean}
        return {}

    def check_resize_rules(self) -> None:
        """ValueError naming a path of :meth:`_resize_rules` that names no entry of :meth:`state_dict` (checked
        when the algorithm is built: a misspelled rule would never apply)."""
        check_rule_paths(self.name, self._resize_rules(), self.state_dict())

    def reshard_state(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        """This rank's state at the current world size from ``states``, the ``state_dict()`` of every rank of a
        checkpoint saved at another world size (old rank order); load it with :meth:`load_state_dict`.

        The rules per family are in :mod:`~mpicomm.checkpoint.resize_rules` and docs/checkpoints.md. Raises
        ``ValueError`` naming the method where it cannot continue (:meth:`resize_refusal`). Not collective.
        """
        refusal = self.resize_refusal()
        if refusal:
            raise ValueError(refusal)
        names = {s.get("algorithm") for s in states}
        if names != {self.name}:
            raise ValueError(f"states are for algorithm(s) {sorted(map(str, names))}, this is {self.name!r}")
        fresh = self.state_dict()
        rules = self._resize_rules()
        check_rule_paths(self.name, rules, fresh)
        resize = Resize(states, fresh, self.comm.rank, self.comm.size, self.name)
        return reshard_tree(states, fresh, resize, rules)

    def _load_extra_state(self, extra: dict[str, Any]) -> None:
        """Restore :meth:`_extra_state`; override and call super()."""
