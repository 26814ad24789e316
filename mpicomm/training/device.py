"""Which device a rank trains on, and putting a task's model and batches there.

``--device`` takes ``auto`` (the default), ``cpu``, ``cuda`` or ``cuda:N``:

* ``auto``: ``cuda:{local_rank % device_count}`` when CUDA is available, else ``cpu``;
* ``cuda``: the same GPU choice as ``auto``, but an error when CUDA is absent;
* ``cuda:N``: device N of the ones this process sees; ``cpu``: the CPU.

Indexing by the node-local rank (``mpicomm.comm.local_rank``) modulo the visible device count covers
both ways jobs see GPUs: ``srun --gpus-per-task=1`` gives every task its own ``CUDA_VISIBLE_DEVICES``
with one entry, so each task picks index 0 of its own GPU; ``mpirun``/``mpiexec`` leave every GPU
visible, so local rank r picks GPU r (ranks share GPUs round-robin when there are more ranks than GPUs).

:func:`place` is collective: every rank selects its device, any rank's error becomes the same
``ValueError`` on every rank (the apps turn it into exit status 2 before anything is trained), and
rank 0 prints the placement, ``rank → device`` grouped by host.
"""

from __future__ import annotations

import re
import socket
import sys
from typing import Any

import torch

__all__ = ["cuda_device_count", "place", "place_task", "placement_text", "select_device", "to_device"]

_SPEC = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


def cuda_device_count() -> int:
    """How many CUDA devices this process sees (0 without CUDA or without a GPU)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def select_device(spec: str, local_rank: int, device_count: int | None = None, *,
                  named: str = "--device {}") -> torch.device:
    """The device ``spec`` names for the rank with node-local index ``local_rank``.

    ``device_count`` is the number of CUDA devices visible (None: ask torch); ``ValueError`` for a
    malformed spec, ``cuda`` without CUDA, or ``cuda:N`` beyond the visible devices. ``named``: how the
    caller's user wrote the setting, ``{}`` standing for its value (the apps' flag; the library's
    ``device='{}'``).
    """
    m = _SPEC.match(spec) if isinstance(spec, str) else None
    if m is None or (m.group(2) is not None and m.group(1) != "cuda"):
        raise ValueError(f"{named.format(spec)}: expected auto, cpu, cuda or cuda:N, got {spec!r}")
    kind, index = m.group(1), m.group(2)
    count = cuda_device_count() if device_count is None else device_count
    if kind == "cpu" or (kind == "auto" and count == 0):
        return torch.device("cpu")
    if count == 0:
        raise ValueError(f"{named.format(spec)}: CUDA is not available on {socket.gethostname()} (torch "
                         f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}, no GPU visible); "
                         f"use {named.format('cpu')} or {named.format('auto')}")
    if index is None:
        return torch.device("cuda", local_rank % count)
    if int(index) >= count:
        raise ValueError(f"{named.format(spec)}: this process sees {count} CUDA device(s) "
                         f"(cuda:0..cuda:{count - 1})")
    return torch.device("cuda", int(index))


def place(spec: str, world, *, device_count: int | None = None, out=None) -> torch.device:
    """Collective over ``world``: select this rank's device, agree on errors, print the placement once (rank 0).

    ``world``: a :class:`~mpicomm.comm.World` (or an mpi4py communicator). ``device_count`` overrides the
    visible CUDA device count (tests); ``out`` is where rank 0 prints (default stdout; ``False`` prints nothing).
    """
    from ..comm import as_world, node_layout, raise_together

    world = as_world(world)
    local, _ = node_layout(world)
    device, error = None, None
    try:
        device = select_device(spec, local, device_count)
    except ValueError as exc:
        error = exc
    raise_together(world, error)
    rows = world.allgather_object((socket.gethostname(), str(device)), "the device placement")
    if world.rank == 0 and out is not False:
        stream = sys.stdout if out is None else out
        stream.write(placement_text(rows))
        stream.flush()
    return device


def placement_text(rows: list[tuple[str, str]]) -> str:
    """``rank → host → device`` for every rank, one line per host: ``placement vm: 0 → cpu, 1 → cpu``."""
    hosts: dict[str, list[str]] = {}
    for rank, (host, device) in enumerate(rows):
        hosts.setdefault(host, []).append(f"{rank} → {device}")
    return "".join(f"placement {host}: {', '.join(ranks)}\n" for host, ranks in hosts.items())


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (a tensor, or tuples/lists/dicts of them) on ``device``; tensors already there pass as is.

    Host tensors bound for a GPU are pinned and copied with ``non_blocking=True``, so the copy overlaps
    with the work already queued on the device.
    """
    if torch.is_tensor(batch):
        if batch.device == device:
            return batch
        if batch.device.type == "cpu" and device.type == "cuda":
            return batch.pin_memory().to(device, non_blocking=True)
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def place_task(task: Any, device: torch.device) -> None:
    """Move ``task.model`` to ``device`` and, if the task offers ``to_device(device)``, its data too.

    Call before the algorithm is built: the algorithm flattens the parameters where they are. On the
    CPU nothing moves.
    """
    if device.type == "cpu":
        return
    task.model.to(device)
    move = getattr(task, "to_device", None)
    if move is not None:
        move(device)
