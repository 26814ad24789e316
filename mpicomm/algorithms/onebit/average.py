"""The two-sided error-compensated 1-bit average of APMSqueeze / 1-bit Adam, 0/1 Adam and 1-bit LAMB.

Tang et al., "APMSqueeze", arXiv:2008.11343, 2020; Tang et al., "1-bit Adam", ICML 2021. On rank i,
with the vector u_i written into :attr:`OneBitAverage.input` (d floats)::

    u_i  <- u_i + e_i;   e_i <- u_i - C(u_i)          # worker error feedback, on the padded vector
    phase 1: rank i sends chunk k of C(u_i) to rank k (all-to-all); rank k is the server of chunk k
    s_k   = (1/n) sum_j C(u_j)[k] + e'_k;   e'_k <- s_k - C(s_k)   # server error feedback
    phase 2: allgather of the n server chunks;   result = concat_k C(s_k)   (identical everywhere)

C is ``SignCodec(scale="l2")``: C(x) = (||x||_2 / sqrt(len x)) sign(x), sign(0) = +1. The vector is
zero-padded to D = n L elements, L = 8 ceil(d / (8 n)), and cut into n chunks of L; padding positions
are zero in u and in the server input and are zeroed in both error buffers after every call, so they
never reach the result. ``one_worker_scale=False`` (APMSqueeze's paper form): the worker compresses
each chunk with its own scale; ``True`` (DeepSpeed's compressed allreduce): one scale
||u_i||_2 / sqrt(D) over the whole padded vector, carried in the 4-byte header of every chunk's
payload (DeepSpeed allgathers it separately), so the bytes are the same.

Bytes per call and rank, P = 4 + L/8: the alltoall contributes n P (sends (n - 1) P), the allgather
P (sends (n - 1) P). Every buffer (2 D + 2 L floats: u, e_i, the server sum and e'_k, with u doubling
as the server's decode scratch; (3 n + 1) P bytes, plus one D-element payload for one_worker_scale) is
allocated at construction; the codec's own per-call temporaries are the same
in every call.

Two levels (:class:`NodeOneBitAverage`, ``hierarchical`` of the 1-bit methods; with ``L`` ranks on each of
``N`` nodes): rank (node a, local j) computes its shard j of the node's exact mean
``w_a = (1/L) sum_{i on a} u_i`` (reduce-scatter inside the node, full precision), runs the average above on
it among the N ranks of local rank j (one per node, so all L NICs of a node carry 1/L of the traffic), and
the node's ranks allgather the N-way results. The result is the 1-bit average over N workers whose inputs are
node means: the two-sided error-compensated argument of Tang et al. (2021, Theorem 1) holds with n = N
workers, each error buffer now shard-sized and per node; the exact intra-node mean only lowers the variance
of what each worker compresses.
"""

from __future__ import annotations

import torch

from ...codecs import SignCodec
from ..shared.hierarchy import TwoLevel

__all__ = ["NodeOneBitAverage", "OneBitAverage", "onebit_average_for"]


