"""The apps when another writer fills the disk mid-run: one line, exit 3, nothing committed lost, and a resume
that repairs and continues the metrics.

Each case launches the ResNet app on 2 ranks into a small tmpfs, through a prelude that plays the other
writer: at a chosen moment it takes every byte left on the disk (all but 1 MiB during a checkpoint, so that
each rank's file stops part way). Its file is then removed (space freed) before the run is resumed. Also
the metrics file's own guarantees, in-process: a record is written whole or not at all, and a cut-off last
line is dropped when a run continues the file.

Each app run is its own ``mpiexec``, not one of a batch (``run_apps``): the prelude patches the checkpoint
store or the metrics writer for the whole process, which would reach every later run of a batch; the
test changes the disk between a run and its resume; and a full disk met inside HDF5 must end the process
itself with exit 3 (a crash at exit would show as 139), which only a process of its own shows for that run.
"""

import json
import os
import subprocess
import sys

import pytest

from mpicomm.checkpoint.reading import read_index, read_rank_entry
from mpicomm.training.metrics import MetricsWriter, continued, read_metrics, repair_metrics
from mpicomm.training.plot import curves

from .app_runs import REPO, RESNET, mpiexec, strict_records
from .conftest import mount_tmpfs, tmpfs

FILLER = "other-writer"
PRELUDE = """
import os, runpy, sys

def fill(directory, leave=0):  # another writer takes every byte left but ``leave``
    fd = os.open(os.path.join(directory, "other-writer"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(fd, bytes(1 << 16))
    except OSError:
        os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))
        os.close(fd)

when, app = sys.argv[1], sys.argv[2]
sys.argv = sys.argv[2:]
if when == "checkpoint-4":  # after the store checked that the checkpoint of step 4 fits, leaving 1 MiB:
    # each rank's file (~2.2 MB) stops part way, inside HDF5 (a write that must not crash the process at its exit)
    from mpicomm.checkpoint import durable
    check_space = durable.check_space
    def check_then_fill(directory, need):
        check_space(directory, need)
        if directory.name == ".tmp-step-000000004":
            fill(directory.parent, leave=1 << 20)
    durable.check_space = check_then_fill
if when == "metrics-page":  # after the first checkpoint, as a metrics record needs a new page of the tmpfs
    import json
    from mpicomm.training import metrics
    write, state = metrics.MetricsWriter.write, {"armed": False, "filled": False}
    def fill_then_write(self, record):
        state["armed"] = state["armed"] or bool(self.path and record.get("event") == "checkpoint")
        if state["armed"] and not state["filled"]:
            line = json.dumps(metrics._finite(record), sort_keys=True, allow_nan=False) + "\\n"
            if len(line.encode()) > -os.path.getsize(self.path) % os.sysconf("SC_PAGE_SIZE"):
                fill(os.path.dirname(self.path))  # so this record cannot be written whole
                state["filled"] = True
        write(self, record)
    metrics.MetricsWriter.write = fill_then_write
runpy.run_path(app, run_name="__main__")
"""


def _args(out_dir, steps: int, save_every: int, *extra) -> list[str]:
    args = [*RESNET, "--algorithm", "dpsgd", "--momentum", "0.9"]
    args[args.index("--max-steps") + 1] = str(steps)
    return [*args, "--out-dir", str(out_dir), "--save-every", str(save_every), *extra]


def _launch(args: list[str], fill_when: str = "never") -> subprocess.CompletedProcess:
    """The ResNet app on 2 ranks, its other writer filling the disk at ``fill_when``."""
    command = [mpiexec(), "-n", "2", sys.executable, "-c", PRELUDE, fill_when,
               os.path.join(REPO, "apps", "train_resnet.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def _stderr_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.strip()]


@pytest.fixture
def disk(tmp_path):
    """A 16 MiB tmpfs: three checkpoints of this run (~4.4 MB each) fit, as a resume to step 6 needs."""
    with tmpfs(tmp_path / "disk", "16m") as disk:
        yield disk


def test_a_disk_filled_during_a_checkpoint_stops_with_one_line_and_keeps_the_last_one(disk):
    proc = _launch(_args(disk, 6, 2), "checkpoint-4")
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-3000:])  # not a crash (SIGSEGV: 139)
    lines = _stderr_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("train_resnet: error: "), proc.stderr[-3000:]
    line = lines[0]
    assert f"could not write the checkpoint of step 4 in {disk}: " in line
    assert "[Errno 28] No space left on device" in line and "rank-0000" in line
    last = disk / "step-000000002"
    assert line.endswith(f"the last checkpoint is {last} (--resume {last})")
    assert sorted(p.name for p in disk.iterdir()) == ["latest", "metrics.jsonl", FILLER, "step-000000002"]
    assert (disk / "latest").read_text() == "step-000000002\n"
    directory, meta, save_id = read_index(last)  # intact: every checksum verified on reading
    assert meta["step"] == 2 and meta["world_size"] == 2
    for rank in range(2):
        assert read_rank_entry(directory, rank, meta, save_id)["position"]["step"] == 2
    strict_records(disk / "metrics.jsonl")


