"""A model's parameters (and gradients) as views into one flat contiguous buffer.

Algorithms encode, send and update one vector per step instead of one tensor per layer. After
``FlatParameters(model)`` every trainable parameter's ``.data`` is a view into ``flat.data`` and its
``.grad`` a view into ``flat.grad``; ``layers`` keeps each parameter's (name, offset, shape) for
per-layer codecs such as HSQ. The frozen parameters (``requires_grad=False``) are kept by name in
``frozen``: not trained, but part of the model every rank must hold alike.

Which parameters are trained is fixed here: :meth:`FlatParameters.model_problem` says when the model no
longer matches (a parameter re-homed by ``model.to(...)`` or ``p.data = ...``, replaced, frozen or
unfrozen), so that such a parameter is never silently left out of training.
"""

from __future__ import annotations

import contextlib

import torch

from .layer import Layer

__all__ = ["TRAINABLE_DTYPES", "FlatParameters", "Layer"]

TRAINABLE_DTYPES = (torch.float32, torch.float64)
"""What the flat buffer holds: the codecs' scales, the error buffers and the MPI reductions are full precision."""


class FlatParameters:
    """Re-home a model's trainable parameters into one contiguous buffer (``data``) and gradient (``grad``).

    ``spare``: elements allocated past ``data``'s and ``grad``'s ends, for collectives that move equal padded parts
    in place."""

    def __init__(self, model: torch.nn.Module, spare: int = 0):
        everything = list(model.named_parameters())
        named = [(n, p) for n, p in everything if p.requires_grad]
        if not named:
            raise ValueError("model has no trainable parameters (requires_grad=True); nothing to train")
        dtypes = {p.dtype for _, p in named}
        devices = {p.device for _, p in named}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(
                f"all trainable parameters must share one dtype and device to be flattened; "
                f"got dtypes {sorted(map(str, dtypes))} and devices {sorted(map(str, devices))}"
            )
        (dtype,) = dtypes
        if dtype not in TRAINABLE_DTYPES:
            raise ValueError(
                f"the model's trainable parameters are {dtype}; mpicomm trains float32 (or float64) parameters: "
                "keep the model in float32 and compute in half precision under torch.autocast (the apps' "
                "--precision bf16 / fp16), instead of converting the model with .half() / .to(dtype)")
        self.params = [p for _, p in named]
        self.frozen: dict[str, torch.nn.Parameter] = {n: p for n, p in everything if not p.requires_grad}
        self._identity = tuple(id(p) for _, p in everything)
        self.layers: list[Layer] = []
        offset = 0
        for name, p in named:
            self.layers.append(Layer(name, offset, tuple(p.shape)))
            offset += p.numel()
        self.numel = offset
        like = self.params[0]
        # ``spare`` elements past the parameters (``data`` is then a view): room for a collective that moves equal,
        # padded parts in place (the sharded parameter gather)
        allocated = torch.empty(offset + spare, dtype=like.dtype, device=like.device)
        self.data = allocated[:offset] if spare else allocated
        grads = torch.zeros(offset + spare, dtype=like.dtype, device=like.device)  # the same room (a gathered gradient)
        self.grad = grads[:offset] if spare else grads
        for p, layer in zip(self.params, self.layers):
            view = self.data[layer.offset:layer.offset + layer.numel]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view(layer.shape)
            p.grad = self.grad[layer.offset:layer.offset + layer.numel].view(layer.shape)
        self._addresses = tuple(p.data_ptr() for p in self.params)  # where each parameter's data must stay

    def signature(self) -> tuple:
        """(numel, names and shapes): equal on two ranks iff they wrap the same architecture."""
        return self.numel, tuple((layer.name, layer.shape) for layer in self.layers)

    def zero_grad(self) -> None:
        """Zero the flat gradient (and re-attach any ``.grad`` that was set to ``None``)."""
        self.grad.zero_()
        self.gather_grads()

    def gather_grads(self) -> torch.Tensor:
        """Make sure every ``p.grad`` is a view of ``grad`` (copying in a replaced one); return ``grad``.

        ``optimizer.zero_grad(set_to_none=True)`` or autograd may replace a ``.grad`` tensor; this
        copies such a gradient into its slice and re-points ``p.grad`` at the slice.
        """
        for p, layer in zip(self.params, self.layers):
            view = self.grad[layer.offset:layer.offset + layer.numel]
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad.reshape(-1))
            else:
                continue
            p.grad = view.view(layer.shape)
        return self.grad

    @contextlib.contextmanager
    def redirected(self, buffer: torch.Tensor):
        """Within the block every parameter's ``.data`` is a view of ``buffer`` (same layout) instead of ``data``.

        Lets an optimizer step a copy of the parameters (its state is keyed by the Parameter objects,
        which do not change); afterwards the parameters are views of ``data`` again.
        """
        if buffer.shape != self.data.shape or buffer.dtype != self.data.dtype:
            raise ValueError(f"buffer must be {self.numel} {self.data.dtype} elements, got {tuple(buffer.shape)} "
                             f"{buffer.dtype}")
        try:
            for p, layer in zip(self.params, self.layers):
                p.data = buffer[layer.offset:layer.offset + layer.numel].view(layer.shape)
            yield buffer
        finally:
            for p, layer in zip(self.params, self.layers):
                p.data = self.data[layer.offset:layer.offset + layer.numel].view(layer.shape)

    def model_problem(self, model: torch.nn.Module) -> str:
        """Why ``model`` no longer matches what was flattened, or ``""``; cheap enough for every step.

        A trainable parameter must still be a view of ``data`` and still require a gradient, a frozen one
        must still be frozen, and the model must hold the very Parameter objects it held (not new ones from
        a replaced layer, ``load_state_dict(assign=True)`` or ``to_empty``).
        """
        for p, layer, where in zip(self.params, self.layers, self._addresses):
            if p.data_ptr() != where or p.shape != layer.shape:
                return (f"parameter {layer.name!r} no longer lives in the buffer mpicomm.wrap made (it was re-homed "
                        "after wrap, e.g. by model.to(device / dtype / memory_format=...), p.data = ... or "
                        "load_state_dict(assign=True)), so it would not be trained: move and load the model "
                        "before mpicomm.wrap, and afterwards change parameters in place (p.data.copy_(...))")
            if not p.requires_grad:
                return (f"parameter {layer.name!r} was frozen (requires_grad=False) after mpicomm.wrap; the "
                        "trained parameters are fixed at wrap: freeze it before mpicomm.wrap, or wrap again")
        for name, p in self.frozen.items():
            if p.requires_grad:
                return (f"parameter {name!r} was unfrozen (requires_grad=True) after mpicomm.wrap, so it would not "
                        "be trained; the trained parameters are fixed at wrap: unfreeze it before mpicomm.wrap, "
                        "or wrap again")
        if tuple(map(id, model.parameters())) != self._identity:
            return ("the model's parameters were replaced after mpicomm.wrap (a layer swapped, "
                    "load_state_dict(assign=True), to_empty), so the new ones would not be trained: build and load "
                    "the model completely before mpicomm.wrap, or wrap again")
        return ""
