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
import weakref
from typing import Any, ClassVar

import torch

from ...comm import Communicator, raise_together
from ...errors import ScriptError
from ...flat import FlatParameters
from ..shared.reached import Reached
from ..shared.user_loop import dtype_problem, optimizer_problem, sparse_problem
from .averaged import AveragedModel
from .config import AlgorithmConfig, check_range
from .overlap import OverlappedExchange
from .state import CheckpointState
from .user_optimizer import UserOptimizer

__all__ = ["Algorithm"]

_LIVE: weakref.WeakSet = weakref.WeakSet()  # every algorithm built in this process and not retired


class Algorithm(UserOptimizer, OverlappedExchange, AveragedModel, CheckpointState, abc.ABC):
    """Base class: flat parameters, a communicator, a validated config, a step counter, traffic stats.

    Subclasses set ``name`` and ``config_class``, implement :meth:`step`, and extend
    :meth:`_extra_state` / :meth:`_load_extra_state` with whatever else they keep. ``centralized``
    says whether every rank applies one averaged (or decoded) gradient (it decides which gradient
    :meth:`clip_grad_norm_` clips); ``takes_optimizer`` whether :meth:`use_optimizer` accepts a user's
    ``torch.optim.Optimizer``, and ``optimizer_refusal`` says what such an algorithm accepts instead.
    ``asynchronous``: its step holds no collective, so its ranks may run free (the loop's ``free_running``).

    Its parts live in files of their own: a user's optimizer (:class:`.UserOptimizer`), the overlapped
    exchange (:class:`.OverlappedExchange`), the ranks' average model (:class:`.AveragedModel`) and the
    checkpointed state with its resize rules (:class:`.CheckpointState`).
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
    shard_levels: ClassVar[bool] = True
    """With ``shard=True``: whether its shards may be exchanged in two levels over several nodes (``hierarchical``)."""
    shard_refusal: ClassVar[str] = ""
    """Why ``shard=True`` cannot apply to this method (said when it is asked for); the default explains it."""
    masks_unreached: ClassVar[bool] = False
    """Whether its built-in optimizer leaves the weights no gradient has reached where they are
    (:mod:`~mpicomm.algorithms.shared.reached`; the Adam and LAMB families, the 1-bit family, the DiLoCo family's
    outer step)."""

    def __init__(self, model: torch.nn.Module, comm: Communicator, config: AlgorithmConfig | None = None):
        config = self.config_class() if config is None else config
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} takes a {self.config_class.__name__}, got {type(config).__name__}")
        self.model = model
        self.comm = comm
        self.config = config
        # shard=True gathers the parameters in equal parts of 8 ceil(d / 8n): room for the last one's padding
        self.flat = FlatParameters(model, spare=8 * comm.size if getattr(config, "shard", False) else 0)
        self.sharding = None  # shard=True: the step on this rank's shard (:mod:`..shared.sharding`)
        self.reached = Reached(model, self.flat, comm) if self.masks_unreached else None
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
        held = self._hold_unreached(grad)
        self._prepare(grad)
        self._stepping = True
        try:
            self._step(grad)
        finally:
            self._stepping = False
            self._begun, self._begun_start = False, None
        if held is not None:
            held.restore()
            self._zero_unreached(self.reached)
        if self._pending is not None:  # a subclass that started an exchange must consume it in _step
            raise RuntimeError(f"{self.name}: the exchange begin_step() started was not completed by the step")
        self.step_count += 1
        now = self.comm.ledger.totals()
        self._last_step = {k: now[k] - self._step_start[k] for k in now}

    @abc.abstractmethod
    def _step(self, grad: torch.Tensor) -> None:
        """One step of the algorithm on ``self.flat.data`` given the flat gradient ``grad``."""

    # ------------------------------------------------------------------ weights no gradient has reached
    def _masking(self) -> bool:
        """Whether this update leaves unreached weights alone: a method that masks, with its built-in optimizer
        (a user's optimizer skips a parameter whose gradient is None by itself)."""
        return self.reached is not None and not self.user_optimizer

    def _agrees_now(self) -> bool:
        """Whether the ranks agree on what was reached at this update (collective); every update here."""
        return True

    def _hold_unreached(self, grad: torch.Tensor):
        """Before the update: note what ``grad`` reached, agree over the ranks when :meth:`_agrees_now`, tell the
        method what became reached (:meth:`_newly_reached`) and hold the values the update must not change
        (:meth:`_unreached_kept`). None when nothing is held."""
        if not self._masking() or self.reached.done:
            return None
        self.reached.note(grad)
        if self._agrees_now():
            newly = self.reached.agree()
            if len(newly):
                self._newly_reached(newly)
        return self.reached.hold(*self._unreached_kept())

    def _unreached_kept(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The tensors (laid out as the flat buffer) kept at the positions no rank has reached, and those kept where
        this rank has not: the parameters, which every rank updates alike here."""
        return [self.flat.data], []

    def _zero_unreached(self, reached: Reached) -> None:
        """After an update that held unreached weights: zero the method's moments there (nothing here)."""

    def _newly_reached(self, index: torch.Tensor) -> None:
        """The flat positions ``index`` were just agreed as reached (nothing here)."""

    def _local_sgd(self, momentum: float | None = None) -> torch.optim.SGD:
        """A ``torch.optim.SGD`` over the flat buffer (one parameter whose grad is the flat grad).

        Weight decay is not passed to torch: :meth:`_decayed` folds it into the gradient at the
        current iterate, so every algorithm applies it at the same point of its update.
        """
        mu = self.config.momentum if momentum is None else momentum
        return torch.optim.SGD([self._flat_parameter()], lr=self.lr, momentum=mu)

    def _flat_parameter(self) -> torch.nn.Parameter:
        """The flat buffer as one parameter whose grad is the flat grad, for a built-in torch optimizer (sharded:
        this rank's shard of it, whose grad is the reduced shard)."""
        if self.sharding is not None:
            return self.sharding.parameter
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