def test_a_disk_filled_while_writing_metrics_stops_and_a_resume_continues_a_clean_file(disk):
    """The disk fills up after the checkpoint of step 10, at the first record that then needs a new page of the
    tmpfs (at most 9 steps on: a record takes ~500 bytes), so the run stops before saving at step 20."""
    metrics, last = disk / "metrics.jsonl", disk / "step-000000010"
    proc = _launch(_args(disk, 20, 10), "metrics-page")
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-3000:])
    lines = _stderr_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("train_resnet: error: rank 0: could not write the metrics to "
                                                   f"{metrics}: No space left on device at step "), proc.stderr
    assert lines[0].endswith(f"the last checkpoint is {last} (--resume {last})")
    assert metrics.read_bytes().endswith(b"\n")  # the part of the record that fitted was cut back off
    before = strict_records(metrics)
    assert sorted(p.name for p in disk.iterdir()) == ["latest", "metrics.jsonl", FILLER, last.name]

    (disk / FILLER).unlink()
    with open(metrics, "a") as f:  # what a writer killed mid-line leaves
        f.write('{"event": "train", "step": 11, "l')
    proc = _launch(_args(disk, 20, 10, "--resume", "latest"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _stderr_lines(proc) == [f"train_resnet: warning: UserWarning: {metrics}: dropped its last line, cut off "
                                   "by an interrupted write (33 bytes: '{\"event\": \"train\", \"step\": 11, \"l')"]
    records = strict_records(metrics)
    assert records[:len(before)] == before and records[len(before)]["event"] == "resume"
    assert [r["step"] for r in continued(records) if r["event"] == "train"] == list(range(1, 21))
    (run,) = curves([str(metrics)])  # what mpicomm plot draws
    assert run["loss"][0] == list(range(1, 21))


def test_a_record_is_written_whole_or_not_at_all(tmp_path):
    """On a full disk the writer cuts back what part of a record fitted, stops, and says why."""
    mount_tmpfs(tmp_path / "disk", "64k")
    try:
        path = tmp_path / "disk" / "metrics.jsonl"
        writer = MetricsWriter(str(path), enabled=True)
        for step in range(1000):
            writer.write({"event": "train", "step": step, "note": "x" * 300})
            if writer.problem:
                break
        assert writer.problem == f"could not write the metrics to {path}: No space left on device"
        assert path.stat().st_size % os.sysconf("SC_PAGE_SIZE")  # part of the last record had fitted ...
        assert path.read_bytes().endswith(b"\n")  # ... and was cut back off
        assert [r["step"] for r in strict_records(path)] == list(range(step))
        writer.write({"event": "end"})  # a no-op once stopped
        writer.close()
        assert len(strict_records(path)) == step
    finally:
        subprocess.run(["umount", "-l", str(tmp_path / "disk")], check=True)


@pytest.mark.parametrize("tail, dropped", [
    ('{"step": 3, "lo', True),      # cut off mid-record
    ('{"step": 3}', True),          # complete JSON, but its newline never written
    ("\0\0\0\0", True),             # zeros a crash left past the end
    ('{"step": 3, "lo\n', True),    # a newline, but no record
    ('{"step": 3}\n', False),       # whole
    ("\n", False),                  # a blank line
])
def test_a_continued_file_drops_a_cut_off_last_line(tmp_path, tail, dropped):
    path = tmp_path / "metrics.jsonl"
    whole = '{"step": 1}\n{"step": 2}\n'
    path.write_text(whole + tail)
    note = repair_metrics(str(path))
    assert path.read_text() == whole + ("" if dropped else tail)
    if dropped:
        assert note.startswith(f"{path}: dropped its last line, cut off by an interrupted write ({len(tail)} bytes: ")
    else:
        assert note == ""
    assert read_metrics(str(path)) == [{"step": 1}, {"step": 2}] + ([{"step": 3}] if tail == '{"step": 3}\n' else [])
    assert repair_metrics(str(path)) == ""  # nothing more to drop


def test_the_reader_skips_only_a_cut_off_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo')
    assert read_metrics(str(path)) == [{"step": 1}]
    path.write_text('{"step": 1, "lo\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 1: not a JSON record"):
        read_metrics(str(path))


def test_a_writer_continuing_a_file_repairs_it_and_says_so(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo')
    with pytest.warns(UserWarning, match="dropped its last line, cut off by an interrupted write"):
        writer = MetricsWriter(str(path), enabled=True, append=True)
    writer.write({"step": 2})
    writer.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"step": 1}, {"step": 2}]
