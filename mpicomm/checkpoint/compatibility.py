"""Whether a checkpoint can continue this run: what of its recorded settings differs from the live algorithm's.

A checkpoint's meta (:func:`~mpicomm.checkpoint.run_meta`) records the topology, the algorithm's name and
options, the optimizer's type and parameter groups and the model's signature. Resuming with any of them
changed would not continue the saved run: the algorithm's options would silently be the checkpoint's (its
lr, its optimizer state) or the trajectory another one. These functions list the differences, so that the
library's :func:`mpicomm.restore` and the apps' ``--resume`` refuse with every one of them named.

Pure: no MPI, no files.
"""

from __future__ import annotations

import ast
import dataclasses
import json

from .meta import optimizer_settings, topology_kind

__all__ = ["plain", "settings_differences", "signature_mismatch"]


def plain(value):
    """``value`` with numpy scalars, arrays and tuples as Python numbers and lists (HDF5 returns numpy types)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def settings_differences(saved: dict, algo) -> list[tuple[str, object, object]]:
    """``(setting, now, the checkpoint's)`` for each recorded setting that ``algo`` has otherwise.

    Settings: ``topology`` (by its kind alone, ``ring``, for a checkpoint of another world size), each
    option of the algorithm's config (by its field name), ``optimizer`` (type
    and number of parameter groups) and ``optimizer group K <option>`` (each group's options but the lr,
    which the run's schedule sets). A setting the checkpoint did not record is not compared.
    """
    differ: list[tuple[str, object, object]] = []
    topology = saved.get("topology", {}).get("name")
    schedule = getattr(getattr(algo, "comm", None), "schedule", None)
    resized = saved.get("world_size") is not None and getattr(algo.comm, "size", None) != saved.get("world_size")
    if topology is not None and schedule is not None and str(topology) != schedule.name and \
            not (resized and topology_kind(topology) == topology_kind(schedule.name)):
        differ.append(("topology", schedule.name, str(topology)))
    then = plain(dict(saved.get("algorithm", {}).get("config", {})))
    now = plain(dataclasses.asdict(algo.config))
    differ += [(key, now[key], then[key]) for key in sorted(set(then) & set(now)) if then[key] != now[key]]
    stored = saved.get("optimizer")
    if stored is None:
        return differ
    old, new = json.loads(str(stored)), json.loads(optimizer_settings(getattr(algo, "optimizer", None)))
    old_groups, new_groups = old.get("groups", []), new.get("groups", [])
    if old.get("type") != new.get("type") or len(old_groups) != len(new_groups):
        differ.append(("optimizer", f"{new.get('type')} over {len(new_groups)} parameter group(s)",
                       f"{old.get('type')} over {len(old_groups)}"))
        return differ
    for index, (a, b) in enumerate(zip(old_groups, new_groups)):
        differ += [(f"optimizer group {index} {key}", b.get(key), a.get(key))
                   for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]
    return differ


def signature_mismatch(stored: str, current: str) -> str:
    """How the checkpoint's model differs from this one: the first parameter that differs, or ``""``.

    Signatures are ``repr((numel, ((name, shape), ...)))`` (:meth:`mpicomm.flat.FlatParameters.signature`).
    """
    if stored == current:
        return ""
    try:
        have, want = ast.literal_eval(stored)[1], ast.literal_eval(current)[1]
    except (ValueError, SyntaxError, TypeError, IndexError):
        return "its model differs from this job's"
    for index, (a, b) in enumerate(zip(have, want)):
        if tuple(a) != tuple(b):
            return (f"its model differs at parameter {index}: the checkpoint has {a[0]} of shape {tuple(a[1])}, "
                    f"this job's model has {b[0]} of shape {tuple(b[1])}")
    return f"its model has {len(have)} parameter tensors, this job's model has {len(want)}"
