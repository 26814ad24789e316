"""Where fetched datasets live, for every app: one folder, shared by the nodes of a cluster."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """``$MPICOMM_DATA_DIR``, else ``~/.cache/mpicomm/data`` (a home folder every node of a cluster sees)."""
    return Path(os.environ.get("MPICOMM_DATA_DIR") or Path.home() / ".cache" / "mpicomm" / "data")
