"""The apps never destroy a run and never answer a mistake with a traceback: one line, the same exit on every rank.

The apps' ``main`` runs in-process on every rank of the MPI tier (most cases only in the 2-rank tier, so
that each runs once with a peer). Covered: an output directory that holds another run (refused, its files
byte-identical afterwards; ``--overwrite``), a live and a stale lock, settings changed on resume (refused,
listing each), ``--no-decay-bias-norm`` on BERT's tied weights (trains, and resumes exactly), options that
once ended in tracebacks, a metrics file on a full disk, and ``--resume`` names and positions.
"""

import hashlib
import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest
from mpi4py import MPI

from mpicomm.training.metrics import read_metrics
from mpicomm.training.rundir import LOCK_NAME

from .app_runs import REPO
from .conftest import assert_all, mount_tmpfs

pytestmark = pytest.mark.mpi

RESNET = ["--model", "resnet20", "--batch-size", "8", "--eval-limit", "16", "--eval-bn-batches", "1", "--max-steps",
          "2", "--log-every", "1", "--no-progress", "--algorithm", "dpsgd", "--momentum", "0.9"]
CORPUS = "\n\n".join(f"Paragraph {i} holds words such as apple, river, stone and {i % 7} more lines of text here."
                     for i in range(200))
BERT = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "16", "--eval-sequences", "4", "--vocab-size", "200",
        "--log-every", "1", "--no-progress", "--lr", "1e-3", "--algorithm", "dpsgd", "--momentum", "0.9",
        "--weight-decay", "0.01"]
_APPS: dict = {}


def _main(app: str):
    if app not in _APPS:
        spec = importlib.util.spec_from_file_location(app[:-3], os.path.join(REPO, "apps", app))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _APPS[app] = module.main
    return _APPS[app]


def _run(comm, capsys, args: list[str], app: str = "train_resnet.py") -> tuple[int, list[str]]:
    """Run ``app`` on every rank; (the exit status, agreed on every rank, and rank 0's stderr lines)."""
    capsys.readouterr()
    code = _main(app)(args)
    codes = comm.allgather(code)
    assert_all(comm, len(set(codes)) == 1, f"exit statuses differ across ranks: {codes}")
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.strip()]


def _one_error(comm, lines: list[str], app: str = "train_resnet") -> str:
    """Rank 0's single error line (and nothing else on stderr); "" on the other ranks."""
    if comm.Get_rank() != 0:
        return ""
    assert len(lines) == 1 and lines[0].startswith(f"{app}: error: "), lines
    return lines[0]


def _only(comm, ranks: int):
    if comm.Get_size() != ranks:
        pytest.skip(f"runs once, in the {ranks}-rank tier")


def _shared(comm, factory, name: str) -> str:
    return comm.bcast(str(factory.mktemp(name)) if comm.Get_rank() == 0 else None)


def _digests(directory: str) -> dict:
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 2-step ResNet run (2 ranks) with checkpoints at steps 1 and 2."""
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        pytest.skip("runs once, in the 2-rank tier")
    out = _shared(comm, tmp_path_factory, "finished")
    assert_all(comm, _main("train_resnet.py")([*RESNET, "--out-dir", out, "--save-every", "1"]) == 0)
    return out


def test_a_fresh_run_into_a_directory_holding_a_run_is_refused_and_changes_nothing(comm, capsys, finished_run):
    """Exit 2, one line naming --resume latest and --overwrite, every earlier file byte-identical."""
    before = _digests(finished_run) if comm.Get_rank() == 0 else {}
    code, lines = _run(comm, capsys, [*RESNET, "--out-dir", finished_run, "--save-every", "1"])
    line = _one_error(comm, lines)
    assert_all(comm, code == 2, f"exit {code}")
    ok = comm.Get_rank() != 0 or (
        "already holds a run (metrics.jsonl, 2 checkpoint(s) up to step-000000002)" in line and
        "--resume latest" in line and "--overwrite" in line and _digests(finished_run) == before)
    assert_all(comm, ok, line)


def test_overwrite_deletes_the_earlier_run_and_starts_over(comm, capsys, tmp_path_factory):
    _only(comm, 2)
    out = _shared(comm, tmp_path_factory, "overwrite")
    first = _main("train_resnet.py")([*RESNET, "--out-dir", out, "--save-every", "1", "--max-steps", "3"])
    assert_all(comm, first == 0, f"exit {first}")
    code, _ = _run(comm, capsys, [*RESNET, "--out-dir", out, "--overwrite"])
    names = sorted(os.listdir(out)) if comm.Get_rank() == 0 else []
    starts = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if r["event"] == "start"] \
        if comm.Get_rank() == 0 else [{}]
    # the earlier run's checkpoints (steps 1..3) are gone; what is left is the new run's own end (step 2)
    ok = names == ["latest", "metrics.jsonl", "step-000000002"] and len(starts) == 1
    assert_all(comm, code == 0 and (comm.Get_rank() != 0 or ok), f"exit {code}, files {names}")


def _lock_holder(pid: int, host: str) -> str:
    return json.dumps({"host": host, "pid": pid, "pid_start": "", "slurm_job": "", "slurm_step": "",
                       "since": "2026-01-01T00:00:00"})


def test_a_live_lock_is_refused_and_a_stale_one_recovered(comm, capsys, tmp_path_factory):
    """A lock whose process runs (this test's) refuses the run; one whose process has ended is taken over."""
    _only(comm, 2)
    out = _shared(comm, tmp_path_factory, "locked")
    lock = os.path.join(out, LOCK_NAME)
    if comm.Get_rank() == 0:
        with open(lock, "w") as f:
            f.write(_lock_holder(os.getppid(), socket.gethostname()))  # the launcher's proxy: alive, not us
    code, lines = _run(comm, capsys, [*RESNET, "--out-dir", out])
    line = _one_error(comm, lines)
    assert_all(comm, code == 2 and (comm.Get_rank() != 0 or f"is in use by another run (pid {os.getppid()} on "
                                    in line), line)
    if comm.Get_rank() == 0:
        ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                               text=True, check=True)
        with open(lock, "w") as f:
            f.write(_lock_holder(int(ended.stdout), socket.gethostname()))
    code, _ = _run(comm, capsys, [*RESNET, "--out-dir", out])
    assert_all(comm, code == 0 and not os.path.exists(lock), f"exit {code}; the lock is left: {os.path.exists(lock)}")


