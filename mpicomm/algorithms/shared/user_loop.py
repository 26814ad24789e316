"""What a user's loop does to the wrapped model and optimizer between steps, held to DDP's behaviour.

:class:`UsedParameters` is DDP's map of locally used parameters (``find_unused_parameters=True``): a
parameter that got no gradient in an update is not stepped by the user's optimizer (its ``.grad`` is
``None`` during ``optimizer.step()``, which torch's optimizers skip), so momentum, weight decay and Adam
leave it where it is, as plain torch does. The other functions say, in one line, what a loop changed after
``wrap`` that the flat buffer cannot follow: the parameters' dtype (``model.half()``), a sparse gradient
(``nn.Embedding(sparse=True)`` after ``optimizer.zero_grad()``), a parameter group added to the optimizer.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["UsedParameters", "dtype_problem", "optimizer_params", "optimizer_problem", "sparse_message",
           "sparse_problem"]


class UsedParameters:
    """Which trainable parameters got a gradient in this update, and ``.grad = None`` for those that did not.

    A ``register_post_accumulate_grad_hook`` on each parameter marks it when backward accumulates its
    gradient (any micro-batch of the update). A gradient set by hand counts too, as torch steps it: a tensor
    assigned to ``p.grad``, or non-zero values written into it. The marks are cleared by ``algo.zero_grad()``
    (outside an accumulation) and at each update. ``algo`` keeps the hooks (removed when it is retired).
    """

    def __init__(self, algo):
        self.flat = algo.flat
        self.marked = [False] * len(self.flat.params)
        self.local: torch.Tensor | None = None  # this update's map, from close() until release()
        for index, param in enumerate(self.flat.params):
            algo.keep_hook(param.register_post_accumulate_grad_hook(functools.partial(self._mark, index)))

    def _mark(self, index: int, param: torch.Tensor) -> None:
        self.marked[index] = True

    def reset(self) -> None:
        """Forget the marks (``algo.zero_grad()``: a new update's gradients start)."""
        self.marked = [False] * len(self.marked)

    def close(self) -> None:
        """At the update, before the gradients are gathered into the flat buffer: this rank's map, from the
        marks and the ``.grad`` each parameter holds (read now: a centralized step averages them)."""
        used = []
        for marked, param, layer in zip(self.marked, self.flat.params, self.flat.layers):
            if not marked and param.grad is not None:
                view = self.flat.grad[layer.offset:layer.offset + layer.numel]
                marked = param.grad.data_ptr() != view.data_ptr() or bool(view.any())
            used.append(marked)
        self.local = torch.tensor(used, dtype=torch.uint8)
        self.reset()

    def release(self, comm) -> list[int]:
        """Once per update, before the user's optimizer steps: ``.grad = None`` for every parameter no rank used
        (``comm``: agree over its ranks with one small allreduce, not booked as the algorithm's traffic) or, with
        ``comm`` None, that this rank did not use. Returns their indices (empty after the first call)."""
        if self.local is None:
            return []
        used, self.local = self.local, None
        if comm is not None and comm.size > 1:
            with comm.unmetered():
                comm.allreduce(used, op="max")
        unused = [i for i, u in enumerate(used.tolist()) if not u]
        for i in unused:
            self.flat.params[i].grad = None
        return unused


def dtype_problem(flat) -> str:
    """Why the parameters no longer match the flat buffer's dtype (``model.half()`` after ``wrap``), or ``""``."""
    dtype = flat.data.dtype
    for param, layer in zip(flat.params, flat.layers):
        if param.dtype != dtype:
            return (f"parameter {layer.name!r} is {param.dtype} now, but mpicomm.wrap made the model's buffer "
                    f"{dtype} (model.half() / .to(dtype) after wrap): mpicomm trains float32 (or float64) "
                    f"parameters; keep the model in {dtype} and compute in half precision under torch.autocast "
                    "(the apps' --precision bf16 / fp16)")
    return ""


def sparse_problem(flat) -> str:
    """Why a parameter's gradient cannot be averaged (a sparse one), or ``""``."""
    for param, layer in zip(flat.params, flat.layers):
        if param.grad is not None and param.grad.layout != torch.strided:
            return sparse_message(layer.name)
    return ""


def sparse_message(name: str) -> str:
    """What to do about parameter ``name``'s sparse gradient."""
    return (f"parameter {name!r} has a sparse gradient (nn.Embedding / nn.EmbeddingBag with sparse=True, after "
            "optimizer.zero_grad() left it no dense gradient): mpicomm exchanges dense gradients; build the layer "
            "with sparse=False")


def optimizer_params(optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
    """The identities of the parameters ``optimizer`` holds, group by group (what ``wrap`` checked)."""
    return tuple(id(p) for group in optimizer.param_groups for p in group["params"])


def optimizer_problem(optimizer: torch.optim.Optimizer, held: tuple[int, ...]) -> str:
    """Why ``optimizer`` no longer holds the parameters ``wrap`` checked (``held``), or ``""``."""
    if optimizer_params(optimizer) == held:
        return ""
    return ("the optimizer's parameter groups changed after mpicomm.wrap (optimizer.add_param_group or an edited "
            "group['params']): parameters added then would train on each rank alone, never averaged; put them "
            "in the model and the optimizer before mpicomm.wrap, or wrap again")
