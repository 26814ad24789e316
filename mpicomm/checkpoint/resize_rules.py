"""Continuing a checkpoint at another world size: this rank's state built from every saved rank's state.

A checkpoint of N ranks resumed by M ranks gives every new rank the list of the N saved ``state_dict()``
trees (old rank order; large tensors may be :class:`~mpicomm.checkpoint.tree.LazyTensor` leaves, read from
the file a slice at a time) and the state it has itself right after construction at M ranks (``built``).
The new state is built entry by entry (:func:`reshard_tree`). Each method declares its rules
(:meth:`~mpicomm.algorithms.base.Algorithm._resize_rules`: dotted paths such as ``"extra.error"`` to a
rule; a rule on a path covers the entries below it unless a longer path names its own), and
:func:`check_rule_paths` refuses a path that names no entry. An entry no rule covers must be
:func:`agreed`: identical on every saved rank, or the resize is refused naming it -- a per-rank buffer
is never averaged, summed or dropped by default.

Rules applied to each entry below the path they are declared on:

* :func:`agreed`: identical on every saved rank, carried exactly (the default);
* :func:`replica_mean`: carried when identical, the average over the saved ranks when floating point (a
  decentralized method's replicas, momenta and optimizer state: a consensus restart);
* :func:`own_rank`: a rank's own value (its random generator, per-rank counters): old rank r's for new rank
  r < N, the one built at the new size (seeded from the run's seed and the new rank) for r >= N;
* :func:`agreed_or_merged`: the model's buffers (BatchNorm statistics): carried, averaged when floating
  point, else own.

Rules for a whole entry:

* :func:`residual_mean`: an error-feedback residual. Every error-feedback method applies the *mean* over the
  ranks of C(g_i + e_i), so what the next steps still owe the model is mean_i e_i; every new rank gets
  mean_r e_r over the saved ranks, which keeps that mean (the sum would scale it by N / M);
* :func:`rebuilt_for_new_graph`: state tied to the old graph that a consensus restart re-derives as at
  construction (D²'s previous step, PowerGossip's per-edge Q);
* :func:`public_copies`: CHOCO's and DCD's public copies x̂ and their weighted sum, re-derived for the new
  graph as copies of the new replica (the saved replicas' average): consistent on every edge;
* :func:`flags_union`: flags set on any saved rank (what a rank's own gradients reached,
  :mod:`~mpicomm.algorithms.shared.reached`);
* :func:`saved_rank0`: the saved rank 0's value (Streaming DiLoCo's outer gradient, whose in-flight
  fragments hold the same received average on every rank);
* :func:`onebit_worker_errors` / :func:`onebit_server_errors`: the 1-bit average's error buffers
  (:mod:`~mpicomm.algorithms.onebit.average`);
* :func:`sharded_optimizer_state`: a sharded optimizer's state (``shard=True``), re-cut by the new ownership.

Pure functions of tensors: no MPI. Memory: a rule holds the value it builds and one slice of
:data:`SLICE_ELEMENTS` elements of one saved rank's entry at a time (averages are summed slice by slice
in float64), so a new rank never holds the N saved states at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from .tree import LazyTensor

__all__ = ["ONEBIT_RULES", "SLICE_ELEMENTS", "Resize", "agreed", "agreed_or_merged", "check_rule_paths",
           "onebit_server_errors", "onebit_worker_errors", "own_rank", "public_copies", "rebuilt_for_new_graph",
           "replica_mean", "reshard_tree", "residual_mean", "saved_rank0", "sharded_optimizer_state"]

SLICE_ELEMENTS = 1 << 20
"""Elements of one saved entry read and folded at a time: 4 MiB of float32, one chunk of a flat float32 tensor
in its file (:mod:`~mpicomm.checkpoint.tree` writes chunks of 4 MiB), 8 MiB summed in float64."""


@dataclass
class Resize:
    """What a rule sees: the saved ranks' states, this rank's state as built at the new size and its place there."""

    states: list
    built: dict
    rank: int
    size: int
    name: str = "algorithm"
    places: list[int] | None = None
    """Each state's rank in the world that saved it, where some of that world's ranks are missing (the survivors
    of a lost rank, :mod:`mpicomm.training.recovery`); None: the states are every rank's, in rank order."""
    _cache: dict = field(default_factory=dict)

    @property
    def old_size(self) -> int:
        """N, the world size the checkpoint was saved at."""
        return len(self.states)

    def mean_params(self) -> torch.Tensor:
        """The average of the saved ranks' flat parameters (this rank's new replica under a consensus restart)."""
        return self.carried_or_averaged("params", [s["params"] for s in self.states])[1]

    def carried_or_averaged(self, path: str, values: list) -> tuple[bool, Any]:
        """:func:`_carried_or_averaged` of the entry at ``path``, computed once (the replica is also what CHOCO's
        and DCD's public copies are rebuilt from)."""
        if path not in self._cache:
            self._cache[path] = _carried_or_averaged(values)
        return self._cache[path]


