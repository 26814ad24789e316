"""What a run shows on the terminal: whole lines, from rank 0 only, for messages every rank shares.

Every rank of a job runs the same code, so an error every rank agreed on, a warning or a progress note
would otherwise appear once per rank, interleaved mid-line. Here rank 0 writes each as one line
(``app: error: …``, ``app: warning: …``, ``app: …``) and the other ranks stay quiet. A rank's own error
that the others did not share (a crash) still reaches the terminal through the abort path, with its
rank. ``MPICOMM_ALL_RANKS_WARN=1`` lets every rank print its warnings (prefixed by its rank).

No MPI here: the rank comes from the caller, or before MPI starts from the launcher's environment.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings

from ..errors import one_line

__all__ = ["Console", "announce_start", "launcher_rank"]

_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")


def launcher_rank() -> int:
    """This process's rank as the launcher set it in the environment (0 when not launched by MPI)."""
    for name in _RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


class Console:
    """One line at a time, from rank 0: ``info`` to stdout, ``warning``/``error`` to stderr."""

    def __init__(self, app: str, rank: int | None = None):
        self.app = app
        self.rank = launcher_rank() if rank is None else rank

    def _write(self, stream, text: str) -> None:
        if self.rank != 0:
            return
        line = f"{self.app}: {one_line(text)}"
        try:  # above an active progress bar, not through it
            from tqdm import tqdm

            tqdm.write(line, file=stream)
        except ImportError:
            stream.write(line + "\n")
        stream.flush()

    def info(self, text: str) -> None:
        """A progress note (start-up, resume, checkpoint, stop)."""
        self._write(sys.stdout, text)

    def warning(self, text: str) -> None:
        """A warning every rank shares."""
        self._write(sys.stderr, f"warning: {text}")

    def error(self, text: str) -> None:
        """An error every rank shares (the job then exits non-zero on every rank)."""
        self._write(sys.stderr, f"error: {text}")

    @contextlib.contextmanager
    def quiet_unless_rank0(self):
        """Swallow what the body prints on ranks other than 0 (argparse's usage, errors and help)."""
        if self.rank == 0:
            yield
            return
        sink = io.StringIO()
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield

    def route_warnings(self) -> None:
        """Python warnings become one ``app: warning:`` line from rank 0 (each shown once per place)."""
        every_rank = os.environ.get("MPICOMM_ALL_RANKS_WARN") == "1"
        if self.rank != 0 and not every_rank:
            warnings.simplefilter("ignore")
            return

        def show(message, category, filename, lineno, file=None, line=None):
            where = f"rank {self.rank}: " if every_rank else ""
            self._write_any(f"warning: {where}{category.__name__}: {message}")

        warnings.showwarning = show

    def _write_any(self, text: str) -> None:
        """Write on this rank whatever its number (a warning each rank reports for itself)."""
        sys.stderr.write(f"{self.app}: {one_line(text)}\n")
        sys.stderr.flush()


def announce_start(app: str, doing: str) -> None:
    """Rank 0's first line, before the slow imports and set-up (not for ``--help``)."""
    if not {"-h", "--help"} & set(sys.argv[1:]):
        Console(app).info(f"starting: {doing} …")