def test_a_lock_of_the_same_slurm_job_step_is_its_earlier_life_and_is_recovered(comm, capsys, tmp_path_factory,
                                                                                 monkeypatch):
    """A requeued job restarts on any node with new pids: its own job and step id mark the lock stale."""
    _only(comm, 2)
    out = _shared(comm, tmp_path_factory, "requeued")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    if comm.Get_rank() == 0:
        with open(os.path.join(out, LOCK_NAME), "w") as f:
            f.write(json.dumps({"host": "another-node", "pid": 1, "slurm_job": "4242", "slurm_step": "0"}))
    code, lines = _run(comm, capsys, [*RESNET, "--out-dir", out])
    assert_all(comm, code == 0, f"exit {code}: {lines}")


def test_resuming_with_other_settings_is_refused_listing_each(comm, capsys, finished_run):
    """--momentum and --weight-decay changed: exit 2, both named with the checkpoint's values."""
    code, lines = _run(comm, capsys, [*RESNET, "--out-dir", finished_run, "--resume", "latest", "--max-steps", "4",
                                      "--momentum", "0.5", "--weight-decay", "0.001"])
    line = _one_error(comm, lines)
    ok = comm.Get_rank() != 0 or ("--momentum 0.5 (the checkpoint's: 0.9)" in line and
                                  "--weight-decay 0.001 (the checkpoint's: 0.0)" in line)
    assert_all(comm, code == 2 and ok, line)


def test_toggling_no_decay_bias_norm_on_resume_is_one_line(comm, capsys, finished_run):
    code, lines = _run(comm, capsys, [*RESNET, "--out-dir", finished_run, "--resume", "latest", "--max-steps", "4",
                                      "--no-decay-bias-norm"])
    line = _one_error(comm, lines)
    ok = comm.Get_rank() != 0 or "the optimizer SGD over 2 parameter group(s) (the checkpoint's: SGD over 1" in line
    assert_all(comm, code == 2 and ok, line)


def test_resume_names_a_short_step_and_refuses_a_position_past_the_run(comm, capsys, finished_run, tmp_path_factory):
    """``--resume step-1`` means step-000000001; a --max-steps below the checkpoint's step is refused in one line
    (for this cosine run as a changed length; a constant one: tests/test_app_resume_settings.py)."""
    out = _shared(comm, tmp_path_factory, "short-name")
    if comm.Get_rank() == 0:
        subprocess.run(["cp", "-r", finished_run + "/.", out], check=True)
    comm.Barrier()
    code, _ = _run(comm, capsys, [*RESNET, "--out-dir", out, "--resume", "step-1"])
    resumed = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if r["event"] == "resume"] \
        if comm.Get_rank() == 0 else [{"step": 1}]
    assert_all(comm, code == 0 and resumed[-1]["step"] == 1, f"exit {code}, resume events {resumed}")
    code, lines = _run(comm, capsys, [*RESNET, "--out-dir", out, "--resume", "latest", "--max-steps", "1"])
    line = _one_error(comm, lines)
    assert_all(comm, code == 2 and (comm.Get_rank() != 0 or "--max-steps 1 (the checkpoint's: 2)" in line), line)


def test_resuming_a_finished_run_reports_its_result(comm, capsys, finished_run):
    capsys.readouterr()
    code = _main("train_resnet.py")([*RESNET, "--out-dir", finished_run, "--resume", "latest"])
    out = capsys.readouterr().out
    ok = comm.Get_rank() != 0 or ("already finished at step 2" in out and "final test accuracy" in out)
    assert_all(comm, code == 0 and ok, out[-2000:])


