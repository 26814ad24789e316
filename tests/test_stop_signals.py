"""A second stop signal after the stop's checkpoint changes nothing: the job still exits 128 + N, cleanly.

``scancel`` twice, or Ctrl-C pressed again while a stopping job writes its checkpoint, must not find the
handlers restored to the default and kill the ranks mid-exit (exit 10/15 with MPICH's "BAD TERMINATION"
banner): the stop keeps ignoring further signals until the process exits.

Each run is its own ``mpiexec``, not one of a batch (``run_apps``): the test signals the job from outside,
and what it checks is how the processes exit.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from .app_runs import REPO, RESNET, mpiexec


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_second_signal_after_the_stop_checkpoint_exits_cleanly(tmp_path, sig):
    args = list(RESNET)
    args[args.index("--max-steps") + 1] = "400"  # far more than the run gets to do
    proc = subprocess.Popen([mpiexec(), "-n", "2", sys.executable, os.path.join(REPO, "apps", "train_resnet.py"),
                             *args, "--algorithm", "dpsgd", "--out-dir", str(tmp_path)],
                            cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and '"event": "train"' in metrics.read_text()):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no training step within 120 s"
            time.sleep(0.1)
        proc.send_signal(sig)
        for line in proc.stdout:  # the stop's checkpoint is committed, the ranks are on their way out
            if "stopped by" in line:
                break
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig, err[-2000:]
    assert "BAD TERMINATION" not in out + err, (out + err)[-2000:]
    assert (tmp_path / "latest").is_file()
