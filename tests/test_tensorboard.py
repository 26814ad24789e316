"""``--tensorboard DIR``: the metrics mirrored as TensorBoard scalars, or one clear refusal without the package.

The refusal is tested always (a stand-in ``tensorboard`` module that fails to import, put first on
the path); writing and reading event files only where the optional package is installed (the
``tensorboard`` extra): they are read back with TensorBoard's own ``EventAccumulator``.

Each of the two app runs is launched alone (its own ``mpiexec``): the refusal needs an environment of its own
(the stand-in first on ``PYTHONPATH``, which would hide the package from any run sharing its processes), and
that leaves the run writing event files no other run to share a job with.
"""

import importlib.util
import os
import sys

import pytest

from mpicomm.training.metrics import MetricsWriter, read_metrics

from .app_runs import RESNET, launch

HAVE_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
needs_tensorboard = pytest.mark.skipif(not HAVE_TENSORBOARD, reason="the tensorboard extra is not installed")


def _scalars(logdir) -> dict[str, dict[int, float]]:
    """Every scalar in the event files of ``logdir``: {tag: {step: value}}, read by TensorBoard itself."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    found = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    return {tag: values for tag, values in found.items() if values}  # a tag whose events were all purged: none


def _fake_tensorboard(tmp_path) -> dict:
    """Environment whose ``import tensorboard`` fails, as where the package is not installed."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "tensorboard.py").write_text("raise ImportError('No module named tensorboard (stand-in)')\n")
    return {"PYTHONPATH": os.pathsep.join([str(fake), *filter(None, [os.environ.get("PYTHONPATH")])])}


def test_require_tensorboard_names_the_extra(monkeypatch):
    from mpicomm.training.tensorboard import require_tensorboard

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ImportError
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    with pytest.raises(ValueError, match=r"pip install 'mpicomm\[tensorboard\]'"):
        require_tensorboard()


def test_the_app_refuses_tensorboard_without_the_package_in_one_line(tmp_path):
    proc = launch(2, "train_resnet.py", [*RESNET, "--algorithm", "dpsgd", "--tensorboard", str(tmp_path / "tb")],
                  env=_fake_tensorboard(tmp_path))
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["train_resnet: error: --tensorboard needs the tensorboard package, which is not installed: "
                     "pip install 'mpicomm[tensorboard]' (or pip install tensorboard)"], proc.stderr[-3000:]
    assert not (tmp_path / "tb").exists()


@needs_tensorboard
def test_mirror_writes_numbers_and_a_resume_purges_what_it_supersedes(tmp_path):
    from mpicomm.training.tensorboard import ScalarMirror

    first = MetricsWriter(str(tmp_path / "m.jsonl"), enabled=True, mirror=ScalarMirror(str(tmp_path / "tb")))
    first.write({"event": "start", "step": 0, "algorithm": "dpsgd", "config": {"lr": 0.1}, "ranks": 2})
    for step in (1, 2, 3, 4):
        first.write({"event": "train", "step": step, "loss": 1.0 / step, "lr": 0.1, "flag": True, "x": float("nan")})
    first.write({"event": "eval", "step": 4, "test_accuracy": 0.5})
    first.close()
    resumed = MetricsWriter(str(tmp_path / "m.jsonl"), enabled=True, append=True,
                            mirror=ScalarMirror(str(tmp_path / "tb"), purge_step=3))  # resumed from step 2
    resumed.write({"event": "train", "step": 3, "loss": 30.0, "lr": 0.1})
    resumed.close()
    got = _scalars(tmp_path / "tb")
    assert got == {"start/ranks": {0: 2.0}, "train/loss": {1: 1.0, 2: 0.5, 3: 30.0},
                   "train/lr": {1: pytest.approx(0.1), 2: pytest.approx(0.1), 3: pytest.approx(0.1)}}
    assert len(read_metrics(str(tmp_path / "m.jsonl"))) == 7  # the JSON lines keep everything, as before


@needs_tensorboard
def test_the_apps_metrics_reach_tensorboard_from_rank_0(tmp_path):
    proc = launch(2, "train_resnet.py", [*RESNET, "--algorithm", "dpsgd", "--out-dir", str(tmp_path / "run"),
                                         "--tensorboard", str(tmp_path / "tb")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1  # rank 0 only
    got = _scalars(tmp_path / "tb")
    records = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    train = {r["step"]: r["loss"] for r in records if r["event"] == "train"}
    final = [r for r in records if r["event"] == "eval"][-1]
    assert list(got["train/loss"]) == sorted(train) == [1, 2, 3, 4]
    assert got["train/loss"] == pytest.approx(train, rel=1e-6)  # stored as float32
    assert got["eval/test_accuracy"] == {4: pytest.approx(final["test_accuracy"], rel=1e-6)}
    assert got["end/bytes_sent"][4] == pytest.approx(records[-1]["bytes_sent"], rel=1e-6)
