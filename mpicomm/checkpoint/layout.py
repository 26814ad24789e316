"""A checkpoint root on disk: the names of its files, which checkpoints it holds, pruning and setting aside.

Layout under a root directory (see docs/checkpoints.md)::

    ROOT/latest                      "step-000000123": the last committed checkpoint
    ROOT/step-000000123/checkpoint.h5   rank 0: /meta (world size, step, time, versions, caller's meta),
                                     /ranks/00000 -> ExternalLink("rank-00000.h5", "/ranks/00000"), ...
    ROOT/step-000000123/rank-00000.h5   rank 0's state under /ranks/00000, written by rank 0

Only complete checkpoints count: a ``step-*`` directory holding ``checkpoint.h5``. The leftovers of a save
or a prune that died (``.tmp-step-*``, ``.trash-step-*``) are ignored here and removed by the next save.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

__all__ = ["FORMAT", "IDENTITY", "INDEX", "LATEST", "latest_checkpoint", "list_checkpoints", "prune",
           "rank_group", "rank_name", "set_aside_after", "step_name"]

INDEX = "checkpoint.h5"
LATEST = "latest"
FORMAT = "mpicomm-checkpoint/1"
IDENTITY = ("rank", "world_size", "step", "save_id")
"""What every rank file records of the save it belongs to (``mpicomm_<key>`` attributes), checked on reading."""
_STEP_DIR = re.compile(r"step-(\d{9,})")


def step_name(step: int) -> str:
    """The directory name of the checkpoint of ``step``."""
    return f"step-{step:09d}"


def rank_name(rank: int) -> str:
    """The file name of ``rank``'s state inside a checkpoint directory."""
    return f"rank-{rank:05d}.h5"


def rank_group(rank: int) -> str:
    """Where a rank's state lives, the same path in its own file and in checkpoint.h5."""
    return f"/ranks/{rank:05d}"


def list_checkpoints(root) -> list[Path]:
    """Complete checkpoints (``step-*`` directories holding ``checkpoint.h5``) under ``root``, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.fullmatch(p.name) and (p / INDEX).is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def set_aside_after(root, step: int) -> list[Path]:
    """Rename the complete checkpoints of ``root`` past ``step`` to ``superseded-step-…`` (never deleted); return them.

    A run resumed from an earlier checkpoint re-trains the steps after it: its own later checkpoints would
    collide with those names. Renamed, they stay on disk (``list_checkpoints`` no longer sees them).
    """
    moved = []
    for path in list_checkpoints(root):
        if int(path.name[5:]) > step:
            target = path.with_name(f"superseded-{path.name}")
            suffix = 1
            while target.exists():
                target, suffix = path.with_name(f"superseded-{path.name}.{suffix}"), suffix + 1
            os.rename(path, target)
            moved.append(target)
    return moved


def latest_checkpoint(root) -> Path | None:
    """The checkpoint ``root/latest`` names (else the newest complete one), or None if there is none."""
    root = Path(root)
    try:
        name = (root / LATEST).read_text().strip()
    except FileNotFoundError:
        name = ""
    if _STEP_DIR.fullmatch(name) and (root / name / INDEX).is_file():
        return root / name
    found = list_checkpoints(root)
    return found[-1] if found else None


def prune(root: Path, keep_last: int, keep: Path) -> None:
    """Remove all but the newest ``keep_last`` complete checkpoints, never ``keep`` (each renamed away first)."""
    others = [p for p in list_checkpoints(root) if p != keep]
    for old in others[: max(0, len(others) - (keep_last - 1))]:
        trash = root / f".trash-{old.name}"
        os.rename(old, trash)
        shutil.rmtree(trash)
