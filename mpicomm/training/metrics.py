"""Metrics as JSON lines: one object per logged step or evaluation, written by rank 0 only."""

from __future__ import annotations

import json
import os

__all__ = ["MetricsWriter", "read_metrics"]


class MetricsWriter:
    """Append JSON lines to ``path`` (flushed per line) when ``enabled``; a no-op on other ranks."""

    def __init__(self, path: str | None, enabled: bool, append: bool = False):
        self.path = path if enabled else None
        self._file = None
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._file = open(self.path, "a" if append else "w")

    def write(self, record: dict) -> None:
        """Write one record."""
        if self._file is not None:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()

    def close(self) -> None:
        """Close the file."""
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str) -> list[dict]:
    """All records of a metrics file, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
