"""Metrics as JSON lines: one object per logged step or evaluation, written by rank 0 only.

Each record is appended whole, with one ``write`` of its complete line; a write that fails (a full disk)
is cut back off the file, so a metrics file never ends in a partial line the writer left. A line cut off
by a process killed mid-write (or by an earlier version's writer) is dropped when a run continues the
file (:func:`repair_metrics`), and ignored by :func:`read_metrics`.
"""

from __future__ import annotations

import json
import math
import os
import warnings

__all__ = ["MetricsWriter", "continued", "read_metrics", "repair_metrics"]


class MetricsWriter:
    """Append JSON lines to ``path`` (each line whole, written at once) when ``enabled``; a no-op on other ranks.

    ``append``: continue the file (a resumed run), after dropping a cut-off last line
    (:func:`repair_metrics`; a warning says so). ``mirror`` (e.g. :class:`.tensorboard.ScalarMirror`)
    also receives every record written, as written. A write that fails (a full disk) never raises here
    and leaves no partial line: the writer stops writing and keeps the reason in ``problem`` (starting
    with :attr:`PROBLEM`), which the training loop has every rank agree on.
    """

    PROBLEM = "could not write the metrics"

    def __init__(self, path: str | None, enabled: bool, append: bool = False, mirror=None):
        self.path = path if enabled else None
        self._fd: int | None = None
        self.mirror = mirror if enabled else None
        self.problem = ""
        if self.path:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                repaired = repair_metrics(self.path) if append else ""
                flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if append else os.O_TRUNC)
                self._fd = os.open(self.path, flags, 0o644)
            except OSError as exc:
                self._fail(self.path, exc)
            else:
                if repaired:
                    warnings.warn(repaired, stacklevel=2)

    def _fail(self, where: str, exc: OSError) -> None:
        if not self.problem:
            self.problem = f"{self.PROBLEM} to {where}: {exc.strerror or exc}"
        self.close()

    def write(self, record: dict) -> None:
        """Write one record (a non-finite number becomes ``null``: the file stays valid JSON)."""
        line = json.dumps(_finite(record), sort_keys=True, allow_nan=False) + "\n"
        if self._fd is not None:
            try:
                _append_whole(self._fd, line.encode("utf-8"))
            except OSError as exc:
                self._fail(self.path, exc)
        if self.mirror is not None:
            try:
                self.mirror.write(_finite(record))
            except OSError as exc:
                self._fail("the TensorBoard directory", exc)

    def close(self) -> None:
        """Close the file (and the mirror); a failure on closing is only recorded."""
        fd, mirror, self._fd, self.mirror = self._fd, self.mirror, None, None
        if fd is not None:
            self._closing(lambda: os.close(fd))
        if mirror is not None:
            self._closing(mirror.close)

    def _closing(self, close) -> None:
        """Run ``close``; an error is recorded in ``problem``, not raised."""
        try:
            close()
        except OSError as exc:
            self.problem = self.problem or f"{self.PROBLEM}: {exc.strerror or exc}"


def _append_whole(fd: int, data: bytes) -> None:
    """Append ``data`` to the file ``fd`` (opened ``O_APPEND``) whole or not at all.

    One ``write`` normally takes all of it; one cut short (the disk filled up mid-line) is continued, and
    if that fails the bytes already written are cut off again before the error is raised.
    """
    start = os.fstat(fd).st_size
    done = 0
    try:
        while done < len(data):
            done += os.write(fd, data[done:])
    except OSError:
        if done:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass  # left for repair_metrics
        raise


def repair_metrics(path: str) -> str:
    """Drop a cut-off last line of the metrics file ``path``: one that is not a JSON record ending in a newline.

    What an interrupted write leaves (a process killed mid-line, a full disk under an older writer);
    appended to, it would glue the next record onto it. Returns one line saying what was dropped, or
    "" when the file is missing, empty or ends whole.
    """
    try:
        with open(path, "rb+") as f:
            start, last = _last_line(f)
            if last.endswith(b"\n") and (not last.strip() or _is_record(last)):
                return ""
            f.truncate(start)
    except FileNotFoundError:
        return ""
    if not last:
        return ""
    return (f"{path}: dropped its last line, cut off by an interrupted write ({len(last)} bytes: "
            f"{last[:60].decode('utf-8', 'replace')!r}{'…' if len(last) > 60 else ''})")


def _last_line(f, block: int = 1 << 16) -> tuple[int, bytes]:
    """(offset, bytes) of the last line of the binary file ``f``, its newline included if it has one."""
    end = f.seek(0, os.SEEK_END)
    pos, tail = end, b""
    while pos > 0:
        step = min(block, pos)
        pos -= step
        f.seek(pos)
        tail = f.read(step) + tail
        cut = tail.rfind(b"\n", 0, len(tail) - 1)
        if cut >= 0:
            return pos + cut + 1, tail[cut + 1:]
    return 0, tail


def _is_record(line: bytes) -> bool:
    """Whether ``line`` is one JSON object."""
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


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
    """All records of a metrics file, in order; a line that is not JSON is a ``ValueError`` naming file and line.

    A last line without its newline that is not JSON (cut off by an interrupted write, see
    :func:`repair_metrics`) is left out.
    """
    out = []
    with open(path) as f:
        lines = f.readlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError as exc:
            if number == len(lines) and not line.endswith("\n"):
                break
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
