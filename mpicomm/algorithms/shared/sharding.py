"""Sharded optimizer state (ZeRO-1: the full gradient stays on every rank) for the centralized methods.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC 2020. Every rank
still holds the whole model and computes the whole gradient; the optimizer's state lives only on the shard each
rank owns (:class:`~.shard_exchange.ShardLayout`, 1/n of the model), so its memory falls by n. A step, on rank r::

    s_r  = (1/n) sum_k g_k[shard r]       reduce-scatter (:class:`~.shard_exchange.ShardedSum`: fp32 or 4/8-bit)
    s_r  = clip(s_r)                      the global norm from one allreduce of the shards' squared norms
    x[shard r] <- opt_r.step(s_r)         the local step on the shard: the built-in optimizer or the user's
    x    = allgather_r x[shard r]         every rank gets every stepped shard (:class:`~.shard_gather.ShardedGather`:
                                          exact, or each shard's update quantized with error feedback)
    p.grad <- s_r on shard r, 0 elsewhere (``full_grad``: every s_r, by an fp32 allgather)

The fp32 reduce-scatter moves one shard-sized block per message (:mod:`.shard_rounds`), so one shard lands at a
time: the pairwise exchange (``shard_order="fast"``, n - 1 messages a rank), or recursive halving in the order of
MPICH's allreduce (``"exact"``), with which ``shard=True`` trains bit for bit as ``shard=False`` under MPICH
(allreduce_sgd and allreduce_adam; the gradient clip excepted, whose norm is summed in another order). Over
several nodes of several ranks (``hierarchical`` auto or on) it runs in two levels (:mod:`.shard_levels`), in the
exact order bit for bit the unsharded two-level exchange.

The user's optimizer steps slices: ``wrap`` rewrites its parameter groups to the pieces of its parameters that
lie in this rank's shard (1-D views of the flat buffer, their ``.grad`` views of the reduced shard). The groups'
options stay, so a learning-rate scheduler works as before; an elementwise optimizer (torch's SGD, Adam, AdamW,
...) computes on a piece exactly what it computes on the piece's elements of the whole parameter, and the others
are refused. State its constructor made (Adagrad's ``sum`` and ``step``) is made anew for the pieces; other state
(it has stepped) is refused. A parameter no rank used in an update is not stepped (its pieces' ``.grad`` are
None), as unsharded.

Checkpoints hold the shard's optimizer state in flat form (one vector of the shard's length per state entry, plus
each parameter's scalars such as Adam's step), so a resume at another world size re-cuts the vectors by the new
ownership (:func:`~mpicomm.checkpoint.resize_rules.sharded_optimizer_state`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...checkpoint.resize_rules import sharded_optimizer_state
from ...codecs.base import check_float32
from ..base import AlgorithmConfig, check_bool
from .hierarchy import two_level_for
from .shard_exchange import ORDERS, SHARD_BITS, ShardedSum, ShardLayout
from .shard_gather import ShardedGather
from .shard_levels import NodeShardedGather, NodeShardedSum
from .user_loop import optimizer_params

__all__ = ["ELEMENTWISE", "ShardConfig", "Sharding", "fit_problem"]

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Rprop", "ASGD")
"""torch.optim's optimizers whose update of an element depends on that element's gradient and state alone."""


@dataclass(frozen=True)
class ShardConfig(AlgorithmConfig):
    """shard: keep the optimizer state of this rank's 1/n shard only, reduce-scatter the gradient, step the shard and
    allgather the parameters (ZeRO-1: the full gradient stays on every rank); over several nodes (``hierarchical``)
    the shards are exchanged in two levels (:mod:`.shard_levels`); not with overlap. shard_bits: the
    reduce-scatter's precision, 32 (fp32), 8 or 4 (blockwise quantized with error feedback). shard_order: the fp32
    reduce-scatter's order of the sum, "fast" (the pairwise exchange, n - 1 messages a rank) or "exact" (the
    unsharded allreduce's order: bit for bit the unsharded method under MPICH). gather_bits: the parameter
    allgather's, 32 (exact), 8 or 4 (each shard's update quantized blockwise with error feedback). full_grad: after
    ``step()`` every ``p.grad`` holds the whole averaged gradient, as unsharded (one more fp32 allgather a step);
    without it ``p.grad`` holds the averaged gradient on this rank's shard and zero elsewhere."""

    shard: bool = False
    shard_bits: int = 32
    shard_order: str = "fast"
    gather_bits: int = 32
    full_grad: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_bool("shard", self.shard)
        for name, what in (("shard_bits", "reduce-scatter"), ("gather_bits", "parameter allgather")):
            bits = getattr(self, name)
            if bits not in SHARD_BITS:
                raise ValueError(f"{name} must be one of {', '.join(map(str, SHARD_BITS))}, got {bits!r}")
            if bits != 32 and not self.shard:
                raise ValueError(f"{name}={bits} sets the sharded {what}'s precision: it needs shard=True")
        if self.shard_order not in ORDERS:
            raise ValueError(f"shard_order must be one of {', '.join(ORDERS)}, got {self.shard_order!r}")
        if self.shard_order != "fast" and not self.shard:
            raise ValueError(f"shard_order={self.shard_order!r} sets the sharded reduce-scatter's order: it needs "
                             "shard=True")
        check_bool("full_grad", self.full_grad)
        if self.full_grad and not self.shard:
            raise ValueError("full_grad=True gathers the sharded averaged gradient into p.grad: it needs shard=True "
                             "(unsharded, p.grad holds the averaged gradient already)")
        if self.shard and getattr(self, "overlap", False):
            raise ValueError("shard=True does not run with overlap=True yet: the reduce-scatter waits for backward")


