"""Which parts of the model a gradient has reached, so that a built-in optimizer leaves the rest where it is.

A parameter that no rank's backward reaches (a branch the forward never takes) and an embedding row that no
batch has used yet have a zero gradient. torch's optimizers never move a parameter whose ``.grad`` is None, and
Adam with an exact average keeps the moments of a zero coordinate at zero; but weight decay still shrinks such a
weight, and the 1-bit family cannot send an exact zero: every coordinate of a 1-bit average comes back as
+-(its chunk's scale), so an unreached weight drifts by about lr * scale / denominator at every step (DeepSpeed's
1-bit Adam leaves this to the user: a hand-made ``exp_avg_mask``).

:class:`Reached` keeps one flag per trainable tensor and, for the weight of each ``nn.Embedding``, one per row.
A rank's own flag (``local``) is set once its gradient there holds a non-zero value; the agreed flag once any
rank's has, and neither is ever cleared. The ranks agree (:meth:`Reached.agree`) with one bitwise-or allreduce
of one bit per agreed flag not yet set: at every update of a centralized method, at the steps of the DiLoCo
family and 0/1 Adam that communicate anyway (their local steps exchange nothing); and only while some flag is
unset: once everything is reached nothing is exchanged or copied again. Like the map of used parameters with a
user's optimizer (:class:`~mpicomm.algorithms.shared.user_loop.UsedParameters`), that allreduce is bookkeeping,
not the method's traffic: it is not booked in the Ledger nor charged by a modelled network. Its size: BERT-base
(30,522 vocabulary rows, 512 positions, about 200 tensors) sends at most 3.9 kB per step, 0.03 % of its 1-bit
momentum's 13.8 MB, and nothing once every row has been used. Around each update of a
method that masks (:meth:`Reached.hold`), the coordinates not yet reached keep their values (weight decay
included) and the method zeroes its moments there: such a weight stays bit-equal to its initial value, as a torch
optimizer leaves a parameter whose gradient is None and ``torch.optim.SparseAdam`` a row no batch used. Once
reached, a coordinate is the method's like any other.

The flags are part of the algorithm's state (``state_dict()["reached"]``: the agreed flags, identical on every
rank, and this rank's own; a resize carries the first and takes the union of the second,
:func:`~mpicomm.checkpoint.resize_rules.flags_union`); a
checkpoint without them counts everything as reached (the behaviour before they existed).
"""

from __future__ import annotations

import torch

from ...codecs import bitpack

__all__ = ["Held", "Reached"]


