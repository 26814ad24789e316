"""Continuing a checkpoint at another world size: this rank's state built from every saved rank's state.

A checkpoint of N ranks resumed by M ranks gives every new rank the list of the N saved ``state_dict()``
trees (old rank order) and the state it has itself right after construction at M ranks (``fresh``). The new
state is built key by key (:func:`reshard_tree`): an entry named in the algorithm's rules
(:meth:`~mpicomm.algorithms.base.Algorithm._resize_rules`, dotted paths such as ``"extra.error"``) takes that
rule; every other entry takes the default rule :func:`agreed_or_merged`:

* identical on every saved rank (the model and optimizer of a centralized method, the global copy of
  DiLoCo, step counters, agreed theta bounds, shared seeds): carried exactly;
* floating point and different on the ranks (a decentralized method's replicas, their momenta and optimizer
  state, DiLoCo's inner models, BatchNorm statistics): the average over the saved ranks (float64 sum);
* anything else that differs (a rank's own random generator, per-rank counters): old rank r's value for new
  rank r < N, the freshly built one (seeded from the run's seed and the new rank) for r >= N.

Rules for the entries the default does not fit:

* :func:`share_of_sum`: a per-rank error-feedback residual; every new rank gets sum_r e_r / M, so the sum of
  the residuals over the ranks, what the next steps still owe the model, is kept (to float rounding).
* :func:`fresh`: state tied to the old graph that a consensus restart re-derives as at construction (D²'s
  previous step, PowerGossip's per-edge Q).
* :func:`public_copies`: CHOCO's and DCD's public copies x̂ and their weighted sum, re-derived for the new
  graph as copies of the new replica (the saved replicas' average): consistent on every edge.
* :func:`first`: the saved rank 0's value (an entry that is agreed where it matters; Streaming DiLoCo's
  outer gradient, whose in-flight fragments hold the same received average on every rank).
* :func:`onebit_worker_errors` / :func:`onebit_server_errors`: the 1-bit average's error buffers
  (:mod:`~mpicomm.algorithms.onebit.average`).

Pure functions of tensors: no MPI. Memory: every new rank holds all N saved states at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["ONEBIT_RULES", "Resize", "agreed_or_merged", "first", "fresh", "onebit_server_errors",
           "onebit_worker_errors", "public_copies", "reshard_tree", "share_of_sum"]


@dataclass
class Resize:
    """What a rule sees: the saved ranks' states, this rank's freshly built state and its place at the new size."""

    states: list
    fresh: dict
    rank: int
    size: int
    name: str = "algorithm"
    _cache: dict = field(default_factory=dict)

    @property
    def old_size(self) -> int:
        """N, the world size the checkpoint was saved at."""
        return len(self.states)

    def mean_params(self) -> torch.Tensor:
        """The average of the saved ranks' flat parameters (this rank's new replica under a consensus restart)."""
        if "params" not in self._cache:
            self._cache["params"] = _mean([s["params"] for s in self.states])
        return self._cache["params"]


Rule = Callable[[list, Any, Resize], Any]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, flat (so that NaN equals itself and -0.0 differs from 0.0)."""
    flat = t.detach().reshape(-1).contiguous()
    return flat.view(torch.uint8) if flat.numel() else flat


def _same(a, b) -> bool:
    """Whether two leaves are identical (tensors and arrays: dtype, shape and every bit)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(_bits(a), _bits(b)))
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


def _mean(values: list) -> torch.Tensor:
    """The elementwise average of same-shaped tensors, summed in float64, in their dtype."""
    total = torch.zeros(values[0].shape, dtype=torch.float64, device=values[0].device)
    for v in values:
        total.add_(v.to(torch.float64))
    return total.div_(len(values)).to(values[0].dtype)


def _own(values: list, fresh_value, resize: Resize):
    """Old rank r's value for new rank r < N; the freshly built one (or rank 0's, without one) otherwise."""
    if resize.rank < len(values):
        return values[resize.rank]
    return values[0] if fresh_value is None else fresh_value


def agreed_or_merged(values: list, fresh_value, resize: Resize):
    """The default rule: carried when identical on every saved rank, averaged when floating point, else own."""
    if all(_same(values[0], v) for v in values[1:]):
        return values[0]
    if torch.is_tensor(values[0]) and values[0].is_floating_point():
        return _mean(values)
    if isinstance(values[0], float) and all(isinstance(v, float) for v in values):
        return float(sum(values) / len(values))
    return _own(values, fresh_value, resize)


def first(values: list, fresh_value, resize: Resize):
    """The saved rank 0's value."""
    return values[0]


def fresh(values: list, fresh_value, resize: Resize):
    """This rank's value as built at the new size (state the new graph re-derives)."""
    return fresh_value