def fit_problem(needed: int, free: int | None, where: str) -> str:
    """Why ``needed`` bytes of sharded state do not fit in the ``free`` bytes of ``where`` ('' if they do, or if
    ``free`` is unknown)."""
    if free is None or needed <= free:
        return ""
    gib = 1 << 30
    return (f"shard=True: this rank's shard needs {needed / gib:.2f} GiB more (optimizer state, reduced gradient "
            f"and exchange buffers), but only {free / gib:.2f} GiB of {where} memory is free; run on more ranks "
            "(each holds 1/n of the state) or free memory")


def _free_bytes(device: torch.device) -> int | None:
    """Free memory of ``device`` (a GPU's, or the machine's available memory for the CPU); None if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _same(a, b) -> bool:
    """Whether two optimizer state entries are equal (tensors: same shape, dtype and values)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (torch.is_tensor(a) and torch.is_tensor(b) and a.numel() == b.numel() and a.dtype == b.dtype
                and torch.equal(a.detach().reshape(-1).cpu(), b.detach().reshape(-1).cpu()))
    return a == b


@dataclass
class _Piece:
    """The part of one trainable parameter (index ``param``; ``"flat"`` for the built-in optimizer's one piece)
    inside this rank's shard: flat range ``[lo, hi)``, stepped as ``tensor``."""

    tensor: torch.nn.Parameter
    param: str
    lo: int
    hi: int


