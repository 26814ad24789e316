"""Resuming a run: which checkpoint ``--resume`` means, what it restores, and one clear error if it can't.

``--resume latest`` continues from the newest checkpoint in ``--out-dir`` and starts fresh (saying so)
when there is none yet, so a job script can always pass it (the SLURM templates do). ``--resume PATH``
takes a checkpoint directory, its ``checkpoint.h5``, a run directory, or a ``step-N`` name inside
``--out-dir``; that one must exist.

A checkpoint that cannot be used — missing, truncated or corrupted files, another world size,
algorithm, topology or model — is refused with one error that every rank raises alike (the app prints
it once and exits 2). For a damaged checkpoint it names the newest earlier one that loads intact.

A run resumes with the settings it was saved with, or not at all: when the algorithm's options
(``--lr``, ``--momentum``, ``--weight-decay``, the method's own) or the optimizer's parameter groups
(``--no-decay-bias-norm``, their weight decay and momentum) differ from the checkpoint's, the resume is
refused with one line listing each difference — a checkpoint's optimizer state would otherwise silently
override the options given, and the run would record values it does not use.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, map_location
from ..checkpoint.rng import restore_rng_state
from ..checkpoint.store import optimizer_settings
from ..checkpoint.tree import CheckpointError
from ..errors import agreed_of, mark_agreed

__all__ = ["Resumed", "resolve_resume", "restore_run"]

@dataclass
class Resumed:
    """Where a resumed run continues: the checkpoint, the data position and the run's counters."""

    path: Path
    step: int
    epoch: int
    batch: int
    counters: dict = field(default_factory=dict)


def resolve_resume(resume: str, out_dir: str) -> Path | None:
    """The checkpoint ``--resume`` names (None: ``latest`` with none saved yet); raises for a missing PATH.

    ``step-7`` (or ``7``) inside ``--out-dir`` means ``step-000000007``.
    """
    if resume == "latest":
        return latest_checkpoint(out_dir)
    path = Path(resume)
    if not path.exists() and out_dir:
        short = re.fullmatch(r"(?:step-)?(\d+)", resume)
        for name in (resume, f"step-{int(short.group(1)):09d}" if short else None):
            if name and (Path(out_dir) / name).exists():
                return Path(out_dir) / name
    return path


def restore_run(path: Path, algo, expect: dict, meta: dict, precision) -> Resumed:
    """Collective: load ``path`` into ``algo`` (the model's buffers, every RNG, the loss scale); where to go on.

    Tensors land on the device of ``algo``'s parameters, whatever device wrote them. ``expect`` is checked
    against the checkpoint's meta; ``meta`` (this run's :func:`~mpicomm.checkpoint.run_meta`) is compared
    separately so that a different model names the first parameter that differs, and different settings
    are listed one by one.
    """
    try:
        state, saved = load_checkpoint(path, algo.comm, expect=expect)
    except Exception as exc:
        mark = agreed_of(exc)
        if mark is None:
            raise
        damaged = isinstance(exc, CheckpointError) and Path(path).exists()
        raise _refusal(path, mark.message, algo, expect, damaged) from exc
    problem = _signature_mismatch(str(saved.get("model_signature", "")), meta["model_signature"]) or \
        _settings_mismatch(saved, algo)
    if problem:
        raise _refusal(path, problem, algo, expect, damaged=False)
    device = algo.flat.data.device
    state = map_location(state, device)
    algo.load_state_dict(state["algorithm"])
    _load_buffers(algo.model, state["buffers"])
    restore_rng_state(state["rng"], device)
    precision.load_state_dict(state.get("precision", {}))
    position = state["position"]
    return Resumed(Path(path), *(int(position[k]) for k in ("step", "epoch", "batch")),
                   counters=state.get("counters", {}))


def _refusal(path: Path, why: str, algo, expect: dict, damaged: bool) -> CheckpointError:
    """The agreed error for an unusable checkpoint, naming an intact earlier one when ``path`` is damaged."""
    hint = ""
    if damaged:
        intact = _newest_intact_before(Path(path), algo, expect)
        hint = (f"; the earlier checkpoint {intact.name} is intact: --resume {intact}" if intact else
                "; no earlier checkpoint is intact")
    exc = CheckpointError(f"cannot resume from {path}: {why}{hint}")
    size = algo.comm.size
    return mark_agreed(exc, str(exc), range(size), size)


def _newest_intact_before(path: Path, algo, expect: dict) -> Path | None:
    """Collective: the newest checkpoint older than ``path`` in its run directory that loads cleanly."""
    directory = path.parent if path.is_file() else path
    root = directory.parent if directory.name.startswith("step-") else directory
    older = [p for p in list_checkpoints(root) if p.resolve() != directory.resolve()]
    if directory.name.startswith("step-"):
        older = [p for p in older if p.name < directory.name]
    for candidate in reversed(older[-3:]):
        try:
            load_checkpoint(candidate, algo.comm, expect=expect)
            return candidate
        except Exception as exc:
            if agreed_of(exc) is None:
                raise
    return None


def _signature_mismatch(stored: str, current: str) -> str:
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


def _plain(value):
    """``value`` with numpy scalars, arrays and tuples as Python numbers and lists (HDF5 returns numpy types)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _settings_mismatch(saved: dict, algo) -> str:
    """What of the algorithm's options and the optimizer's groups differs from the checkpoint's, or ``""``."""
    differ = []
    then = _plain(dict(saved.get("algorithm", {}).get("config", {})))
    now = _plain(dataclasses.asdict(algo.config))
    for key in sorted(set(then) & set(now)):
        if then[key] != now[key]:
            differ.append(f"--{key.replace('_', '-')} {now[key]!r} (the checkpoint's: {then[key]!r})")
    stored = saved.get("optimizer")
    if stored is not None:
        old, new = json.loads(str(stored)), json.loads(optimizer_settings(getattr(algo, "optimizer", None)))
        if old.get("type") != new.get("type") or len(old.get("groups", [])) != len(new.get("groups", [])):
            differ.append(f"the optimizer {new.get('type')} over {len(new.get('groups', []))} parameter group(s) "
                          f"(the checkpoint's: {old.get('type')} over {len(old.get('groups', []))}; "
                          "--no-decay-bias-norm makes two)")
        else:
            for index, (a, b) in enumerate(zip(old.get("groups", []), new.get("groups", []))):
                for key in sorted(set(a) | set(b)):
                    if a.get(key) != b.get(key):
                        differ.append(f"optimizer group {index} {key} {b.get(key)!r} "
                                      f"(the checkpoint's: {a.get(key)!r})")
    if not differ:
        return ""
    return ("this run's settings differ from those it was saved with: " + ", ".join(differ) +
            "; resume with the same options, or start a new run in another --out-dir")


def _load_buffers(model: torch.nn.Module, saved: dict) -> None:
    """Copy checkpointed buffers (BatchNorm running statistics) into ``model``."""
    buffers = dict(model.named_buffers())
    if set(buffers) != set(saved):
        raise ValueError(f"checkpoint buffers {sorted(saved)} do not match the model's {sorted(buffers)}")
    for name, value in saved.items():
        buffers[name].copy_(value)