def _check_flat(values: list, fresh_value, resize: Resize, what: str) -> None:
    """ValueError unless the saved and the fresh tensors have one shape (a flat, not per node shard, layout)."""
    shapes = {tuple(v.shape) for v in values}
    if len(shapes) != 1 or (fresh_value is not None and tuple(fresh_value.shape) not in shapes):
        raise ValueError(f"{resize.name}: its {what} has shapes {sorted(shapes)} in the checkpoint and "
                         f"{tuple(fresh_value.shape)} here (a two-level exchange keeps it per node shard)")


def share_of_sum(values: list, fresh_value, resize: Resize) -> torch.Tensor:
    """A per-rank error-feedback residual: sum over the saved ranks / M on every new rank (the sum is kept)."""
    _check_flat(values, fresh_value, resize, "error-feedback residual")
    total = torch.zeros(values[0].shape, dtype=torch.float64, device=values[0].device)
    for v in values:
        total.add_(v.to(torch.float64))
    return total.div_(resize.size).to(values[0].dtype)


def public_copies(values: list, fresh_value, resize: Resize) -> list:
    """CHOCO's / DCD's ``(x̂_i, sum_j W_ij x̂_j)`` per topology slot, re-derived for the new graph: every public
    copy is the new replica x̄, so each pair is ``(x̄, x̄)`` (rows of W sum to 1), consistent on every edge."""
    if not fresh_value:
        return fresh_value  # a lossless codec keeps no public copies
    x = resize.mean_params()
    for pair in fresh_value:
        if pair.shape[-1] != x.numel():
            raise ValueError(f"{resize.name}: its public copies hold {pair.shape[-1]} elements, the model "
                             f"{x.numel()} (a two-level gossip keeps them per node shard)")
    return [x.to(pair.dtype).expand_as(pair).clone() for pair in fresh_value]


def onebit_worker_errors(values: list, fresh_value, resize: Resize) -> torch.Tensor:
    """The 1-bit average's worker errors (padded to N chunks): their sum over the saved ranks over the model's
    d elements, / M on every new rank, padded to the new M chunks (the sum is kept)."""
    d = resize.fresh["params"].numel()
    if any(v.numel() < d for v in values) or fresh_value.numel() < d:
        raise ValueError(f"{resize.name}: its worker errors are shorter than the model (a two-level exchange "
                         "keeps them per node shard)")
    total = torch.zeros(d, dtype=torch.float64, device=values[0].device)
    for v in values:
        total.add_(v[:d].to(torch.float64))
    out = torch.zeros_like(fresh_value)
    out[:d] = total.div_(resize.size).to(out.dtype)
    return out


def onebit_server_errors(values: list, fresh_value, resize: Resize) -> torch.Tensor:
    """The 1-bit average's server errors: old rank k served chunk k, so the saved chunks in rank order are the
    whole vector's server error; new rank r gets chunk r of it under the new ownership (chunks of M)."""
    d = resize.fresh["params"].numel()
    whole = torch.cat([v.reshape(-1) for v in values])
    if whole.numel() < d:
        raise ValueError(f"{resize.name}: its server errors cover {whole.numel()} elements, the model {d} (a "
                         "two-level exchange keeps them per node shard)")
    chunk = fresh_value.numel()
    padded = torch.zeros(chunk * resize.size, dtype=fresh_value.dtype, device=fresh_value.device)
    padded[:d] = whole[:d].to(padded.dtype)
    return padded[resize.rank * chunk:(resize.rank + 1) * chunk].clone()


def _lookup(tree, key):
    """``tree[key]`` for a dict (None when absent or not a dict)."""
    return tree.get(key) if isinstance(tree, dict) else None


def reshard_tree(values: list, fresh_value, resize: Resize, rules: dict[str, Rule], path: str = ""):
    """The new value of the entry at ``path`` from the saved ranks' ``values`` (its shape: the saved states')."""
    rule = rules.get(path)
    if rule is not None:
        return rule(values, fresh_value, resize)
    if all(isinstance(v, dict) for v in values) and all(set(v) == set(values[0]) for v in values):
        return {key: reshard_tree([v[key] for v in values], _lookup(fresh_value, key), resize, rules,
                                  f"{path}.{key}" if path else str(key)) for key in values[0]}
    if all(isinstance(v, (list, tuple)) for v in values) and len({len(v) for v in values}) == 1 \
            and not all(_same(values[0], v) for v in values[1:]):
        fresh_items = fresh_value if isinstance(fresh_value, (list, tuple)) else []
        out = [reshard_tree([v[i] for v in values], fresh_items[i] if i < len(fresh_items) else None, resize,
                            rules, f"{path}.{i}") for i in range(len(values[0]))]
        return type(values[0])(out)
    return agreed_or_merged(values, fresh_value, resize)


ONEBIT_RULES = {"extra.worker_error": onebit_worker_errors, "extra.server_error": onebit_server_errors}
"""The 1-bit average's errors on a resize (APMSqueeze, 0/1 Adam, 1-bit LAMB): the worker errors re-split keeping
their sum (sum / M each); the server errors, one chunk per rank, reassembled into the whole vector from their
old owners and re-split by the new chunk ownership."""