@pytest.mark.parametrize("extra, message", [
    (["--accumulate", "100", "--max-steps", "0", "--epochs", "1"],
     "--accumulate 100 needs more batches than the run has"),
    (["--lr-warmup-steps", "2"], "--lr-warmup-steps 2 must be below the run's 2 steps"),
    (["--eval-limit", "-5"], "--eval-limit must be 0 (the whole test set) or a positive number of images, got -5"),
    (["--out-dir", "FILE"], "is a file, not a directory"),
    (["--tensorboard", "FILE"], "--tensorboard FILE is a file, not a directory"),
])
def test_mistakes_that_once_raised_tracebacks_are_one_line(comm, capsys, tmp_path_factory, extra, message):
    _only(comm, 2)
    where = _shared(comm, tmp_path_factory, "file")
    path = os.path.join(where, "FILE")
    if comm.Get_rank() == 0:
        open(path, "w").close()
    extra = [path if e == "FILE" else e for e in extra]
    code, lines = _run(comm, capsys, [*RESNET, *extra])
    line = _one_error(comm, lines)
    assert_all(comm, code == 2 and (comm.Get_rank() != 0 or message.replace("FILE", path) in line), line)


def test_a_topology_the_method_cannot_use_is_one_agreed_line(comm, capsys):
    """powergossip on the directed one-peer exponential graph (4 ranks): one line, not a traceback per rank."""
    _only(comm, 4)  # a power of two above 2: on 2 ranks the graph is symmetric
    code, lines = _run(comm, capsys, [*RESNET, "--algorithm", "powergossip", "--topology", "one_peer_exponential"])
    line = _one_error(comm, lines)
    assert_all(comm, code == 2 and (comm.Get_rank() != 0 or "powergossip needs a symmetric topology" in line), line)


def test_random_regular_topology_needs_no_degree(comm, capsys):
    _only(comm, 2)
    code, lines = _run(comm, capsys, [*RESNET, "--topology", "random_regular", "--max-steps", "1"])
    assert_all(comm, code == 0, f"exit {code}: {lines}")


def test_metrics_on_a_full_disk_stop_the_run_with_one_line(comm, capsys, tmp_path_factory):
    """A disk with room for the first records only: exit 3 and the reason, on every rank, no traceback."""
    _only(comm, 2)
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    disk = None
    if comm.Get_rank() == 0:
        disk = tmp_path_factory.mktemp("small") / "disk"
        mount_tmpfs(disk, "1m")
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        with open(disk / "filler", "wb") as f:
            f.write(b"\0" * (free - 8192))
    disk = comm.bcast(str(disk) if disk else None)
    try:
        code, lines = _run(comm, capsys, [*RESNET, "--out-dir", os.path.join(disk, "run"), "--max-steps", "40"])
        line = _one_error(comm, lines)
        ok = comm.Get_rank() != 0 or ("could not write the metrics to " in line and "No space left on device" in line)
        assert_all(comm, code == 3 and ok, line)
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            subprocess.run(["umount", "-l", disk], check=True)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small text file, so BERT's tokenizer trains in a moment."""
    comm, path = MPI.COMM_WORLD, None
    if comm.Get_rank() == 0:
        path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
        path.write_text(CORPUS)
    return comm.bcast(str(path) if path else None)


def test_bert_with_no_decay_bias_norm_trains_and_resumes_exactly(comm, capsys, tmp_path_factory, corpus):
    """BERT's decoder weight and bias are tied to the embeddings: listed once, 2 + 2 steps == 4 steps."""
    _only(comm, 2)
    args = [*BERT, "--data", corpus, "--no-decay-bias-norm", "--max-steps", "4", "--eval-every", "4"]
    straight, split = _shared(comm, tmp_path_factory, "straight"), _shared(comm, tmp_path_factory, "split")
    codes = [_run(comm, capsys, [*args, "--out-dir", straight], "train_bert.py")[0],
             _run(comm, capsys, [*args, "--out-dir", split, "--stop-at-step", "2"], "train_bert.py")[0],
             _run(comm, capsys, [*args, "--out-dir", split, "--resume", "latest"], "train_bert.py")[0]]

    def losses(out):
        records = read_metrics(os.path.join(out, "metrics.jsonl"))
        return {r["step"]: r["loss"] for r in records if r["event"] == "train"}, \
            [r["val_mlm_loss"] for r in records if r["event"] == "eval"][-1]

    ok = comm.Get_rank() != 0 or losses(straight) == losses(split)
    assert_all(comm, codes == [0, 128 + 10, 0] and ok, f"exits {codes}")


def test_binary_bert_text_is_refused(comm, capsys, tmp_path_factory):
    _only(comm, 2)
    where = _shared(comm, tmp_path_factory, "binary")
    if comm.Get_rank() == 0:
        with open(os.path.join(where, "data.txt"), "wb") as f:
            f.write(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 8)
    code, lines = _run(comm, capsys, [*BERT, "--data", os.path.join(where, "data.txt")], "train_bert.py")
    line = _one_error(comm, lines, "train_bert")
    assert_all(comm, code == 2 and (comm.Get_rank() != 0 or "is not text (it holds NUL bytes" in line), line)
