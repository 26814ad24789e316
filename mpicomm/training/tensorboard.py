"""``--tensorboard DIR``: the metrics records mirrored as TensorBoard scalars (``metrics.jsonl`` stays the truth).

Every number of every record that has a step (train windows, evaluations, the start and end records)
becomes the scalar ``<event>/<key>`` at that step (``train/loss``, ``eval/test_accuracy``,
``end/bytes_sent``); nested values, strings and booleans are left to the JSON lines. Written by rank 0
only, through ``torch.utils.tensorboard``, which needs the optional ``tensorboard`` package (the
``tensorboard`` extra). A resumed run opens the writer with ``purge_step`` one past the checkpoint's
step, so TensorBoard drops what the stopped run logged after it, as :func:`.metrics.continued` does.
"""

from __future__ import annotations

import numbers

__all__ = ["ScalarMirror", "require_tensorboard"]

MISSING = ("--tensorboard needs the tensorboard package, which is not installed: "
           "pip install 'mpicomm[tensorboard]' (or pip install tensorboard)")


def require_tensorboard():
    """torch's ``SummaryWriter`` class, or a ``ValueError`` saying which extra to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ValueError(MISSING) from exc
    return SummaryWriter


class ScalarMirror:
    """Write the numbers of metrics records to a TensorBoard event file in ``logdir``."""

    def __init__(self, logdir: str, purge_step: int | None = None):
        self.writer = require_tensorboard()(log_dir=logdir, purge_step=purge_step)

    def write(self, record: dict) -> None:
        """Add ``record``'s numbers as ``<event>/<key>`` scalars at its step (records without a step are skipped)."""
        step, event = record.get("step"), record.get("event", "record")
        if not isinstance(step, int):
            return
        for key, value in record.items():
            if key != "step" and isinstance(value, numbers.Real) and not isinstance(value, bool):
                self.writer.add_scalar(f"{event}/{key}", value, global_step=step)
        if event != "train":
            self.writer.flush()  # evaluations and the end are rare: visible at once

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()
