"""Resume at another world size: every registered method's rule checked on the reloaded state, and training goes on.

``tests/resize_job.py`` saves every method at 4 ranks, then resumes each at 2, 3 and 6, and the 2-rank run's
own checkpoint at 4, in one 6-rank ``mpiexec`` whose first N ranks form each world of N ranks in turn; rank 0
reports every new rank's state as built at the new size and as restored. The saved states are read from the
checkpoints with plain h5py (``tests/h5_state.py``), not through ``mpicomm.checkpoint``, and each entry is
checked against the rule docs/checkpoints.md states, written out in ``tests/resize_expect.py``:

* an entry identical on every saved rank is carried bit for bit (a centralized method's parameters and
  optimizer state, PowerSGD's Q, the DiLoCo family's global copy and outer optimizer, Moniqua's agreed theta
  bounds and guard scales, step counters);
* every error-feedback residual (``extra.error``; the 1-bit family's worker errors over the model's d
  elements) is the mean over the saved ranks on every new rank, so its mean over the new ranks is the saved
  mean (relative 1e-6): what the next steps still owe the model. Keeping the sum fails this;
* the 1-bit family's server errors: the saved chunks in rank order are the whole vector, and new rank r holds
  chunk r of it at the new chunk size, zero-padded;
* a decentralized method restarts from consensus: parameters, momenta and optimizer state are the saved
  replicas' average; CHOCO's, DCD's and CPD-SGDM's public copies are the new replica; D²'s previous step and
  PowerGossip's per-edge Q are as built at the new size;
* the DiLoCo family's inner models and inner optimizer state are averaged; Streaming DiLoCo's fragments in
  flight (pending, outer gradient) are saved rank 0's;
* a per-rank generator or codec seed is old rank r's on new rank r < N and as built on the others;
* a method that cannot resize (Moniqua on AD-PSGD) refuses in one line naming the method and the reason;
* every method that resizes continues at the new size and the averaged model's loss goes down.

The 2-rank checkpoint is the one the 2-rank job saves after training on from the 4-rank one.

Plus, without a job: a misspelled rule path fails when the method is built; the mean rule on a hand-computed
case (2 saved ranks resumed at 1); and the app: ``apps/train_resnet.py`` saved at 2 ranks and ``--resume
latest`` at 3 records a ``resize`` event and trains on.
"""

import copy
import fcntl
import os
import signal
import subprocess
import sys

import pytest
import torch

from mpicomm import topology
from mpicomm.algorithms import make_algorithm, registry
from mpicomm.algorithms.registry import ALGORITHMS

from . import resize_expect as expect
from .algo_common import make_model
from .app_runs import RESNET, launch, mpiexec, strict_records
from .h5_state import saved_states

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "resize_job.py")
PAIRS = [(4, 2), (4, 3), (4, 6), (2, 4)]
JOB_LIMIT = 840  # s, only to catch a hang: the job takes minutes on a loaded machine


