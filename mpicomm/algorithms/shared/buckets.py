"""Gradient buckets launched during backward (DDP's bucketing), shared by the overlapping centralized methods.

The flat gradient is cut into contiguous buckets in reverse layer order (the order backward produces
the gradients): parameters are taken from the last layer down, a bucket closing once it holds at least
``first_bucket_numel`` elements (the first one) or ``bucket_numel`` (the others), as DDP does (a small
first bucket starts communication as soon as the last layers have their gradients, large ones after it
keep the number of collectives small). With ``align`` > 1 every boundary is then moved down to a
multiple of ``align`` (a codec's scale blocks: a bucket may then hold part of a parameter, and waits
for every parameter it overlaps); empty buckets are dropped.

A ``register_post_accumulate_grad_hook`` on each parameter counts down the buckets it overlaps; when
the next bucket in launch order is complete, ``launch(lo, hi)`` is called for it and its handle kept.
Buckets are launched strictly in order (a complete bucket waits for the ones before it), so every rank
issues the same collectives in the same order even if its hooks fire in another order. ``finish()``
launches what is left (parameters that got no gradient), waits for every handle and resets.
Only one backward pass per step (outside ``Algorithm.accumulate``, whose hooks launch during the last
micro-batch only): a hook that runs before accumulation refuses a second gradient with a RuntimeError,
leaving the first intact. With MPICH's default (no asynchronous progress thread) a pending collective
advances inside MPI calls: each hook polls the newest handle.

On a CUDA device each launch runs on a side stream of its own (as DDP's reducer does): the stream first waits
for the work queued so far on the current stream (the bucket's gradients), so the encode, and the
synchronisation before MPI reads the buffer, wait for that bucket only, not for backward kernels queued
after it; ``finish()`` makes the current stream wait for the side stream before the results are read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...errors import ScriptError
from ..base import Algorithm, AlgorithmConfig, check_range
from .user_loop import sparse_message

__all__ = ["GradBuckets", "LaunchedTraffic", "OverlapConfig", "bucket_ranges"]


@dataclass(frozen=True)
class OverlapConfig(AlgorithmConfig):
    """overlap: communicate gradient buckets during backward. bucket_numel: minimum elements per bucket
    (25 MiB of fp32, as DDP). first_bucket_numel: minimum elements of the first bucket launched, the last
    layers' (1 MiB of fp32, as DDP; the smaller of the two applies)."""

    overlap: bool = False
    bucket_numel: int = 25 * 2**20 // 4
    first_bucket_numel: int = 2**20 // 4

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.overlap, bool):
            raise TypeError(f"overlap must be a bool, got {type(self.overlap).__name__}")
        for name in ("bucket_numel", "first_bucket_numel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            check_range(name, value, lo=1)


class LaunchedTraffic:
    """Mixin for an :class:`Algorithm` whose buckets launch during backward, before ``step()``.

    The subclass sets ``_first_launch`` (ledger totals before the step's first launch, or None without
    overlap) in its ``_step``; the step's traffic in :meth:`Algorithm.stats` then counts from there.
    """

    _first_launch: dict | None = None

    def step(self) -> None:
        """As :meth:`Algorithm.step`; with overlap, the step's traffic also counts buckets sent during backward."""
        super().step()
        if self._first_launch is not None and not self.pending_micro_batches:
            now = self.comm.ledger.totals()
            self._last_step = {k: now[k] - self._first_launch[k] for k in now}


def bucket_ranges(layers, bucket_numel: int, first_bucket_numel: int, align: int = 1) -> list[list[int]]:
    """[lo, hi) of each bucket in launch order (descending offsets) over the flat ``layers`` (each with
    ``offset`` and ``numel``, in flat order), boundaries on multiples of ``align``; empty buckets dropped."""
    ranges: list[list[int]] = []
    full = True
    for layer in reversed(layers):
        if full:
            ranges.append([layer.offset, layer.offset + layer.numel])
        ranges[-1][0] = layer.offset
        least = min(bucket_numel, first_bucket_numel) if len(ranges) == 1 else bucket_numel
        full = ranges[-1][1] - ranges[-1][0] >= least
    total = layers[-1].offset + layers[-1].numel if layers else 0
    edges = [total] + [lo // align * align for lo, _ in ranges]  # descending; the last is 0
    return [[lo, hi] for hi, lo in zip(edges, edges[1:]) if lo < hi]


class GradBuckets:
    """Contiguous buckets of the flat gradient, each launched once all the parameters it overlaps have gradients.

    ``launch(lo, hi)`` starts the bucket's communication and returns a handle with ``test()`` and
    ``wait()`` (a :class:`~mpicomm.comm.Handle`). ``ranges`` holds each bucket's [lo, hi) in launch
    order and ``size`` how many parameters each overlaps.
    """

    def __init__(self, algo: Algorithm, bucket_numel: int, first_bucket_numel: int,
                 launch: Callable[[int, int], object], align: int = 1):
        self.algo = algo
        self.launch = launch
        self.ranges = bucket_ranges(algo.flat.layers, bucket_numel, first_bucket_numel, align)
        self.owners: list[list[int]] = []  # the buckets each parameter overlaps
        self.size = [0] * len(self.ranges)
        for layer in algo.flat.layers:
            lo, hi = layer.offset, layer.offset + layer.numel
            mine = [k for k, (blo, bhi) in enumerate(self.ranges) if blo < hi and lo < bhi]
            self.owners.append(mine)
            for k in mine:
                self.size[k] += 1
        self.handles: list = []
        grad = algo.flat.grad
        self.stream = torch.cuda.Stream(grad.device) if grad.device.type == "cuda" else None
        self.waiting = list(self.size)
        self.ready = [False] * len(algo.flat.params)
        self.first_launch: dict | None = None  # ledger totals before the first launch of this step
        for index, param in enumerate(algo.flat.params):  # the algorithm removes them if the model is wrapped again
            algo.keep_hook(param.register_hook(functools.partial(self._check_first, index)))
            algo.keep_hook(param.register_post_accumulate_grad_hook(functools.partial(self._ready, index)))

    def _check_first(self, index: int, grad: torch.Tensor) -> None:
        """Hook before accumulation: refuse a second gradient for a parameter whose bucket may be in flight."""
        if self.ready[index]:
            raise RuntimeError(f"{self.algo.name}(overlap=True) takes one backward pass per step (this one was "
                               "refused, the previous gradients are kept); use algo.accumulate(n) to sum "
                               "several backward passes")

    def _ready(self, index: int, param: torch.Tensor) -> None:
        """Hook: parameter ``index`` has its gradient; launch every bucket that is now complete, in order.

        Only during the last micro-batch of an accumulation (:meth:`Algorithm.accumulate`).
        """
        if self.algo.pending_micro_batches + 1 < self.algo.accumulation:
            return
        layer = self.algo.flat.layers[index]
        view = self.algo.flat.grad[layer.offset:layer.offset + layer.numel]
        if param.grad.layout != torch.strided:
            raise ScriptError(f"{self.algo.name}(overlap=True), in backward: {sparse_message(layer.name)}")
        if param.grad.data_ptr() != view.data_ptr():  # autograd replaced the view (grad was None)
            view.copy_(param.grad.reshape(-1))
            param.grad = view.view(layer.shape)
        self.ready[index] = True
        for k in self.owners[index]:
            self.waiting[k] -= 1
        if self.handles:
            self.handles[-1].test()  # let MPI progress the newest pending collective
        self._launch(only_complete=True)

    def _launch(self, only_complete: bool) -> None:
        """Launch the next buckets in order: all of them, or while the next one is complete."""
        while len(self.handles) < len(self.ranges) and not (only_complete and self.waiting[len(self.handles)]):
            if not self.handles:
                self.first_launch = self.algo.comm.ledger.totals()
            self.handles.append(self._on_side_stream(*self.ranges[len(self.handles)]))

    def _on_side_stream(self, lo: int, hi: int):
        """``launch(lo, hi)``, on the side stream after the work queued so far when the gradient is on a GPU."""
        if self.stream is None:
            return self.launch(lo, hi)
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            return self.launch(lo, hi)

    def finish(self) -> tuple[list, dict | None]:
        """Launch the remaining buckets, wait for all, reset for the next step.

        Returns the handles in launch order (waited) and the ledger totals before the first launch.
        """
        self._launch(only_complete=False)
        for handle in self.handles:
            handle.wait()
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        done, first = self.handles, self.first_launch
        self.handles, self.waiting, self.ready, self.first_launch = [], list(self.size), [False] * len(self.ready), None
        return done, first
