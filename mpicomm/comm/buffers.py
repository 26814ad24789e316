"""How torch tensors reach MPI: zero-copy views on the CPU, device pointers or host staging on CUDA.

MPI sees every buffer as raw bytes (``MPI.BYTE``) except reductions, which need a typed view.
CUDA tensors go to MPI directly when the MPI library is CUDA-aware (after synchronising the current
stream) and are otherwise staged through reusable (pinned) host buffers, allocated once per shape.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re

import torch
from mpi4py import MPI

__all__ = ["MPI_TYPES", "BufferRouter", "as_bytes", "mpi_typed", "query_cuda_aware"]

MPI_TYPES = {
    torch.float32: MPI.FLOAT,
    torch.float64: MPI.DOUBLE,
    torch.int32: MPI.INT32_T,
    torch.int64: MPI.INT64_T,
    torch.uint8: MPI.UINT8_T,
}
"""The MPI datatype of each dtype reductions support."""


def query_cuda_aware() -> bool:
    """Whether the loaded MPI accepts device pointers.

    ``MPICOMM_CUDA_AWARE=1`` or ``=0`` overrides the probe. Otherwise the loaded ``libmpi`` is asked
    through ``MPIX_Query_cuda_support`` (Open MPI, MPICH); a library without that symbol counts as
    not CUDA-aware, so tensors are staged (always correct, possibly slower).
    """
    env = os.environ.get("MPICOMM_CUDA_AWARE")
    if env is not None:
        if env not in ("0", "1"):
            raise ValueError(f"MPICOMM_CUDA_AWARE must be 0 or 1, got {env!r}")
        return env == "1"
    return _loaded_mpi_is_cuda_aware()


@functools.cache
def _loaded_mpi_is_cuda_aware() -> bool:
    """``MPIX_Query_cuda_support()`` of the ``libmpi`` mapped into this process (False without one).

    Asked once per process: the library does not change, and with torch loaded ``/proc/self/maps`` has
    thousands of lines (scanning it for every communicator cost ~25 ms each)."""
    try:
        with open("/proc/self/maps") as f:
            libs = sorted(set(re.findall(r"\S*/libmpi[^/\s]*\.so[^/\s]*", f.read())))
        for path in libs:
            query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
            if query is not None:
                return bool(query())
    except OSError:
        pass
    return False


def as_bytes(t: torch.Tensor):
    """``[buffer, MPI.BYTE]`` spec of a contiguous tensor (CPU: numpy view; CUDA: the tensor itself)."""
    if t.dtype == torch.uint8 and t.device.type == "cpu":
        return [t.detach().numpy(), MPI.BYTE]  # payloads: the common case, skip the re-views
    raw = t.detach().view(torch.uint8) if t.dim() == 1 else t.detach().reshape(-1).view(torch.uint8)
    return [raw.numpy() if raw.device.type == "cpu" else raw, MPI.BYTE]


def mpi_typed(t: torch.Tensor):
    """``[buffer, MPI datatype]`` spec of a contiguous tensor, for reductions."""
    mpi_type = MPI_TYPES.get(t.dtype)
    if mpi_type is None:
        raise TypeError(f"reductions support dtypes {sorted(map(str, MPI_TYPES))}, got {t.dtype}")
    flat = t.detach().reshape(-1)
    return [flat.numpy() if flat.device.type == "cpu" else flat, mpi_type]


class BufferRouter:
    """Decides, per tensor, whether MPI sees it directly or a staged host copy; owns the staging buffers.

    ``stage``: ``"auto"`` (stage CUDA tensors unless MPI is CUDA-aware), ``"always"`` (stage every
    tensor, CPU ones included: this is how the staging path is tested on machines without a GPU) or
    ``"never"`` (pass device memory even to an MPI that did not declare CUDA support).
    """

    def __init__(self, cuda_aware: bool, stage: str = "auto"):
        if stage not in ("auto", "always", "never"):
            raise ValueError(f"stage must be 'auto', 'always' or 'never', got {stage!r}")
        self.cuda_aware = cuda_aware
        self.stage = stage
        self._host: dict[tuple, list[torch.Tensor]] = {}  # a pool per (slot, shape, dtype)
        self._held: set[int] = set()  # ids of pool buffers a pending non-blocking operation still uses

    def stages(self, t: torch.Tensor) -> bool:
        """Whether MPI sees a staged host copy of ``t`` rather than ``t`` itself."""
        return self._needs_staging(t)

    def _needs_staging(self, t: torch.Tensor) -> bool:
        if self.stage == "always":
            return True
        if t.device.type == "cpu" or self.stage == "never":
            return False
        return not self.cuda_aware

    def _host_buffer(self, slot: str, t: torch.Tensor, hold: bool) -> torch.Tensor:
        """A free host buffer like ``t`` (allocated once, reused); ``hold``: keep it until :meth:`release`."""
        pool = self._host.setdefault((slot, tuple(t.shape), t.dtype), [])
        buf = next((b for b in pool if id(b) not in self._held), None)
        if buf is None:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
            pool.append(buf)
        if hold:
            self._held.add(id(buf))
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """A non-blocking operation that staged through ``buf`` is complete: the buffer may be reused."""
        self._held.discard(id(buf))

    def outbound(self, slot: str, t: torch.Tensor, hold: bool = False) -> torch.Tensor:
        """The tensor MPI should read ``t`` from (``t`` itself, or a filled host copy).

        ``hold`` (non-blocking operations): a staging buffer stays reserved until :meth:`release`, so
        operations in flight together never share one.
        """
        if not t.is_contiguous():
            raise ValueError(f"{slot}: MPI buffers must be contiguous; call .contiguous() first")
        if not self._needs_staging(t):
            if t.is_cuda:
                torch.cuda.current_stream(t.device).synchronize()
            return t
        host = self._host_buffer(slot + ":out", t, hold)
        host.copy_(t)
        return host

    def inbound(self, slot: str, t: torch.Tensor, hold: bool = False) -> tuple[torch.Tensor, callable]:
        """The tensor MPI should write into for ``t``, and a function that lands it in ``t`` afterwards.

        ``hold``: as for :meth:`outbound`; landing releases the buffer.
        """
        if not t.is_contiguous():
            raise ValueError(f"{slot}: MPI buffers must be contiguous; call .contiguous() first")
        if not self._needs_staging(t):
            if t.is_cuda:
                torch.cuda.current_stream(t.device).synchronize()
            return t, _nothing
        host = self._host_buffer(slot + ":in", t, hold)

        def land():
            t.copy_(host)
            self.release(host)

        return host, land

    def staged_bytes(self) -> int:
        """Bytes of host memory held for staging."""
        return sum(b.numel() * b.element_size() for pool in self._host.values() for b in pool)


def _nothing() -> None:
    return None