class OneBitAverage:
    """Error-compensated 1-bit average of a d-vector over all ranks of ``comm`` (see the module docstring)."""

    def __init__(self, comm, numel: int, device, one_worker_scale: bool = False):
        n, d, rank = comm.size, numel, comm.rank
        self.comm, self.numel, self.one_worker_scale = comm, d, one_worker_scale
        self.codec = SignCodec(scale="l2")
        self.chunk = 8 * -(-d // (8 * n))
        self.padded = n * self.chunk
        self._real = min(max(d - rank * self.chunk, 0), self.chunk)  # unpadded length of the chunk I serve
        self.chunk_payload = payload = self.codec.payload_bytes(self.chunk)  # P = 4 + L / 8
        floats = {"dtype": torch.float32, "device": device}
        octets = {"dtype": torch.uint8, "device": device}
        self.worker_error = torch.zeros(self.padded, **floats)
        self.server_error = torch.zeros(self.chunk, **floats)
        self._u = torch.zeros(self.padded, **floats)
        self._server = torch.zeros(self.chunk, **floats)
        self.send = torch.zeros(n, payload, **octets)            # row k: chunk k of C(u_i), for server k
        self.received = torch.zeros(n, payload, **octets)        # row j: worker j's payload of my chunk
        self.server_payload = torch.zeros(payload, **octets)     # C(s_k) of the chunk I serve
        self.gathered = torch.zeros(n, payload, **octets)        # row k: server k's C(s_k)
        self._whole = torch.zeros(self.codec.payload_bytes(self.padded) if one_worker_scale else 0, **octets)

    @property
    def input(self) -> torch.Tensor:
        """The d-element view to write u_i into before :meth:`average` (overwritten by the result)."""
        return self._u[:self.numel]

    def encode_chunks(self, first: int, last: int) -> None:
        """Worker side for chunks ``first`` .. ``last - 1``: u <- u + e, chunk k of C(u) into row k of
        :attr:`send`, e <- u - C(u) (padding zeroed); elementwise, so chunks may be encoded in any groups.
        One worker scale needs the whole vector: then only (0, n)."""
        codec, L, d = self.codec, self.chunk, self.numel
        lo, hi = first * L, last * L
        u, err = self._u[lo:hi], self.worker_error[lo:hi]
        self._u[max(d, lo):hi].zero_()                           # padding (u held the last result)
        u.add_(err)                                              # u_i + e_i
        if self.one_worker_scale:
            if (first, last) != (0, self.comm.size):
                raise ValueError("one worker scale spans the whole vector: encode chunks 0 .. n - 1 together")
            self._encode_whole(u, err)
        else:
            for k in range(first, last):
                self.send[k].copy_(codec.encode(self._u[k * L:(k + 1) * L]))
                codec.decode(self.send[k], L, out=self.worker_error[k * L:(k + 1) * L])
        torch.sub(u, err, out=err)                               # e_i = u_i - C(u_i)
        self.worker_error[max(d, lo):hi].zero_()

    def _encode_whole(self, u: torch.Tensor, err: torch.Tensor) -> None:
        """C(u) with one scale into ``err`` and every row of :attr:`send` (the scale header, chunk k's signs)."""
        codec, L, n, whole = self.codec, self.chunk, self.comm.size, self._whole
        whole.copy_(codec.encode(u))
        codec.decode(whole, self.padded, out=err)
        self.send[:, :4].copy_(whole[:4].expand(n, 4))
        self.send[:, 4:].copy_(whole[4:].view(n, L // 8))   # chunk k's signs: bytes [k L/8, (k+1) L/8)

    def serve(self, received: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        """Server side of my chunk from the n workers' payloads ``received`` (rows in rank order):
        s = mean + e', C(s) into :attr:`server_payload` (returned), e' <- s - C(s). ``scratch``: L floats."""
        codec, n, L = self.codec, self.comm.size, self.chunk
        server = self._server.zero_()
        for j in range(n):
            server.add_(codec.decode(received[j], L, out=scratch))
        server.div_(n)
        server[self._real:].zero_()
        server.add_(self.server_error)                          # s_k = average + e'_k
        self.server_payload.copy_(codec.encode(server))
        torch.sub(server, codec.decode(self.server_payload, L, out=scratch), out=self.server_error)
        self.server_error[self._real:].zero_()                  # e'_k = s_k - C(s_k)
        return self.server_payload

    def decode_chunks(self, gathered: torch.Tensor, first: int, last: int) -> None:
        """Chunks ``first`` .. ``last - 1`` of the result from the servers' payloads (row k: chunk k's) into u."""
        L = self.chunk
        for k in range(first, last):
            self.codec.decode(gathered[k], L, out=self._u[k * L:(k + 1) * L])

    def average(self) -> torch.Tensor:
        """Collective: the compressed average of every rank's :attr:`input`; returns it as a view of :attr:`input`."""
        n, L = self.comm.size, self.chunk
        self.encode_chunks(0, n)
        received = self.comm.alltoall(self.send, out=self.received)
        self.serve(received, scratch=self._u[:L])  # u_i + e_i is encoded: u's first chunk is free until the allgather
        gathered = self.comm.allgather(self.server_payload, out=self.gathered)
        self.decode_chunks(gathered, 0, n)
        return self._u[:self.numel]

    def state_dict(self) -> dict:
        """Copies of both error buffers."""
        return {"worker_error": self.worker_error.clone(), "server_error": self.server_error.clone()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; ValueError if the shapes say another rank count or model."""
        for key, buf in (("worker_error", self.worker_error), ("server_error", self.server_error)):
            if tuple(state[key].shape) != tuple(buf.shape):
                raise ValueError(
                    f"state's {key} has shape {tuple(state[key].shape)}, expected {tuple(buf.shape)}: "
                    f"it was saved with a different number of ranks or model"
                )
        self.worker_error.copy_(state["worker_error"])
        self.server_error.copy_(state["server_error"])


class NodeOneBitAverage:
    """Two-level 1-bit average: the node's exact mean of this rank's shard, :class:`OneBitAverage` of it between
    nodes, every shard back inside the node (see the module docstring). Same interface as OneBitAverage."""

    def __init__(self, levels: TwoLevel, numel: int, device, one_worker_scale: bool = False):
        self.levels, self.numel = levels, numel
        self.ranks_per_node = levels.layout.local_size
        self.between = OneBitAverage(levels.cross, levels.hi - levels.lo, device, one_worker_scale)
        self._u = torch.zeros(numel, dtype=torch.float32, device=device)

    worker_error = property(lambda self: self.between.worker_error, doc="This rank's worker error (shard, padded).")
    server_error = property(lambda self: self.between.server_error, doc="The server error of the chunk I serve.")
    chunk = property(lambda self: self.between.chunk, doc="L, the elements per chunk of the shard's average.")
    padded = property(lambda self: self.between.padded, doc="The padded shard length.")
    chunk_payload = property(lambda self: self.between.chunk_payload, doc="Bytes of one chunk's payload.")

    @property
    def input(self) -> torch.Tensor:
        """The d-element vector to write u_i into before :meth:`average` (overwritten by the result)."""
        return self._u

    def average(self) -> torch.Tensor:
        """Collective: the two-level compressed average of every rank's :attr:`input`; returns :attr:`input`."""
        levels = self.levels
        levels.node.reduce_scatter(self._u, levels.counts, out=self.between.input).div_(self.ranks_per_node)
        return levels.spread(self._u, self.between.average())

    def state_dict(self) -> dict:
        """Copies of both error buffers (shard-sized)."""
        return self.between.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; ValueError if the shapes say another layout, rank count or model."""
        self.between.load_state_dict(state)


def onebit_average_for(levels: TwoLevel | None, comm, numel: int, device,
                       one_worker_scale: bool = False) -> OneBitAverage | NodeOneBitAverage:
    """The 1-bit average of a ``numel`` vector: flat over ``comm`` (``levels`` None) or in two ``levels``."""
    if levels is None:
        return OneBitAverage(comm, numel, device, one_worker_scale)
    return NodeOneBitAverage(levels, numel, device, one_worker_scale)