class Reached:
    """Per-tensor (per-row for embeddings) flags of what received a non-zero gradient: on this rank (``local``,
    which includes the agreed ones) and on any rank (``agreed``).

    ``model``: the wrapped model (its ``nn.Embedding`` weights get a flag per row); ``flat``: its
    :class:`~mpicomm.flat.FlatParameters`; ``comm``: the Communicator whose ranks agree.
    """

    def __init__(self, model: torch.nn.Module, flat, comm):
        self.flat, self.comm = flat, comm
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        self.units = []  # (offset, rows, row length) per trainable tensor: one row for a whole tensor
        for param, layer in zip(flat.params, flat.layers):
            rows = layer.shape[0] if id(param) in embeddings and len(layer.shape) == 2 and layer.numel else 1
            self.units.append((layer.offset, rows, layer.numel // rows))
        self.agreed = torch.tensor([length == 0 for _, rows, length in self.units for _ in range(rows)],
                                   dtype=torch.uint8)  # an empty tensor has nothing to reach
        self.local = self.agreed.clone()
        self._index: dict[str, torch.Tensor] = {}  # unreached flat positions by "agreed" / "local"
        self.before = torch.empty(0, dtype=torch.long)  # the agreed-unreached positions before the last agree()
        self._within: dict[tuple, torch.Tensor] = {}
        self._open: list | None = None  # the tensors :meth:`note` looks at (None: to list again)

    @property
    def done(self) -> bool:
        """Whether every agreed flag is set: then nothing is exchanged, held or zeroed any more (the same answer on
        every rank)."""
        return bool(self.agreed.all())

    def note(self, grad: torch.Tensor) -> None:
        """Set this rank's flags where ``grad`` (the flat gradient) holds a non-zero value; no communication. Only
        the tensors with a flag still unset are looked at (one device-to-host copy of their flags)."""
        if self.local.all():
            return
        if self._open is None:  # (first flag, offset, rows, row length) of each tensor with a flag unset
            self._open, start = [], 0
            for lo, rows, length in self.units:
                if not self.local[start:start + rows].all():
                    self._open.append((start, lo, rows, length))
                start += rows
        open_units = self._open
        seen = torch.cat([grad[lo:lo + rows * length].view(rows, length).ne(0).any(dim=1)
                          for _, lo, rows, length in open_units]).to(device="cpu", dtype=torch.uint8)
        changed, at = False, 0
        for start, _, rows, _ in open_units:
            part = seen[at:at + rows]
            at += rows
            if bool((part > self.local[start:start + rows]).any()):
                self.local[start:start + rows] |= part
                changed = True
        if changed:
            self._forget("local")

    def agree(self) -> torch.Tensor:
        """Collective while some agreed flag is unset: the agreed flags become the union of every rank's own, and
        this rank's own the agreed ones. Returns the flat positions agreed as reached by this call (``before``: the
        positions unreached until then)."""
        device = self.flat.data.device
        if self.done:
            return torch.empty(0, dtype=torch.long, device=device)
        pending = (self.agreed == 0).nonzero().flatten()
        seen = self.local[pending]
        if self.comm.size > 1:
            packed = bitpack.pack(seen.contiguous(), 1)
            with self.comm.unmetered():
                self.comm.allreduce(packed, op="bor")
            seen = bitpack.unpack(packed, 1, len(pending))
        newly = pending[seen.bool()]
        before = self.before = self.unreached_index("agreed")
        if not len(newly):  # nothing new on any rank (so this rank's own flags are the agreed ones): caches stay
            return torch.empty(0, dtype=torch.long, device=device)
        self.agreed[newly] = 1
        self.local.copy_(self.agreed)
        self._forget("agreed")
        self._forget("local")
        return before[~torch.isin(before, self.unreached_index("agreed"))]

    def fill_with_tensor_means(self, values: torch.Tensor, index: torch.Tensor, before: torch.Tensor,
                               offset: int = 0, comm=None) -> None:
        """``values`` at the flat positions ``index`` (just reached) <- the mean of ``values`` over the positions of
        the same trainable tensor that were reached before (those not in ``before``, the unreached positions before
        this agreement); the mean over every position reached before where its tensor had none.

        For a frozen Adam denominator: a coordinate first reached after the freeze has no variance of its own, and
        its tensor's typical one is a better guess than the floor (or eps). ``values`` holds the flat positions
        from ``offset`` on (a shard); ``comm``: the Communicator whose ranks hold the other shards (collective)."""
        hi = offset + values.numel()
        starts = torch.tensor([lo for lo, _, _ in self.units], dtype=torch.long)
        sums = torch.zeros(len(self.units) + 1, dtype=torch.float64)  # the last: over the whole model
        counts = torch.zeros_like(sums)
        for k, (lo, rows, length) in enumerate(self.units):
            a, b = max(lo, offset), min(lo + rows * length, hi)
            if a < b:
                sums[k], counts[k] = float(values[a - offset:b - offset].sum(dtype=torch.float64)), b - a
        held = before[(before >= offset) & (before < hi)].cpu()
        units = torch.searchsorted(starts, held, right=True) - 1
        sums[:-1].index_add_(0, units, values[(held - offset).to(values.device)].double().cpu(), alpha=-1)
        counts[:-1].index_add_(0, units, torch.ones(len(held), dtype=torch.float64), alpha=-1)
        if comm is not None and comm.size > 1:
            sums, counts = comm.allreduce(sums), comm.allreduce(counts)
        sums[-1], counts[-1] = sums[:-1].sum(), counts[:-1].sum()
        means = torch.where(counts[:-1] > 0, sums[:-1] / counts[:-1].clamp(min=1), sums[-1] / counts[-1].clamp(min=1))
        mine = index[(index >= offset) & (index < hi)].cpu()
        fill = means[torch.searchsorted(starts, mine, right=True) - 1].to(values.dtype)
        values[(mine - offset).to(values.device)] = fill.to(values.device)

    def _forget(self, which: str) -> None:
        if which == "local":
            self._open = None
        self._index.pop(which, None)
        self._within = {k: v for k, v in self._within.items() if k[0] != which}

    def unreached_index(self, which: str = "agreed") -> torch.Tensor:
        """The flat positions whose ``which`` flag ("agreed" or "local") is unset, ascending (int64, on the
        parameters' device)."""
        if which not in self._index:
            flags = getattr(self, which)
            parts, start = [], 0
            for lo, rows, length in self.units:
                missing = (flags[start:start + rows] == 0).nonzero().flatten()
                start += rows
                if len(missing):
                    parts.append((lo + missing[:, None] * length + torch.arange(length)).flatten())
            index = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
            self._index[which] = index.to(self.flat.data.device)
        return self._index[which]

    def _index_within(self, which: str, lo: int, hi: int) -> torch.Tensor:
        """The unreached positions in ``[lo, hi)``, counted from ``lo``."""
        key = (which, lo, hi)
        if key not in self._within:
            index = self.unreached_index(which)
            self._within[key] = index[(index >= lo) & (index < hi)] - lo
        return self._within[key]

    def zero(self, tensor: torch.Tensor, offset: int = 0, which: str = "agreed") -> None:
        """Zero ``tensor`` where the ``which`` flag is unset; ``tensor`` holds the flat positions from ``offset``
        on (a shard's moments), or all of them."""
        if not getattr(self, which).all():
            tensor.index_fill_(0, self._index_within(which, offset, offset + tensor.numel()), 0)

    def copy(self, tensor: torch.Tensor, source: torch.Tensor, which: str = "agreed") -> None:
        """``tensor`` <- ``source`` where the ``which`` flag is unset (both laid out as the flat buffer)."""
        if not getattr(self, which).all():
            index = self.unreached_index(which)
            tensor.index_copy_(0, index, source.index_select(0, index))

    def hold(self, agreed: list[torch.Tensor], local: list[torch.Tensor] = ()) -> Held | None:
        """Remember the values of ``agreed`` where no rank has reached them and of ``local`` where this rank has
        not (each tensor laid out as the flat buffer), to put back with :meth:`Held.restore` after the update; None
        when there is nothing to hold."""
        saved = []
        for which, tensors in (("agreed", agreed), ("local", local)):
            index = self.unreached_index(which)
            if len(index):
                saved += [(t, index, t.index_select(0, index)) for t in tensors]
        return Held(saved) if saved else None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The agreed flags (identical on every rank) and this rank's own, uint8, one per tensor or embedding row in
        the flat buffer's order."""
        return {"agreed": self.agreed.clone(), "local": self.local.clone()}

    def load_state_dict(self, saved: dict | None) -> None:
        """Restore :meth:`state_dict`; None (a checkpoint written before the flags existed): everything reached."""
        if saved is None:
            self.agreed.fill_(1)
            self.local.fill_(1)
        else:
            for key in ("agreed", "local"):
                flags = saved[key]
                if flags.numel() != self.agreed.numel():
                    raise ValueError(f"state holds {flags.numel()} reached-flags, this model has {self.agreed.numel()} "
                                     "(one per trainable tensor and embedding row)")
                getattr(self, key).copy_(flags.reshape(-1))
        self._index, self._within, self._open = {}, {}, None


class Held:
    """Values of some tensors at unreached positions, taken before an update (:meth:`Reached.hold`)."""

    def __init__(self, saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
        self.saved = saved

    def restore(self) -> None:
        """Put the values back: whatever the update did there is undone."""
        for tensor, index, values in self.saved:
            tensor.index_copy_(0, index, values)
