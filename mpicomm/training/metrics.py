"""Metrics as JSON lines: one object per logged step or evaluation, written by rank 0 only."""

from __future__ import annotations

import json
import math
import os

__all__ = ["MetricsWriter", "continued", "read_metrics"]


class MetricsWriter:
    """Append JSON lines to ``path`` (flushed per line) when ``enabled``; a no-op on other ranks.

    ``mirror`` (e.g. :class:`.tensorboard.ScalarMirror`) also receives every record written, as written.
    A write that fails (a full disk) never raises here: the writer stops writing and keeps the reason in
    ``problem`` (starting with :attr:`PROBLEM`), which the training loop has every rank agree on.
    """

    PROBLEM = "could not write the metrics"

    def __init__(self, path: str | None, enabled: bool, append: bool = False, mirror=None):
        self.path = path if enabled else None
        self._file = None
        self.mirror = mirror if enabled else None
        self.problem = ""
        if self.path:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                self._file = open(self.path, "a" if append else "w")
            except OSError as exc:
                self._fail(self.path, exc)

    def _fail(self, where: str, exc: OSError) -> None:
        if not self.problem:
            self.problem = f"{self.PROBLEM} to {where}: {exc.strerror or exc}"
        self.close()

    def write(self, record: dict) -> None:
        """Write one record (a non-finite number becomes ``null``: the file stays valid JSON)."""
        line = json.dumps(_finite(record), sort_keys=True, allow_nan=False) + "\n"
        if self._file is not None:
            try:
                self._file.write(line)
                self._file.flush()
            except OSError as exc:
                self._fail(self.path, exc)
        if self.mirror is not None:
            try:
                self.mirror.write(_finite(record))
            except OSError as exc:
                self._fail("the TensorBoard directory", exc)

    def close(self) -> None:
        """Close the file (and the mirror); a failure to flush on close is only recorded."""
        file, mirror, self._file, self.mirror = self._file, self.mirror, None, None
        for closing in (file, mirror):
            if closing is not None:
                try:
                    closing.close()
                except OSError as exc:
                    self.problem = self.problem or f"{self.PROBLEM}: {exc.strerror or exc}"


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
    """All records of a metrics file, in order; a line that is not JSON is a ``ValueError`` naming file and line."""
    out = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except ValueError as exc:
                raise ValueError(f"{path}, line {number}: not a JSON record ({exc}): {line.strip()[:80]!r}") from None
    return out


def continued(records: list[dict]) -> list[dict]:
    """The records of a run as it went on: what a later ``resume`` or ``start`` superseded is dropped.

    A run killed after its checkpoint at step N logged steps past N that the resumed run repeats; the
    resume event (step N), and the start record that follows it, drop the earlier records of steps beyond
    N, so curves go forward only. A run restarted from step 0 (``--resume latest`` before any checkpoint)
    supersedes everything its earlier attempt logged.
    """
    out: list[dict] = []
    for record in records:
        if record.get("event") in ("resume", "start"):
            out = [r for r in out if r.get("step", 0) <= record.get("step", 0) or r.get("event") == "start"]
        out.append(record)
    return out