Rule = Callable[[list, Any, Resize, str], Any]
"""``rule(values, built_value, resize, path)``: the new value of the entry at ``path`` from the saved ranks'
``values`` and this rank's ``built_value`` (the entry as built at the new size; None where it has none)."""


def _leafwise(rule: Rule) -> Rule:
    """Mark ``rule`` as one applied to each entry below the path it is declared on."""
    rule.leafwise = True
    return rule


# ------------------------------------------------------------------------------------ reading saved leaves
def _tensorish(value) -> bool:
    return torch.is_tensor(value) or isinstance(value, LazyTensor)


def _load(value):
    """A saved leaf as a value (a lazy tensor read whole)."""
    return value.read() if isinstance(value, LazyTensor) else value


def _row_slices(shape: tuple) -> Iterator[slice | None]:
    """Slices of the first axis of ``shape`` of about :data:`SLICE_ELEMENTS` elements each (None: the whole 0-d
    tensor; none for an empty one)."""
    if not shape:
        yield None
        return
    per_row = max(1, int(np.prod(shape[1:], dtype=np.int64)))
    rows = max(1, SLICE_ELEMENTS // per_row)
    for lo in range(0, shape[0], rows):
        yield slice(lo, min(lo + rows, shape[0]))


def _rows(value, rows: slice | None) -> torch.Tensor:
    """``value[rows]`` of a tensor or a lazy tensor (read from its file)."""
    if isinstance(value, LazyTensor):
        return value.read(rows)
    return value if rows is None else value[rows]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, flat (so that NaN equals itself and -0.0 differs from 0.0)."""
    flat = t.detach().reshape(-1).contiguous()
    return flat.view(torch.uint8) if flat.numel() else flat


_DIFFERENT = object()
"""What :func:`_identical` returns for values that differ across the saved ranks."""


def _identical_tensor(values: list):
    """The tensor every saved rank holds (one dtype, shape and the same bits), compared a slice at a time and, when
    lazy, assembled from rank 0's slices as they are read; :data:`_DIFFERENT` otherwise."""
    first = values[0]
    if any(not _tensorish(v) or v.dtype != first.dtype or tuple(v.shape) != tuple(first.shape) for v in values):
        return _DIFFERENT
    out = torch.empty(tuple(first.shape), dtype=first.dtype) if isinstance(first, LazyTensor) else first
    for rows in _row_slices(tuple(first.shape)):
        mine = _rows(first, rows)
        if any(not torch.equal(_bits(mine), _bits(_rows(v, rows))) for v in values[1:]):
            return _DIFFERENT
        if out is not first:
            (out if rows is None else out[rows]).copy_(mine)
    return out


def _same(a, b) -> bool:
    """Whether two saved values are identical (tensors and arrays: dtype, shape and every bit)."""
    if _tensorish(a) or _tensorish(b):
        return _identical_tensor([a, b]) is not _DIFFERENT
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and a.tobytes() == b.tobytes())
    if isinstance(a, (dict, list, tuple)) or isinstance(b, (dict, list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return False
        if isinstance(a, dict):
            return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
        return all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _identical(values: list):
    """The value every saved rank holds (a lazy tensor read once, while it is compared), or :data:`_DIFFERENT`."""
    if all(_tensorish(v) for v in values):
        return _identical_tensor(values)
    return values[0] if all(_same(values[0], v) for v in values[1:]) else _DIFFERENT


def _mean(values: list, rows_kept: int | None = None) -> torch.Tensor:
    """The elementwise average of same-shaped tensors (of their first ``rows_kept`` rows; None: all), summed in
    float64 a slice at a time, in their dtype: the one summation of the rules."""
    first = values[0]
    shape = tuple(first.shape) if rows_kept is None else (rows_kept, *first.shape[1:])
    out = torch.empty(shape, dtype=first.dtype)
    for rows in _row_slices(shape):
        total = torch.zeros(out[rows].shape if rows is not None else out.shape, dtype=torch.float64)
        for v in values:
            total.add_(_rows(v, rows).to(torch.float64))
        if rows is None:
            out.copy_(total.div_(len(values)))
        else:
            out[rows] = total.div_(len(values)).to(out.dtype)
    return out


def _is_float(value) -> bool:
    return _tensorish(value) and value.dtype.is_floating_point


# ------------------------------------------------------------------------------------ rules on each entry
@_leafwise
def agreed(values: list, built_value, resize: Resize, path: str):
    """An entry no rule covers: identical on every saved rank, carried exactly; else the resize is refused."""
    value = _identical(values)
    if value is not _DIFFERENT:
        return value
    raise ValueError(f"{resize.name}: its state entry {path!r} differs across the saved ranks and no resize rule "
                     "covers it (a per-rank buffer must declare whether it is averaged, re-derived or re-split)")


def _carried_or_averaged(values: list) -> tuple[bool, Any]:
    """(True, the value) when identical on every saved rank (carried) or floating point (averaged over them);
    (False, None) for differing values that are not floating point."""
    value = _identical(values)
    if value is not _DIFFERENT:
        return True, value
    if all(_is_float(v) for v in values):
        return True, _mean(values)
    if all(isinstance(v, float) for v in values):
        return True, float(sum(values) / len(values))
    return False, None


@_leafwise
def replica_mean(values: list, built_value, resize: Resize, path: str):
    """Carried when identical; floating point: the average over the saved ranks (a consensus restart)."""
    done, value = resize.carried_or_averaged(path, values)
    if done:
        return value
    raise ValueError(f"{resize.name}: its state entry {path!r} differs across the saved ranks and is not floating "
                     "point, so it cannot be averaged")


@_leafwise
def own_rank(values: list, built_value, resize: Resize, path: str):
    """Old rank r's value for new rank r < N; the one built at the new size otherwise (even ``None``: a generator
    not yet drawn from), or the saved rank 0's where the built state has no such entry."""
    if resize.rank < len(values):
        return _load(values[resize.rank])
    if built_value is None and not _has_entry(resize.built, path):
        return _load(values[0])
    return built_value


@_leafwise
def agreed_or_merged(values: list, built_value, resize: Resize, path: str):
    """The model's buffers: carried when identical on every saved rank, averaged when floating point, else own."""
    done, value = _carried_or_averaged(values)
    return value if done else own_rank(values, built_value, resize, path)


# ------------------------------------------------------------------------------------ rules on a whole entry
def saved_rank0(values: list, built_value, resize: Resize, path: str):
    """The saved rank 0's value."""
    return _load(values[0])


def flags_union(values: list, built_value, resize: Resize, path: str) -> torch.Tensor:
    """Flags set on any saved rank (a rank's own reached-flags: the replicas they describe are averaged into one)."""
    out = _load(values[0]).clone()
    for value in values[1:]:
        out |= _load(value)
    return out


def rebuilt_for_new_graph(values: list, built_value, resize: Resize, path: str):
    """This rank's value as built at the new size (state the new graph re-derives)."""
    return built_value


def _check_flat(values: list, built_value, resize: Resize, what: str) -> None:
    """ValueError unless the saved and the built tensors have one shape (a flat, not per node shard, layout)."""
    shapes = {tuple(v.shape) for v in values}
    if len(shapes) != 1 or (built_value is not None and tuple(built_value.shape) not in shapes):
        raise ValueError(f"{resize.name}: its {what} has shapes {sorted(shapes)} in the checkpoint and "
                         f"{tuple(built_value.shape)} here (a two-level exchange keeps it per node shard)")


def residual_mean(values: list, built_value, resize: Resize, path: str) -> torch.Tensor:
    """A per-rank error-feedback residual: the mean over the saved ranks on every new rank (the mean, what the
    next steps still owe the model, is kept)."""
    _check_flat(values, built_value, resize, "error-feedback residual")
    return _mean(values)


def public_copies(values: list, built_value, resize: Resize, path: str) -> list:
    """CHOCO's / DCD's ``(x̂_i, sum_j W_ij x̂_j)`` per topology slot, re-derived for the new graph: every public
    copy is the new replica x̄, so each pair is ``(x̄, x̄)`` (rows of W sum to 1), consistent on every edge."""
    if not built_value:
        return built_value  # a lossless codec keeps no public copies
    x = resize.mean_params()
    for pair in built_value:
        if pair.shape[-1] != x.numel():
            raise ValueError(f"{resize.name}: its public copies hold {pair.shape[-1]} elements, the model "
                             f"{x.numel()} (a two-level gossip keeps them per node shard)")
    return [x.to(pair.dtype).expand_as(pair).clone() for pair in built_value]


def onebit_worker_errors(values: list, built_value, resize: Resize, path: str) -> torch.Tensor:
    """The 1-bit average's worker errors (padded to N chunks): their mean over the saved ranks on the model's d
    elements, on every new rank, padded to the new M chunks (the mean, what is still owed, is kept)."""
    d = resize.built["params"].numel()
    if any(v.numel() < d for v in values) or built_value.numel() < d:
        raise ValueError(f"{resize.name}: its worker errors are shorter than the model (a two-level exchange "
                         "keeps them per node shard)")
    out = torch.zeros_like(built_value)
    out[:d] = _mean(values, rows_kept=d).to(out.dtype)
    return out


def onebit_server_errors(values: list, built_value, resize: Resize, path: str) -> torch.Tensor:
    """The 1-bit average's server errors: old rank k served chunk k, so the saved chunks in rank order are the
    whole vector's server error; new rank r gets chunk r of it under the new ownership (chunks of M). Reads
    only the saved chunks that overlap the new one. A lost rank's chunk (``resize.places`` names the survivors'
    old ranks; the chunks are of equal size) is gone: that share of the server error restarts at zero."""
    d = resize.built["params"].numel()
    sizes = [v.numel() for v in values]
    if resize.places is None and sum(sizes) < d:
        raise ValueError(f"{resize.name}: its server errors cover {sum(sizes)} elements, the model {d} (a "
                         "two-level exchange keeps them per node shard)")
    starts = _displacements(sizes) if resize.places is None else [place * sizes[0] for place in resize.places]
    chunk = built_value.numel()
    out = torch.zeros(chunk, dtype=built_value.dtype, device=built_value.device)
    lo, hi = resize.rank * chunk, min((resize.rank + 1) * chunk, d)
    for value, size, start in zip(values, sizes, starts):
        a, b = max(lo, start), min(hi, start + size)
        if a < b:
            out[a - lo:b - lo] = _rows(value, slice(a - start, b - start)).to(out.dtype)
    return out


def _gaps(bounds: list[tuple[int, int]], total: int) -> list[tuple[int, int]]:
    """The ranges ``[a, b)`` of ``[0, total)`` that none of ``bounds`` covers (a lost rank's shard)."""
    gaps, pos = [], 0
    for start, end in sorted(bounds):
        if start > pos:
            gaps.append((pos, start))
        pos = max(pos, end)
    if pos < total:
        gaps.append((pos, total))
    return gaps


def _restarted_pieces(values: list, bounds: list[tuple[int, int]], gaps: list[tuple[int, int]]) -> set[str]:
    """The pieces (keys of ``scalars``) that may hold coordinates of ``gaps``: the built-in optimizer's one piece
    (``"flat"``, the whole shard) and, of a user's optimizer (one piece per parameter, numbered in flat order), the
    last parameter of a saved rank whose range ends where a gap begins and the first of one whose range begins where
    a gap ends (the state does not record where a parameter's piece ends, so such a parameter counts as reaching
    into the gap). A parameter wholly inside a gap has no saved scalars at all."""
    restarted = {"flat"}
    for a, b in gaps:
        for value, (start, end) in zip(values, bounds):
            params = [int(k) for k in value["scalars"] if str(k).isdigit()]
            if params and end == a:
                restarted.add(str(max(params)))
            if params and start == b:
                restarted.add(str(min(params)))
    return restarted


def sharded_optimizer_state(values: list, built_value, resize: Resize, path: str) -> dict:
    """A sharded optimizer's state (:mod:`mpicomm.algorithms.shared.sharding`), re-cut for the new ownership.

    Each saved rank's flat vectors (its optimizer state, and the parameter gather's residual) cover its saved
    ``bounds``; the new rank's are assembled from the saved ranges that overlap its new bounds (only those rows are
    read). Each parameter's scalars (Adam's step) come from a saved rank that held a piece of it; the groups'
    options must agree; the reduce-scatter's residual is averaged; the codecs' generators are this rank's own.

    A range no saved rank covers (a lost rank's, :mod:`mpicomm.training.recovery`) restarts: its moments at zero and
    its step count at 0, a fresh Adam's bias correction, never the step count of the survivors' coordinates (with
    it, zero moments after thousands of steps made the next updates about 3x the learning rate). The optimizer keeps
    one step count per piece (the built-in one's whole shard, a user's optimizer's piece of each parameter), so a
    piece of this rank that holds such coordinates restarts whole: its scalars are left out, and the optimizer
    builds its state afresh at the next step (step 0, zero moments, for every coordinate of the piece); an
    optimizer that makes its state when built (Adagrad) gets the piece's scalars as built (step 0) and the recut
    vectors. The pieces that hold none keep their state and step count, and so does a piece without scalars (SGD's
    momentum: the restarted range's is zero, as the optimizer's own start).
    """
    bounds = [tuple(int(b) for b in _load(v["bounds"]).tolist()) for v in values]
    lo, hi = (int(b) for b in _load(built_value["bounds"]).tolist())
    params = resize.built.get("params") if isinstance(resize.built, dict) else None
    total = params.numel() if _tensorish(params) else max([hi, *(end for _, end in bounds)])
    mine = [(a, b) for a, b in _gaps(bounds, total) if max(a, lo) < min(b, hi)]
    restarted = _restarted_pieces(values, bounds, mine) if mine else set()

    def recut(vectors: list) -> torch.Tensor:
        """The new rank's range [lo, hi) from the saved ranks' vectors (None where a rank has none)."""
        held = [(v, b) for v, b in zip(vectors, bounds) if v is not None]
        out = torch.zeros(hi - lo, dtype=held[0][0].dtype)
        for vector, (start, end) in held:
            a, b = max(lo, start), min(hi, end)
            if a < b:
                out[a - lo:b - lo] = _rows(vector, slice(a - start, b - start))
        return out

    flat = {key: recut([v["flat"].get(key) for v in values]) for key in sorted({k for v in values for k in v["flat"]})}
    scalars: dict = {}
    for value in values:
        for param, kept in value["scalars"].items():
            if not (kept and str(param) in restarted):  # no scalars (SGD's momentum): the zeros need no count
                scalars.setdefault(param, {k: _load(v) for k, v in kept.items()})
    for param, fresh in (built_value.get("scalars") or {}).items():
        if fresh and str(param) in restarted:  # state an optimizer makes when built (Adagrad's step 0): as built
            scalars.setdefault(param, {k: _load(v) for k, v in fresh.items()})
    gather = reshard_tree([v["gather"] for v in values], built_value["gather"], resize,
                          {f"{path}.gather.error": lambda vectors, *_: recut(vectors),
                           f"{path}.gather.codec": own_rank},
                          f"{path}.gather")
    return {"flat": flat, "scalars": scalars, "bounds": built_value["bounds"], "gather": gather,
            "groups": reshard_tree([v["groups"] for v in values], built_value["groups"], resize, {}, f"{path}.groups"),
            "exchange": reshard_tree([v["exchange"] for v in values], built_value["exchange"], resize,
                                     {f"{path}.exchange.error": residual_mean, f"{path}.exchange.codec": own_rank},
                                     f"{path}.exchange")}


def _displacements(sizes: list[int]) -> list[int]:
    """Where each of ``sizes``' consecutive parts starts: ``[0, s0, s0 + s1, ...]``."""
    return [int(v) for v in np.cumsum([0, *sizes[:-1]])]


# ------------------------------------------------------------------------------------ the walk
def _lookup(tree, key):
    """``tree[key]`` for a dict (None when absent or not a dict)."""
    return tree.get(key) if isinstance(tree, dict) else None


def reshard_tree(values: list, built_value, resize: Resize, rules: dict[str, Rule], path: str = "",
                 inherited: Rule = agreed):
    """The new value of the entry at ``path`` from the saved ranks' ``values`` (its shape: the saved states').

    A rule declared at ``path`` builds the whole entry, or (a per-entry rule) becomes the rule of the entries
    below it; ``inherited`` is the per-entry rule of the nearest declared path above (:func:`agreed` without)."""
    rule = rules.get(path)
    if rule is not None:
        if not getattr(rule, "leafwise", False):
            return rule(values, built_value, resize, path)
        inherited = rule
    if all(isinstance(v, dict) for v in values) and all(set(v) == set(values[0]) for v in values):
        return {key: reshard_tree([v[key] for v in values], _lookup(built_value, key), resize, rules,
                                  f"{path}.{key}" if path else str(key), inherited) for key in values[0]}
    if all(isinstance(v, (list, tuple)) for v in values) and len({len(v) for v in values}) == 1 \
            and type(values[0]) in (list, tuple):
        built_items = built_value if isinstance(built_value, (list, tuple)) else []
        out = [reshard_tree([v[i] for v in values], built_items[i] if i < len(built_items) else None, resize,
                            rules, f"{path}.{i}" if path else str(i), inherited) for i in range(len(values[0]))]
        return type(values[0])(out)
    return inherited(values, built_value, resize, path)


def _child(node, key: str):
    """(found, child) of a dict (a key spelled ``key``) or a list (index ``key``)."""
    if isinstance(node, dict):
        match = next((k for k in node if str(k) == key), None)
        return match is not None, (node[match] if match is not None else None)
    if isinstance(node, (list, tuple)) and key.isdigit() and int(key) < len(node):
        return True, node[int(key)]
    return False, None


def _has_entry(state, path: str) -> bool:
    """Whether ``state`` holds an entry at the dotted ``path`` (its value may be None)."""
    node = state
    for key in path.split(".") if path else []:
        found, node = _child(node, key)
        if not found:
            return False
    return True


def check_rule_paths(name: str, rules: dict[str, Rule], state: dict) -> None:
    """ValueError naming the first rule path of ``name`` that names no entry of ``state`` (a misspelled rule
    would otherwise never apply, and its entry would take another rule without a word)."""
    for path in rules:
        node, walked = state, []
        for key in path.split(".") if path else []:
            found, child = _child(node, key)
            if not found:
                have = sorted(map(str, node)) if isinstance(node, dict) else (
                    [str(i) for i in range(len(node))] if isinstance(node, (list, tuple)) else [])
                raise ValueError(f"{name}: its resize rule path {path!r} names no entry of its state "
                                 f"({'.'.join(walked) or 'the top level'} holds {have})")
            node = child
            walked.append(key)


REACHED_RULES = {"reached.local": flags_union}
"""A rank's own reached-flags on a resize (every method that masks unreached weights): their union."""

ONEBIT_RULES = {"extra.worker_error": onebit_worker_errors, "extra.server_error": onebit_server_errors}
"""The 1-bit average's errors on a resize (APMSqueeze, 0/1 Adam, 1-bit LAMB): the worker errors re-split keeping
their mean (the mean on every new rank); the server errors, one chunk per rank, reassembled into the whole vector
from their old owners and re-split by the new chunk ownership."""