class Sharding:
    """An algorithm's step on its shard: the exchange, the optimizer on the shard's pieces, their flat state."""

    def __init__(self, algo, state_bytes_per_element: int):
        self.algo = algo
        flat, comm = algo.flat, algo.comm
        cfg, seed = algo.config, algo.config.seed + comm.rank
        if cfg.shard_bits != 32 or cfg.gather_bits != 32:
            check_float32(algo.name, flat.data, "shard_bits or gather_bits of 8 or 4 quantize with a codec that "
                          "decodes to float32")
        self.full_grad = cfg.full_grad
        self.levels = two_level_for(cfg, comm, flat.numel, flat.data) if algo.shard_levels else None
        # before the shard's buffers are allocated: the reduced gradient and the optimizer state of the shard, and
        # what the exchange holds (:meth:`planned_bytes`)
        layout = (ShardLayout(flat.numel, comm.size) if self.levels is None else
                  ShardLayout(self.levels.hi - self.levels.lo, self.levels.cross.size))
        needed = self.planned_bytes(layout, cfg, flat.data.element_size(), state_bytes_per_element)
        problem = fit_problem(needed, _free_bytes(flat.data.device), str(flat.data.device))
        if problem:
            raise ValueError(problem)
        if self.levels is None:
            self.exchange = ShardedSum(comm, flat.numel, cfg.shard_bits, seed, flat.data, cfg.shard_order)
            self.gather = ShardedGather(comm, self.exchange.layout, cfg.gather_bits, seed, flat.data)
        else:
            self.exchange = NodeShardedSum(self.levels, cfg.shard_bits, seed, flat.data, cfg.shard_order)
            self.gather = NodeShardedGather(self.levels, self.exchange.layout, cfg.gather_bits, seed, flat.data)
        self.lo, self.hi = self.exchange.lo, self.exchange.hi
        self.grad = torch.zeros(self.hi - self.lo, dtype=flat.data.dtype, device=flat.data.device)
        self.parameter = torch.nn.Parameter(flat.data[self.lo:self.hi], requires_grad=False)
        self.parameter.grad = self.grad
        self.pieces = [_Piece(self.parameter, "flat", self.lo, self.hi)]

    @staticmethod
    def planned_bytes(layout: ShardLayout, cfg, element_size: int, state_bytes_per_element: int) -> int:
        """Bytes a rank's shard will hold over ``layout`` (the memory check's, before anything is allocated): the
        reduced gradient and the optimizer state of the longest shard, what the reduce-scatter holds (in fp32 the
        landing buffer, one shard; :meth:`.ShardedSum.planned_bytes`) and, with ``gather_bits`` 8 or 4, the
        gather's residual, previous shard and decode buffer (three shards)."""
        c = layout.chunk
        gather = 3 * c * element_size if cfg.gather_bits != 32 else 0
        return (c * (element_size + state_bytes_per_element) + gather
                + ShardedSum.planned_bytes(layout, cfg.shard_bits, element_size))

    # ------------------------------------------------------------------ the user's optimizer on the shard
    def _cut(self, optimizer: torch.optim.Optimizer) -> list[list[tuple[torch.nn.Parameter, _Piece, int]]]:
        """Per parameter group: ``(parameter, its piece in this rank's shard, the parameter's flat offset)`` for each
        trainable parameter with elements in the shard (the pieces are new 1-D views of the flat buffer)."""
        flat = self.algo.flat
        index = {id(p): i for i, p in enumerate(flat.params)}
        cut = []
        for group in optimizer.param_groups:
            mine = []
            for p in group["params"]:
                i = index.get(id(p))
                if i is None:
                    continue  # a frozen parameter: never stepped
                layer = flat.layers[i]
                lo, hi = max(self.lo, layer.offset), min(self.hi, layer.offset + layer.numel)
                if lo < hi:
                    piece = torch.nn.Parameter(flat.data[lo:hi], requires_grad=False)
                    piece.grad = self.grad[lo - self.lo:hi - self.lo]
                    mine.append((p, _Piece(piece, str(i), lo, hi), layer.offset))
            cut.append(mine)
        return cut

    @staticmethod
    def _fresh(optimizer: torch.optim.Optimizer, cut) -> torch.optim.Optimizer | None:
        """A new optimizer of ``optimizer``'s type and group options over the pieces of ``cut`` (None if this rank
        has none): the state its constructor gives them (Adagrad's ``sum`` and ``step``). Raises what the
        constructor raises."""
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [piece.tensor for _, piece, _ in mine]}
                  for g, mine in zip(optimizer.param_groups, cut) if mine]
        if not groups:
            return None
        # the constructor's own arguments too: Adagrad fills its sum with its initial_accumulator_value argument
        accepted = inspect.signature(type(optimizer)).parameters
        arguments = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        return type(optimizer)(groups, **arguments)

    def _initial_state_problem(self, optimizer: torch.optim.Optimizer) -> str:
        """Whether the state ``optimizer`` holds is what its constructor gives (Adagrad's ``sum`` filled with
        ``initial_accumulator_value`` and ``step`` 0), checked on this rank's pieces against a new optimizer of the
        same type and group options built over them: '' if it is, else which parameter differs."""
        cut = self._cut(optimizer)
        try:
            fresh = self._fresh(optimizer, cut)
        except (TypeError, ValueError, RuntimeError) as exc:
            return f"a new {type(optimizer).__name__} could not be built over the shard to compare: {exc}"
        if fresh is None:
            return ""
        names = {id(p): layer.name for p, layer in zip(self.algo.flat.params, self.algo.flat.layers)}
        for mine in cut:
            for p, piece, offset in mine:
                held, made = optimizer.state.get(p, {}), fresh.state.get(piece.tensor, {})
                same = set(held) == set(made)
                for key in made if same else ():
                    value, new = held[key], made[key]
                    if torch.is_tensor(new) and new.shape == piece.tensor.shape:  # one value per element
                        if not torch.is_tensor(value) or value.numel() != p.numel():
                            same = False
                            break
                        value = value.detach().reshape(-1)[piece.lo - offset:piece.hi - offset]
                    if not _same(value, new):
                        same = False
                        break
                if not same:
                    return f"parameter {names[id(p)]!r}'s {sorted(held)} are not what a new optimizer holds"
        return ""

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Rewrite ``optimizer``'s parameter groups to the pieces of their parameters in this rank's shard (called
        by ``use_optimizer`` once the optimizer is accepted; every rank checked the same type). State it holds from
        its constructor (Adagrad's, checked by :meth:`optimizer_refusal`) is made anew for the pieces."""
        cut = self._cut(optimizer)
        fresh = self._fresh(optimizer, cut) if optimizer.state else None
        for group, mine in zip(optimizer.param_groups, cut):
            group["params"] = [piece.tensor for _, piece, _ in mine]
        optimizer.state.clear()
        if fresh is not None:
            optimizer.state.update({piece: state for piece, state in fresh.state.items() if state})
        self.pieces = [piece for mine in cut for _, piece, _ in mine]
        self.algo._optimizer_params = optimizer_params(optimizer)

    def optimizer_refusal(self, optimizer: torch.optim.Optimizer) -> str:
        """Why ``optimizer`` cannot step slices of parameters (not elementwise, or it holds state other than its
        constructor's, checked on this rank's shard); ''."""
        kind = type(optimizer)
        if kind.__module__.split(".")[:2] != ["torch", "optim"] or kind.__name__ not in ELEMENTWISE:
            return (f"shard=True steps your optimizer on slices of its parameters, which gives what it computes on "
                    f"whole ones only for an elementwise optimizer (torch.optim's {', '.join(ELEMENTWISE)}); "
                    f"{kind.__module__}.{kind.__name__} is not one of them")
        problem = self._initial_state_problem(optimizer) if optimizer.state else ""
        if problem:
            return ("shard=True: the optimizer already holds state other than its constructor's (it has stepped: "
                    f"{problem}); wrap it before its first step, so that each rank keeps only its shard's")
        return ""

    # ------------------------------------------------------------------ one step
    def step(self, grad: torch.Tensor, update: Callable[[torch.Tensor], None]) -> None:
        """Collective: reduce-scatter the mean of ``grad`` onto the shard, clip it, ``update(shard_grad)`` (the
        algorithm's local step on the shard's optimizer), gather the parameters (:meth:`apply`), and leave the
        averaged gradient in ``p.grad`` (:meth:`leave_average`)."""
        algo = self.algo
        self.exchange.reduce_scatter(grad, self.grad).div_(algo.comm.size)
        if algo.max_grad_norm is not None:
            squared = torch.linalg.vector_norm(self.grad, dtype=torch.float64).square().reshape(1)
            algo.comm.allreduce(squared)
            norm = math.sqrt(float(squared))
            algo.last_grad_norm = torch.tensor(norm)
            coef = algo.max_grad_norm / (norm + 1e-6)
            if coef < 1.0:
                self.grad.mul_(coef)
        if algo.user_optimizer:
            unused = {str(i) for i in algo.used.release(algo.comm)}
            for piece in self.pieces:
                piece.tensor.grad = None if piece.param in unused else self.grad[piece.lo - self.lo:piece.hi - self.lo]
        self.apply(lambda: update(self.grad))
        self.leave_average()

    def leave_average(self) -> None:
        """Collective with ``full_grad``: the flat gradient (every ``p.grad``) after the step holds the averaged
        gradient as the step used it (clipped; with the built-in SGD's weight decay folded in, as unsharded) on
        this rank's shard, and zero elsewhere -- summed over the ranks it is the averaged gradient; with
        ``full_grad`` every rank's shard of it everywhere (an fp32 allgather of the reduced shards: 4 d (n - 1) / n
        bytes and n - 1 messages more per rank and step)."""
        flat = self.algo.flat.grad
        if not self.full_grad:
            flat.zero_()
        flat[self.lo:self.hi].copy_(self.grad)
        if self.full_grad and self.algo.comm.size > 1:
            self.gather.exact(flat)

    def apply(self, update: Callable[[], None]) -> None:
        """Collective: ``update()`` steps this rank's shard of the flat parameters, then every rank gets every
        stepped shard (:class:`~.shard_gather.ShardedGather`: exact, or the quantized update)."""
        data = self.algo.flat.data
        self.gather.remember(data)
        update()
        self.gather.gather(data)

    def buffer_bytes(self) -> int:
        """Bytes of the buffers the sharded step holds beyond the model, its gradient and the optimizer state: the
        reduced shard, what lands, the sums' scratch, and with 8/4 bits the residuals, payloads and decode buffers."""
        seen: dict[int, int] = {}

        def walk(value) -> None:
            if torch.is_tensor(value):
                seen[value.data_ptr()] = max(seen.get(value.data_ptr(), 0), value.numel() * value.element_size())
            elif isinstance(value, (list, tuple)):
                for item in value:
                    walk(item)
            elif isinstance(value, (ShardedSum, ShardedGather, NodeShardedSum, NodeShardedGather)):
                for item in vars(value).values():
                    walk(item)

        walk([self.grad, self.exchange, self.gather])
        if self.levels is not None:
            walk(self.levels.shard)
        return sum(seen.values())

    # ------------------------------------------------------------------ state
    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """The shard's optimizer state in flat form, the groups' options and the exchange's state."""
        vectors: dict[str, torch.Tensor] = {}
        scalars: dict[str, dict] = {}
        for piece in self.pieces:
            state = optimizer.state.get(piece.tensor)
            if state is None:
                continue
            kept = {}
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == piece.tensor.shape:
                    if key not in vectors:
                        vectors[key] = torch.zeros_like(self.grad, dtype=value.dtype)
                    vectors[key][piece.lo - self.lo:piece.hi - self.lo] = value
                else:
                    kept[key] = value.clone() if torch.is_tensor(value) else value
            scalars[piece.param] = kept
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"]]
        return {"flat": vectors, "scalars": scalars, "groups": groups, "bounds": torch.tensor([self.lo, self.hi]),
                "exchange": self.exchange.state_dict(), "gather": self.gather.state_dict()}

    def load_state_dict(self, optimizer: torch.optim.Optimizer, saved: dict) -> None:
        """Restore :meth:`state_dict` (saved at this world size, or re-cut for it on a resize)."""
        state = {}
        for i, piece in enumerate(self.pieces):
            kept = saved["scalars"].get(piece.param)
            if kept is None:
                continue
            entry = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in kept.items()}
            for key, vector in saved["flat"].items():
                entry[key] = vector[piece.lo - self.lo:piece.hi - self.lo].clone()
            state[i] = entry
        starts = [0]
        for group in optimizer.param_groups:
            starts.append(starts[-1] + len(group["params"]))
        groups = [{**saved_group, "params": list(range(a, b))}
                  for saved_group, a, b in zip(saved["groups"], starts, starts[1:])]
        optimizer.load_state_dict({"state": state, "param_groups": groups})
        self.exchange.load_state_dict(saved["exchange"])
        self.gather.load_state_dict(saved["gather"])

    @staticmethod
    def resize_rules(path: str) -> dict:
        """How the sharded state at ``path`` is re-cut for another world size."""
        return {path: sharded_optimizer_state}
