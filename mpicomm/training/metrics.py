"""Metrics as JSON lines: one object per logged step or evaluation, written by rank 0 only."""

from __future__ import annotations

import json
import math
import os

__all__ = ["MetricsWriter", "continued", "read_metrics"]


class MetricsWriter:
    """Append JSON lines to ``path`` (flushed per line) when ``enabled``; a no-op on other ranks.

    ``mirror`` (e.g. :class:`.tensorboard.ScalarMirror`) also receives every record written, as written.
    """

    def __init__(self, path: str | None, enabled: bool, append: bool = False, mirror=None):
        self.path = path if enabled else None
        self._file = None
        self.mirror = mirror if enabled else None
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._file = open(self.path, "a" if append else "w")

    def write(self, record: dict) -> None:
        """Write one record (a non-finite number becomes ``null``: the file stays valid JSON)."""
        if self._file is not None:
            self._file.write(json.dumps(_finite(record), sort_keys=True, allow_nan=False) + "\n")
            self._file.flush()
        if self.mirror is not None:
            self.mirror.write(_finite(record))

    def close(self) -> None:
        """Close the file (and the mirror)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.mirror is not None:
            self.mirror.close()
            self.mirror = None


def _finite(value):
    """``value`` with every NaN or infinite float (nested in dicts and lists) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def read_metrics(path: str) -> list[dict]:
    """All records of a metrics file, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def continued(records: list[dict]) -> list[dict]:
    """The records of a run as it went on: what a ``resume`` event superseded is dropped.

    A run killed after its checkpoint at step N logged steps past N that the resumed run repeats; the
    resume event (step N) drops the earlier records of steps beyond N, so curves go forward only.
    """
    out: list[dict] = []
    for record in records:
        if record.get("event") == "resume":
            out = [r for r in out if r.get("step", 0) <= record["step"] or r.get("event") == "start"]
        out.append(record)
    return out
