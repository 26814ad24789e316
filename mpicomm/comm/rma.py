"""Mailbox: one byte slot per rank that any rank can read at any time, without the owner's help.

Each rank owns a slot of ``nbytes`` bytes. The owner overwrites it with :meth:`Mailbox.publish`; any rank
copies another's slot with :meth:`Mailbox.read`. Neither waits for the other's computation. Two
transports, chosen collectively at construction:

* ``"shared"`` (every rank on one node): a shared-memory window (``Win.Allocate_shared``) read and written
  with plain loads and stores inside one ``Lock_all`` epoch (no MPI progress is needed at all). Each slot
  starts with an int64 sequence number, a seqlock: the owner makes it odd, copies, makes it even; a reader
  copies between two reads of it and retries if it changed or was odd, so a read never returns a torn
  slot and never blocks the owner. ``Win.Sync`` orders the accesses (MPI's memory barrier).
* ``"rma"`` (ranks on several nodes): an ``MPI.Win.Allocate`` window; the owner copies under an exclusive
  lock on its own slot, a reader does one ``Get`` under a shared lock. A rank holds at most one lock at a
  time, so locks cannot deadlock; a read waits only for the owner's copy -- if the MPI library progresses
  passive-target RMA by itself. MPICH does so only with ``MPIR_CVAR_ASYNC_PROGRESS=1`` in the environment
  (see docs/PLATFORM.md; :func:`passive_progress_warning` says when that looks missing). Its progress
  thread spins, so on an oversubscribed node the shared transport is much faster.

Windows live in host memory, so a device (CUDA) tensor is staged through one host buffer of the slot's
size (pinned when CUDA is available): published by a device-to-host copy, read into it and copied to the
device. A communicator built with ``stage="always"`` stages CPU tensors the same way (testing that path
without a GPU). Construction and :meth:`Mailbox.close` are collective. Reads are booked in the communicator's Ledger as
operation ``"rma_get"``: the reader contributes (and receives from the owner) ``nbytes`` per read;
publishing is a local copy and books nothing.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from mpi4py import MPI

from .buffers import as_bytes

__all__ = ["TRANSPORTS", "Mailbox", "passive_progress_warning"]

TRANSPORTS = ("auto", "shared", "rma")
_SEQ = 8  # bytes of the seqlock counter in front of each shared slot


def passive_progress_warning() -> str | None:
    """A message if this MPI is MPICH without ``MPIR_CVAR_ASYNC_PROGRESS=1`` (RMA reads would wait for the owner)."""
    if "MPICH" in MPI.Get_library_version() and os.environ.get("MPIR_CVAR_ASYNC_PROGRESS") != "1":
        return ("MPICH without MPIR_CVAR_ASYNC_PROGRESS=1: a one-sided read completes only when the target "
                "rank next enters MPI, so a slow rank delays its readers; export MPIR_CVAR_ASYNC_PROGRESS=1")
    return None


class Mailbox:
    """Collective: every rank exposes ``nbytes`` bytes that any rank may read; ``transport`` in TRANSPORTS."""

    def __init__(self, comm, nbytes: int, transport: str = "auto"):
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self._comm, self.nbytes, self.rank = comm, nbytes, comm.rank
        self._stage_always = comm.router.stage == "always"
        self._host: torch.Tensor | None = None  # staging buffer for device tensors, made on first use
        node = comm.comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
        one_node = comm.comm.allreduce(node.Get_size(), op=MPI.MIN) == comm.size
        if transport == "shared" and not one_node:
            node.Free()
            raise ValueError("transport='shared' needs every rank on one node; use 'rma' or 'auto'")
        self.transport = ("shared" if one_node else "rma") if transport == "auto" else transport
        if self.transport == "shared":
            self.win = MPI.Win.Allocate_shared(_SEQ + -(-nbytes // 64) * 64, 1, comm=node)  # 8-byte aligned slots
            self.win.Lock_all(MPI.MODE_NOCHECK)
            self._slots = [self._shared_slot(r) for r in range(comm.size)]
            self._seq(self.rank)[0] = 0
            self.win.Sync()
        else:
            self.win = MPI.Win.Allocate(nbytes, 1, comm=comm.comm)
            self._local = torch.frombuffer(self.win.tomemory(), dtype=torch.uint8) if nbytes else _empty()
        self._node = node
        comm.comm.Barrier()

    def _shared_slot(self, rank: int) -> torch.Tensor:
        buf, _ = self.win.Shared_query(rank)
        return torch.frombuffer(buf, dtype=torch.uint8)

    def _seq(self, rank: int) -> np.ndarray:
        return self._slots[rank][:_SEQ].numpy().view(np.int64)

    def publish(self, data: torch.Tensor) -> None:
        """Overwrite this rank's slot with the ``nbytes`` bytes of the contiguous tensor ``data`` (any device)."""
        raw = _raw(data, self.nbytes, "Mailbox.publish")
        if self._staged(raw):
            raw = self._staging().copy_(raw)
        if self.transport == "shared":
            seq = self._seq(self.rank)
            seq[0] += 1  # odd: writing
            self.win.Sync()
            self._slots[self.rank][_SEQ:_SEQ + self.nbytes].copy_(raw)
            self.win.Sync()
            seq[0] += 1  # even: stable
            self.win.Sync()
            return
        self.win.Lock(self.rank, MPI.LOCK_EXCLUSIVE)
        self._local.copy_(raw)
        self.win.Unlock(self.rank)

    def read(self, rank: int, out: torch.Tensor) -> torch.Tensor:
        """Copy rank ``rank``'s slot into ``out`` (contiguous, ``nbytes`` bytes, any device); returns ``out``."""
        target = _raw(out, self.nbytes, "Mailbox.read")
        raw = self._staging() if self._staged(target) else target
        if self.transport == "shared":
            seq, slot = self._seq(rank), self._slots[rank][_SEQ:_SEQ + self.nbytes]
            while True:
                self.win.Sync()
                before = int(seq[0])
                if before % 2 == 0:
                    self.win.Sync()
                    raw.copy_(slot)
                    self.win.Sync()
                    if int(seq[0]) == before:
                        break
                os.sched_yield()
        else:
            self.win.Lock(rank, MPI.LOCK_SHARED)
            self.win.Get(as_bytes(raw), rank)
            self.win.Unlock(rank)
        if raw is not target:
            target.copy_(raw)
        self._comm.ledger.record("rma_get", self.nbytes, {}, {rank: self.nbytes})
        return out

    def _staged(self, raw: torch.Tensor) -> bool:
        return raw.device.type != "cpu" or self._stage_always

    def _staging(self) -> torch.Tensor:
        if self._host is None:
            self._host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return self._host

    def close(self) -> None:
        """Collective: free the window (every rank must have finished reading)."""
        self._comm.comm.Barrier()
        self._slots, self._local = [], _empty()
        if self.transport == "shared":
            self.win.Unlock_all()
        self.win.Free()
        self._node.Free()


def _empty() -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _raw(t: torch.Tensor, nbytes: int, who: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or not t.is_contiguous():
        raise ValueError(f"{who}: expected a contiguous tensor")
    raw = t.detach().reshape(-1).view(torch.uint8)
    if raw.numel() != nbytes:
        raise ValueError(f"{who}: tensor has {raw.numel()} bytes, the mailbox slot has {nbytes}")
    return raw
