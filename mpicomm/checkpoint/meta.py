"""A checkpoint's meta: what it records of the run, and how a job's expectation is compared with it.

:func:`run_meta` gives the standard entries (topology, algorithm, optimizer, model); ``save_checkpoint``
adds the world size, step, time and :func:`versions`. On loading, :func:`mismatch` names the first entry
of the job's ``expect`` that differs from the stored meta; at another world size the topology is compared
by its kind only (:func:`at_another_size`).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import platform
import re

import h5py
import numpy as np
import torch

from .. import __version__
from .model_record import model_record

__all__ = ["at_another_size", "mismatch", "optimizer_settings", "run_meta", "topology_kind", "versions"]


def versions() -> dict:
    """The versions of mpicomm and of what its files depend on, as a checkpoint records them."""
    try:
        mpi4py = importlib.metadata.version("mpi4py")
    except importlib.metadata.PackageNotFoundError:
        mpi4py = None
    return {"mpicomm": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "numpy": np.__version__, "h5py": h5py.__version__, "hdf5": h5py.version.hdf5_version, "mpi4py": mpi4py}


def run_meta(comm, algorithm=None) -> dict:
    """Standard meta/expect entries: the Communicator's topology (name, W) and the algorithm's name, config, model.

    With an algorithm, ``model_signature`` (its flat parameters' names and shapes, compared on resume)
    and ``model`` (:func:`~.model_record.model_record`: the ``state_dict`` keys and, for a transformers
    model, its class and config; what ``mpicomm export`` rebuilds the model's files from).
    """
    out = {}
    schedule = getattr(comm, "schedule", None)
    if schedule is not None:
        mats = [np.array(schedule.at(t).W) for t in range(schedule.period)]
        out["topology"] = {"name": schedule.name, "W": mats[0] if len(mats) == 1 else np.stack(mats)}
    if algorithm is not None:
        out["algorithm"] = {"name": algorithm.name, "config": dataclasses.asdict(algorithm.config)}
        out["optimizer"] = optimizer_settings(getattr(algorithm, "optimizer", None))
        out["model_signature"] = repr(algorithm.flat.signature())
        out["model"] = model_record(algorithm.model)
    return out


def optimizer_settings(optimizer) -> str:
    """JSON of what an optimizer's steps depend on besides its state: its type and each parameter group's
    options (the learning rate aside: the run's schedule sets it). ``"{}"`` without an optimizer."""
    if optimizer is None:
        return "{}"
    groups = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")}
              for g in optimizer.param_groups]
    return json.dumps({"type": type(optimizer).__name__, "groups": groups}, sort_keys=True, default=repr)


def topology_kind(name) -> str:
    """A topology's name without its size (``ring(4)`` -> ``ring``): what stays the same at another world size."""
    return re.sub(r"\(.*\)$", "", str(name))


def at_another_size(expect: dict, meta: dict) -> dict:
    """``expect`` for a checkpoint of another world size: the topology compared by its kind only (the graph's
    size and its matrix ``W`` are the new size's)."""
    topology = expect.get("topology")
    if not isinstance(topology, dict):
        return expect
    kept = {k: v for k, v in topology.items() if k not in ("W", "name")}
    stored = meta.get("topology", {}).get("name")
    if "name" in topology and (stored is None or topology_kind(stored) != topology_kind(topology["name"])):
        kept["name"] = topology["name"]
    return {**expect, "topology": kept}


def _show(value) -> str:
    if isinstance(value, (np.ndarray, torch.Tensor)):
        text = np.array2string(np.asarray(value.detach().cpu().double() if torch.is_tensor(value) else value),
                               threshold=16, separator=", ").replace("\n", "")
        return f"{type(value).__name__} of shape {tuple(value.shape)} {text}"
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def mismatch(label: str, have, want) -> str | None:
    """How ``have`` (stored) differs from ``want`` (expected), or None; dicts are compared on want's keys."""
    if isinstance(want, dict) and isinstance(have, dict):
        for key, sub in want.items():
            name = f"{label}.{key}" if label else str(key)
            if key not in have:
                return f"checkpoint has no {name!r} (it has {sorted(map(str, have))})"
            found = mismatch(name, have[key], sub)
            if found:
                return found
        return None
    if isinstance(want, (np.ndarray, torch.Tensor)) or isinstance(have, (np.ndarray, torch.Tensor)):
        a, b = (np.asarray(v.detach().cpu().double() if torch.is_tensor(v) else v) for v in (have, want))
        same = a.shape == b.shape and np.array_equal(a, b)
    elif isinstance(want, (list, tuple)) and isinstance(have, (list, tuple)) and len(want) == len(have):
        return next((m for i, (h, w) in enumerate(zip(have, want)) if (m := mismatch(f"{label}[{i}]", h, w))), None)
    else:
        same = type(have) is type(want) and have == want
    return None if same else f"checkpoint has {label} {_show(have)}, this job has {_show(want)}"