def _launch(n: int, *args) -> None:
    """``mpiexec -n n python -m mpi4py tests/resize_job.py args...`` (its own process group, ended whole if it
    outlasts :data:`JOB_LIMIT`); fails the test with its output otherwise."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py", JOB, *map(str, args)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=JOB_LIMIT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the resize job was still running after {JOB_LIMIT} s: {err[-2000:]}")
    assert proc.returncode == 0, out[-2000:] + err[-4000:]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The job's directory and its reports by (saved size, new size): saved at 4, resumed at 2 (and saved there
    again after training on), 3 and 6; the 2-rank checkpoint resumed at 4. One job per pytest run: under
    pytest-xdist the workers share it (the first runs it, the others wait for it under a file lock)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's base directory, above each worker's
    root, failed = shared / "resize_job", shared / "resize_job.failed"
    with open(shared / "resize_job.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if failed.exists():
            pytest.fail("the resize job failed in another worker (see the first test that ran it)")
        if not (root / "done").exists():
            failed.touch()
            root.mkdir()
            _launch(6, root)
            (root / "done").touch()
            failed.unlink()
    reports = {}
    for old, new in PAIRS:
        reports[(old, new)] = torch.load(root / f"report{old}to{new}.pt")
        assert reports[(old, new)]["size"] == new
    return root, reports


def test_every_method_is_in_the_job():
    """The job resizes every registered method, and each belongs to one family of the rules."""
    from .resize_job import ALGOS

    assert sorted(ALGOS) == sorted(ALGORITHMS)
    families = [expect.CENTRALIZED, expect.DECENTRALIZED, expect.OUTER]
    assert all(sum(name in f for f in families) == 1 for name in ALGORITHMS), sorted(ALGORITHMS)


@pytest.mark.timeout(JOB_LIMIT + 60)  # the first test of each worker waits for the job
@pytest.mark.parametrize("pair", PAIRS, ids=[f"{a}to{b}" for a, b in PAIRS])
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_rule_holds_and_training_goes_on(job, pair, name):
    """The family's rule on the reloaded state of every new rank, against the saved states read with h5py;
    then the loss goes down at the new size. A method that cannot resize refuses in one line."""
    root, reports = job
    old, new = pair
    result = reports[pair]["results"][name]
    if name in expect.REFUSED:
        message = result.get("error", "")
        assert expect.REFUSED[name] in message and "\n" not in message, f"not a one-line refusal: {result}"
        assert len(message.partition(expect.REFUSED[name])[2]) > 20, f"no reason given: {message!r}"
        return
    assert "error" not in result, f"{name} {old} -> {new}: {result['error']}"
    saved = saved_states(root / f"saved{old}" / name)
    assert len(saved) == old and len(result["restored"]) == new
    expect.assert_state_exists(name, saved)
    expect.assert_family_agreement(name, saved)
    assert result["step"] == saved[0]["step"]
    problems = [p for rank, (fresh, restored) in enumerate(zip(result["fresh"], result["restored"]))
                for p in expect.rank_problems(name, saved, fresh, restored, rank, new)]
    if name in expect.RESIDUAL:
        try:
            expect.assert_residual_mean_kept(name, saved, result["restored"])
        except AssertionError as exc:
            problems.insert(0, " ".join(str(exc).split("\n")[:3]))
    if not result["after"] < result["before"]:
        problems.append(f"the loss went from {result['before']} to {result['after']} at the new size")
    assert not problems, f"{name} {old} -> {new}: " + "; ".join(problems[:6]) + f" ({len(problems)} in all)"


def _one_rank(name: str, model: torch.nn.Module, **options):
    """``name`` built alone (MPI_COMM_SELF) around ``model``."""
    from mpi4py import MPI

    from mpicomm.comm import Communicator

    return make_algorithm(name, model, Communicator(MPI.COMM_SELF, topology.ring(1)), **options)


def test_misspelled_rule_path_fails_at_construction(monkeypatch):
    """A rule whose path names no entry of the state (``extra.eror`` for ``extra.error``) would never apply:
    building the method raises a ValueError naming the path."""
    base = ALGORITHMS["ef_signsgd"]

    class Misspelled(base):
        """EF-SignSGD with a rule for an entry it does not have."""

        def _resize_rules(self):
            return {**super()._resize_rules(), "extra.eror": lambda *args: None}

    _one_rank("ef_signsgd", make_model(0)).close()  # the method itself builds
    monkeypatch.setitem(registry.ALGORITHMS, "ef_signsgd", Misspelled)
    with pytest.raises(ValueError, match=r"extra\.eror"):
        _one_rank("ef_signsgd", make_model(0))


def test_residual_mean_on_a_hand_computed_case():
    """Two saved ranks with residuals (3, 0, 3) and (0, 6, -1) resumed at 1: the new rank's residual is their mean
    (1.5, 3, 1), not the sum (3, 6, 2) kept; the agreed parameters are carried."""
    algo = _one_rank("ef_signsgd", torch.nn.Linear(2, 1))
    try:
        base = algo.state_dict()
        assert base["extra"]["error"].shape == (3,)
        saved = []
        for error in ([3.0, 0.0, 3.0], [0.0, 6.0, -1.0]):
            state = copy.deepcopy(base)
            state["extra"]["error"] = torch.tensor(error)
            saved.append(state)
        new = algo.reshard_state(saved)
    finally:
        algo.close()
    assert torch.equal(new["extra"]["error"], torch.tensor([1.5, 3.0, 1.0]))
    assert torch.equal(new["params"], base["params"])


def test_app_resumes_at_another_size(tmp_path):
    """apps/train_resnet.py saved at 2 ranks continues at 3 with ``--resume latest``: a ``resize`` event, then on
    to the end, with the learning rate scaled by 3/2 (``--lr-scaling linear``)."""
    args = [*RESNET, "--max-steps", "6", "--out-dir", str(tmp_path), "--lr", "0.08", "--lr-schedule", "constant",
            "--lr-scaling", "linear"]
    first = launch(2, "train_resnet.py", [*args, "--stop-at-step", "3"])
    assert first.returncode == 128 + 10, first.stderr[-3000:]  # SIGUSR1 outside a requeueing job
    second = launch(3, "train_resnet.py", [*args, "--resume", "latest"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert "(saved at 2 ranks, continued at 3)" in second.stdout
    records = strict_records(tmp_path / "metrics.jsonl")
    events = [r for r in records if r["event"] == "resize"]
    assert len(events) == 1 and (events[0]["old_size"], events[0]["new_size"], events[0]["step"]) == (2, 3, 3)
    assert records[-1]["event"] == "end" and records[-1]["step"] == 6 and records[-1]["stopped_by_signal"] == 0
    steps = [r["step"] for r in records[records.index(events[0]):] if r["event"] == "train"]
    assert steps == [4, 5, 6]
    lrs = {r["step"]: r["lr"] for r in records if r["event"] == "train"}
    assert events[0]["lr_factor"] == 1.5 and "learning rate x 1.5" in second.stdout, second.stdout[-2000:]
    assert [lrs[s] for s in range(1, 7)] == pytest.approx([0.08] * 3 + [0.12] * 3, rel=1e-12), lrs
