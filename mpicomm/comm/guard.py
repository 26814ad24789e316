"""The hang guard: a rank stuck in a collective becomes one line and an exit, never a silent hang.

Every blocking wait the :class:`~mpicomm.comm.Communicator` makes (a collective, a non-blocking
operation's ``wait()``, the control plane's agreements) runs inside :meth:`WaitGuard.waiting`, which
records what is waited on and since when. A daemon thread (mpi4py releases the GIL while MPI blocks)
looks at that record twice a second and ends the rank in two cases:

* the wait has lasted ``timeout_s`` (``--hang-timeout``, default 600 s; ``MPICOMM_HANG_TIMEOUT`` for
  library use; 0: never): some rank is not taking part. One line names the collective, what the run was
  doing and the step; then ``MPI_Abort`` ends every rank with :data:`EXIT_HUNG`. Under ``--on-rank-loss
  continue``/``replace`` the wait may last twice that, and a rank that spent ``timeout_s`` inside a step without
  reaching MPI (the stalled one) leaves the job instead (it kills itself): the others recover without it.
* a stop signal (SIGTERM, SIGUSR1) arrived and the rank is still blocked in a wait the grace period
  after it — 10 s (``MPICOMM_SIGNAL_GRACE``) or twice the longest step so far, whichever is longer,
  so that slower peers can still reach the agreement: the ranks cannot agree to stop and checkpoint,
  so the rank exits with 128 + the signal number instead of burning a batch allocation. Once the
  ranks have agreed to stop (:meth:`WaitGuard.signal_handled`), the waits of the stop's checkpoint are
  the training loop's, however long they take.

The signal reaches the thread through ``signal.set_wakeup_fd`` (:meth:`WaitGuard.watch_signals`, which
the training loop's stop handler calls): Python runs signal handlers only in the main thread, between
bytecodes, so a handler never runs while the main thread is inside an MPI call.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time

__all__ = ["DEFAULT_HANG_TIMEOUT_S", "EXIT_HUNG", "SIGNAL_GRACE_S", "WaitGuard", "hang_timeout_from_env",
           "process_guard", "signal_grace_from_env"]

EXIT_HUNG = 4
DEFAULT_HANG_TIMEOUT_S = 600.0
SIGNAL_GRACE_S = 10.0
_TICK_S = 0.5
_FORWARD_S = 1.0
"""Seconds between the hang message and ``MPI_Abort``: the launcher forwards a rank's stderr asynchronously and
the abort tears the job down at once, which lost the line on a loaded machine."""


def _seconds_from_env(name: str, default: float) -> float:
    """Environment variable ``name`` in seconds, else ``default``; a bad value is a clear error."""
    text = os.environ.get(name, "")
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{name} must be a number of seconds >= 0, got {text!r}")
    return value


def hang_timeout_from_env(default: float = DEFAULT_HANG_TIMEOUT_S) -> float:
    """``MPICOMM_HANG_TIMEOUT`` in seconds (0: off), else ``default``."""
    return _seconds_from_env("MPICOMM_HANG_TIMEOUT", default)


def signal_grace_from_env(default: float = SIGNAL_GRACE_S) -> float:
    """``MPICOMM_SIGNAL_GRACE`` in seconds, else ``default``."""
    return _seconds_from_env("MPICOMM_SIGNAL_GRACE", default)


class WaitGuard:
    """Watches this process's blocking waits; see the module docstring. One per process (:func:`process_guard`)."""

    def __init__(self, abort):
        self._abort = abort  # abort(code): end every rank (MPI_Abort on the world)
        self.rank = 0
        self.timeout_s = hang_timeout_from_env()
        self.signal_grace_s = signal_grace_from_env()
        self._step: int | None = None
        self._step_began = 0.0
        self.longest_step_s = 0.0
        self.activity = ""
        self._wait: tuple[str, float] | None = None
        self._waited = 0.0  # when the last wait ended
        self.leave_when_stalled = False
        """Set under ``--on-rank-loss continue``/``replace`` (:class:`~mpicomm.comm.faults.Membership`): a rank
        that spends the hang timeout inside a step without reaching MPI leaves the job, and the others, which
        would end the job after twice that, continue without it."""
        self._signal: tuple[int, float] | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._reader: socket.socket | None = None
        self._writer: socket.socket | None = None
        self._previous_fd = -1

    # ------------------------------------------------------------------ what the main thread does
    @property
    def step(self) -> int | None:
        """The step the run is in (None: outside training), named by the hang message."""
        return self._step

    @step.setter
    def step(self, value: int | None) -> None:
        now = time.monotonic()
        if self._step is not None and value is not None:
            self.longest_step_s = max(self.longest_step_s, now - self._step_began)
        self._step, self._step_began = value, now

    def waiting(self, what: str, checked: bool = True) -> _Waiting:
        """Mark the body (``with guard.waiting(what):``) as a blocking wait on ``what`` (e.g. ``"allgather"``);
        nested marks keep the outer. ``checked``: run :attr:`after_wait` when it ends without an exception (not for
        the agreements that recover from a lost rank). A plain object, not a generator: every collective enters
        one, and a generator-based context manager cost several times as much per call."""
        return _Waiting(self, what, checked)

    @contextlib.contextmanager
    def doing(self, activity: str):
        """Name what the run is doing in the body (``"evaluation"``, ``"checkpoint"``), for the hang message."""
        previous, self.activity = self.activity, activity
        try:
            yield
        finally:
            self.activity = previous

    after_wait = None
    """Called after every completed wait, when set: :class:`~mpicomm.comm.faults.Membership` sets it to raise a lost
    rank that MPI knows of, so that data a collective completed without it is never used."""

    def signal_handled(self) -> None:
        """Every rank has agreed to stop on the signal: the waits that follow (the checkpoint) are the loop's."""
        self._signal = None

    def watch_signals(self) -> None:
        """Main thread: have stop signals also wake the guard's thread (``signal.set_wakeup_fd``)."""
        self._start()
        if self._previous_fd == -1:
            self._previous_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)

    def unwatch_signals(self) -> None:
        """Main thread: restore the wakeup descriptor :meth:`watch_signals` replaced."""
        if self._previous_fd != -1:
            signal.set_wakeup_fd(self._previous_fd)
            self._previous_fd = -1

    # ------------------------------------------------------------------ the thread
    def _start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._reader, self._writer = socket.socketpair()
            self._writer.setblocking(False)
            self._reader.settimeout(_TICK_S)
            self._thread = threading.Thread(target=self._watch, name="mpicomm-hang-guard", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        while True:
            try:
                data = self._reader.recv(64)
                if data and data[-1] in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
                    self._signal = (int(data[-1]), time.monotonic())
            except (socket.timeout, BlockingIOError, InterruptedError):
                pass
            except OSError:
                return
            self._check(time.monotonic())

    def _where(self, what: str) -> str:
        doing = f" ({self.activity})" if self.activity else ""
        if self.step is not None:
            step = f" at step {self.step}"
        else:  # outside an app's loop: the activity (a user loop's algo.step() call) says where, if anything
            step = "" if self.activity else " before training"
        return f"{what}{doing}{step}"

    def _check(self, now: float) -> None:
        wait, sig = self._wait, self._signal
        if wait is None:
            self._check_stalled(now)
            return
        what, since = wait
        grace = max(self.signal_grace_s, 2 * self.longest_step_s)
        if sig is not None and now - max(sig[1], since) >= grace:
            name = signal.Signals(sig[0]).name
            self._say(f"{name} arrived while this rank was waiting in {self._where(what)}; it cannot reach the "
                      f"point where the ranks agree to stop, so it ends now without a checkpoint "
                      f"(exit {128 + sig[0]})")
            os._exit(128 + sig[0])
        if self.timeout_s and now - since >= self.timeout_s * (2 if self.leave_when_stalled else 1):
            self._say(f"waited {now - since:.0f} s in {self._where(what)}: another rank is not taking part "
                      f"(it ended, crashed or waits elsewhere); aborting the job (exit {EXIT_HUNG}). "
                      f"If a step really takes this long, raise --hang-timeout (MPICOMM_HANG_TIMEOUT)")
            time.sleep(_FORWARD_S)
            self._abort(EXIT_HUNG)
            os._exit(EXIT_HUNG)

    def _check_stalled(self, now: float) -> None:
        """Under recovery, leave the job when this rank has been inside a step, outside MPI, for the hang timeout."""
        if not (self.leave_when_stalled and self.timeout_s and self._step is not None):
            return
        outside = now - max(self._step_began, self._waited)
        if outside >= self.timeout_s:
            # SIGKILL: Open MPI 5.0 told the others of a process that exited with a status only once it was killed
            self._say(f"spent {outside:.0f} s in {self._where('a step')} without reaching MPI: this rank leaves the "
                      "job (SIGKILL) so that the others continue without it")
            os.kill(os.getpid(), signal.SIGKILL)

    def _say(self, text: str) -> None:
        sys.stdout.flush()
        sys.stderr.write(f"mpicomm: rank {self.rank}: {text}\n")
        sys.stderr.flush()


class _Waiting:
    """The context manager :meth:`WaitGuard.waiting` returns."""

    __slots__ = ("_guard", "_what", "_checked", "_outer")

    def __init__(self, guard: WaitGuard, what: str, checked: bool):
        self._guard, self._what, self._checked, self._outer = guard, what, checked, False

    def __enter__(self) -> None:
        guard = self._guard
        if guard._wait is not None:  # nested: the outer wait is the one watched
            return
        if guard._thread is None:
            guard._start()
        self._outer = True
        guard._wait = (self._what, time.monotonic())

    def __exit__(self, kind, value, traceback) -> bool:
        if self._outer:
            guard = self._guard
            guard._wait = None
            guard._waited = time.monotonic()
            if kind is None and self._checked and guard.after_wait is not None:
                guard.after_wait()
        return False


_GUARD: WaitGuard | None = None


def process_guard(abort) -> WaitGuard:
    """This process's guard (created on first use with ``abort``, which ends every rank)."""
    global _GUARD
    if _GUARD is None:
        _GUARD = WaitGuard(abort)
    return _GUARD
