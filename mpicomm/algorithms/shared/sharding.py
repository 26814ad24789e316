"""Sharded optimizer state (ZeRO-1: the full gradient stays on every rank) for the centralized methods.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC 2020. Every rank
still holds the whole model and computes the whole gradient; the optimizer's state lives only on the shard each
rank owns (:class:`~.shard_exchange.ShardLayout`, 1/n of the model), so its memory falls by n. A step, on rank r::

    s_r  = (1/n) sum_k g_k[shard r]       reduce-scatter (:class:`~.shard_exchange.ShardedSum`: exact or 4/8-bit)
    s_r  = clip(s_r)                      the global norm from one allreduce of the shards' squared norms
    x[shard r] <- opt_r.step(s_r)         the local step on the shard: the built-in optimizer or the user's
    x    = allgather_r x[shard r]         every rank gets every stepped shard (:class:`~.shard_gather.ShardedGather`:
                                          exact, or each shard's update quantized with error feedback)

The exact exchange sums as an MPICH allreduce does, so ``shard=True`` trains bit for bit as ``shard=False``
(allreduce_sgd and allreduce_adam; the gradient clip excepted, whose norm is summed in another order). Over
several nodes of several ranks (``hierarchical`` auto or on) it runs in two levels (:mod:`.shard_levels`), bit for
bit the unsharded two-level exchange.

The user's optimizer steps slices: ``wrap`` rewrites its parameter groups to the pieces of its parameters that
lie in this rank's shard (1-D views of the flat buffer, their ``.grad`` views of the reduced shard). The groups'
options stay, so a learning-rate scheduler works as before; an elementwise optimizer (torch's SGD, Adam, AdamW,
...) computes on a piece exactly what it computes on the piece's elements of the whole parameter, and the others
are refused. A parameter no rank used in an update is not stepped (its pieces' ``.grad`` are None), as unsharded.

Checkpoints hold the shard's optimizer state in flat form (one vector of the shard's length per state entry, plus
each parameter's scalars such as Adam's step), so a resume at another world size re-cuts the vectors by the new
ownership (:func:`~mpicomm.checkpoint.resize_rules.sharded_optimizer_state`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...checkpoint.resize_rules import sharded_optimizer_state
from ...codecs.base import check_float32
from ..base import AlgorithmConfig, check_bool
from .hierarchy import two_level_for
from .shard_exchange import SHARD_BITS, ShardedSum, ShardLayout
from .shard_gather import ShardedGather
from .shard_levels import NodeShardedGather, NodeShardedSum
from .user_loop import optimizer_params

__all__ = ["ELEMENTWISE", "ShardConfig", "Sharding", "fit_problem"]

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Rprop", "ASGD")
"""torch.optim's optimizers whose update of an element depends on that element's gradient and state alone."""


@dataclass(frozen=True)
class ShardConfig(AlgorithmConfig):
    """shard: keep the optimizer state of this rank's 1/n shard only, reduce-scatter the gradient, step the shard and
    allgather the parameters (ZeRO-1: the full gradient stays on every rank). shard_bits: the reduce-scatter's
    precision, 32 (exact), 8 or 4 (blockwise quantized with error feedback). gather_bits: the parameter
    allgather's, 32 (exact), 8 or 4 (each shard's update quantized blockwise with error feedback). Over several
    nodes (``hierarchical``) the shards are exchanged in two levels (:mod:`.shard_levels`). Not with overlap."""

    shard: bool = False
    shard_bits: int = 32
    gather_bits: int = 32

    def __post_init__(self):
        super().__post_init__()
        check_bool("shard", self.shard)
        for name, what in (("shard_bits", "reduce-scatter"), ("gather_bits", "parameter allgather")):
            bits = getattr(self, name)
            if bits not in SHARD_BITS:
                raise ValueError(f"{name} must be one of {', '.join(map(str, SHARD_BITS))}, got {bits!r}")
            if bits != 32 and not self.shard:
                raise ValueError(f"{name}={bits} sets the sharded {what}'s precision: it needs shard=True")
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
        # before anything is allocated: the shard's reduced gradient, what lands and the optimizer state, plus the
        # quantized exchange's residual over the whole vector
        chunk, size = ShardLayout(flat.numel, comm.size).chunk, flat.data.element_size()
        needed = chunk * (2 * size + state_bytes_per_element) + (flat.numel * size if cfg.shard_bits != 32 else 0)
        problem = fit_problem(needed, _free_bytes(flat.data.device), str(flat.data.device))
        if problem:
            raise ValueError(problem)
        self.levels = two_level_for(cfg, comm, flat.numel, flat.data) if algo.shard_levels else None
        if self.levels is None:
            self.exchange = ShardedSum(comm, flat.numel, cfg.shard_bits, seed, flat.data)
            self.gather = ShardedGather(comm, self.exchange.layout, cfg.gather_bits, seed, flat.data)
        else:
            self.exchange = NodeShardedSum(self.levels, cfg.shard_bits, seed, flat.data)
            self.gather = NodeShardedGather(self.levels, self.exchange.layout, cfg.gather_bits, seed, flat.data)
        self.lo, self.hi = self.exchange.lo, self.exchange.hi
        self.grad = torch.zeros(self.hi - self.lo, dtype=flat.data.dtype, device=flat.data.device)
        self.parameter = torch.nn.Parameter(flat.data[self.lo:self.hi], requires_grad=False)
        self.parameter.grad = self.grad
        self.pieces = [_Piece(self.parameter, "flat", self.lo, self.hi)]

    # ------------------------------------------------------------------ the user's optimizer on the shard
    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Rewrite ``optimizer``'s parameter groups to the pieces of their parameters in this rank's shard (called
        by ``use_optimizer`` once the optimizer is accepted; every rank checked the same type)."""
        flat = self.algo.flat
        index = {id(p): i for i, p in enumerate(flat.params)}
        pieces = []
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
                    pieces.append(_Piece(piece, str(i), lo, hi))
                    mine.append(piece)
            group["params"] = mine
        optimizer.state.clear()
        self.pieces = pieces
        self.algo._optimizer_params = optimizer_params(optimizer)

    @staticmethod
    def optimizer_refusal(optimizer: torch.optim.Optimizer) -> str:
        """Why ``optimizer`` cannot step slices of parameters (not elementwise, or it already holds state); ''."""
        kind = type(optimizer)
        if kind.__module__.split(".")[:2] != ["torch", "optim"] or kind.__name__ not in ELEMENTWISE:
            return (f"shard=True steps your optimizer on slices of its parameters, which gives what it computes on "
                    f"whole ones only for an elementwise optimizer (torch.optim's {', '.join(ELEMENTWISE)}); "
                    f"{kind.__module__}.{kind.__name__} is not one of them")
        if optimizer.state:
            return ("shard=True: the optimizer already holds state (it has stepped); wrap it before its first step, "
                    "so that each rank keeps only its shard's")
        return ""

    # ------------------------------------------------------------------ one step
    def step(self, grad: torch.Tensor, update: Callable[[torch.Tensor], None]) -> None:
        """Collective: reduce-scatter the mean of ``grad`` onto the shard, clip it, ``update(shard_grad)`` (the
        algorithm's local step on the shard's optimizer), gather the parameters (:meth:`apply`)."""
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
