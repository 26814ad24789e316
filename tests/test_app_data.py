"""The ResNet app's data path on a tiny archive in the exact CIFAR-10 format, shards, and ``mpicomm plot``."""

import json
import os
import pickle
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "apps"))

from data.image_task import ImageTask  # noqa: E402
from data.images import load_cifar10, shard_indices  # noqa: E402

from mpicomm.training.plot import curves, plot_runs  # noqa: E402


def _write_cifar(folder, per_batch=12):
    """``cifar-10-batches-py`` with 5 training batches and a test batch of ``per_batch`` images each."""
    root = folder / "cifar-10-batches-py"
    root.mkdir()
    rng = np.random.default_rng(0)
    images = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = list(rng.integers(0, 10, size=per_batch))
        with open(root / name, "wb") as f:
            pickle.dump({b"data": data, b"labels": labels, b"batch_label": name.encode()}, f)
        images[name] = (data, labels)
    return images


def test_cifar_reader_reads_the_standard_archive_exactly(tmp_path):
    images = _write_cifar(tmp_path)
    data = load_cifar10(str(tmp_path))
    assert data.x_train.shape == (60, 3, 32, 32) and data.x_test.shape == (12, 3, 32, 32)
    first, labels = images["data_batch_1"]
    assert torch.equal(data.x_train[0], torch.from_numpy(first[0].reshape(3, 32, 32)))
    assert data.y_train[:12].tolist() == [int(v) for v in labels]
    assert data.flip


def test_cifar_reader_names_what_is_missing(tmp_path):
    _write_cifar(tmp_path)
    os.remove(tmp_path / "cifar-10-batches-py" / "test_batch")
    with pytest.raises(ValueError, match=r"missing \['test_batch'\]"):
        load_cifar10(str(tmp_path))


def test_task_batches_are_deterministic_and_resumable(tmp_path):
    _write_cifar(tmp_path)
    data = load_cifar10(str(tmp_path))
    task = ImageTask(torch.nn.Linear(1, 1), data, rank=1, size=2, batch_size=5, seed=3)
    full = list(task.train_batches(epoch=2))
    tail = list(task.train_batches(epoch=2, start=2))
    assert len(full) == task.steps_per_epoch == 30 // 5
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(full[2:], tail))
    assert not torch.equal(full[0][0], next(task.train_batches(epoch=3))[0])


@pytest.mark.parametrize("damage", ["truncate", "garbage", "wrong_shape"])
def test_cifar_reader_names_a_damaged_file(tmp_path, damage):
    _write_cifar(tmp_path)
    path = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:5000])
    elif damage == "garbage":
        path.write_bytes(b"<html>not a pickle</html>")
    else:
        with open(path, "wb") as f:
            pickle.dump({b"data": np.zeros((4, 100), np.uint8), b"labels": [0, 1, 2, 3]}, f)
    expected = "expected N x 3072" if damage == "wrong_shape" else "truncated or corrupt"
    with pytest.raises(ValueError, match=f"CIFAR-10 file {path}.*{expected}"):
        load_cifar10(str(tmp_path))


@pytest.mark.parametrize("alpha", [-1.0, float("inf"), float("nan")])
def test_a_negative_or_infinite_dirichlet_alpha_is_refused(alpha):
    with pytest.raises(ValueError, match="--dirichlet-alpha must be 0"):
        shard_indices(torch.zeros(10, dtype=torch.long), 0, 2, seed=0, dirichlet_alpha=alpha)


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_shards_partition_the_training_set(alpha):
    labels = torch.from_numpy(np.random.default_rng(1).integers(0, 10, size=500))
    shards = [shard_indices(labels, r, 4, seed=0, dirichlet_alpha=alpha) for r in range(4)]
    together = torch.cat(shards)
    assert sorted(together.tolist()) == list(range(500))
    if alpha:  # non-IID: label histograms differ markedly between ranks
        hist = [torch.bincount(labels[s], minlength=10).float() / len(s) for s in shards]
        assert max(float((hist[0] - h).abs().sum()) for h in hist[1:]) > 0.3


def test_plot_writes_a_png_and_refuses_bad_input(tmp_path):
    paths = []
    for name, acc in (("a", 0.5), ("b", 0.7)):
        run = tmp_path / name
        run.mkdir()
        with open(run / "metrics.jsonl", "w") as f:
            for step in (1, 2):
                f.write(json.dumps({"event": "eval", "epoch": step, "wall_s": step, "bytes_sent": 1e6 * step,
                                    "test_accuracy": acc * step / 2}) + "\n")
        paths.append(str(run / "metrics.jsonl"))
    out = plot_runs(paths, str(tmp_path / "curves.png"))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="does not exist"):
        plot_runs([str(tmp_path / "nope.jsonl")], str(tmp_path / "x.png"))
    with pytest.raises(ValueError, match="2 labels for 1"):
        plot_runs(paths[:1], str(tmp_path / "x.png"), labels=["a", "b"])
    with open(paths[0], "a") as f:
        f.write('{"event": "train", "step": 3, "loss":\n')
    with pytest.raises(ValueError, match=r"a/metrics.jsonl, line 3: not a JSON record"):
        plot_runs(paths[:1], str(tmp_path / "x.png"))


def test_plot_draws_the_loss_curve_and_one_point_per_evaluation_of_a_resumed_run(tmp_path):
    """Train records give the loss curve; a resume at step 4 supersedes what the killed run logged after it."""
    records = [{"event": "start", "step": 0}]
    records += [{"event": "train", "step": s, "loss": 10.0 - s} for s in (2, 4, 6)]
    records += [{"event": "eval", "step": 4, "epoch": 1, "wall_s": 5, "bytes_sent": 2e6, "test_accuracy": 0.5},
                {"event": "resume", "step": 4}, {"event": "start", "step": 4},
                {"event": "train", "step": 6, "loss": 3.5}, {"event": "train", "step": 8, "loss": 2.0},
                {"event": "eval", "step": 8, "epoch": 2, "wall_s": 9, "bytes_sent": 4e6, "test_accuracy": 0.75}]
    (tmp_path / "run").mkdir()
    path = tmp_path / "run" / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    (run,) = curves([str(path)])
    assert run["label"] == "run" and run["loss"] == ([2, 4, 6, 8], [8.0, 6.0, 3.5, 2.0])
    assert run["epoch"] == ([1, 2], [0.5, 0.75]) and run["bytes_sent"] == ([2.0, 4.0], [0.5, 0.75])


def test_plot_draws_each_apps_own_metric_by_default(tmp_path):
    """A BERT run logs no test_accuracy: without --metric its masked-token accuracy is drawn, beside a ResNet run's
    test accuracy; a metric neither file holds is refused naming what they hold."""
    paths = []
    for name, metric in (("bert", "val_mlm_accuracy"), ("resnet", "test_accuracy")):
        (tmp_path / name).mkdir()
        path = tmp_path / name / "metrics.jsonl"
        path.write_text(json.dumps({"event": "eval", "epoch": 1, "wall_s": 1, "bytes_sent": 1e6, metric: 0.4,
                                    "val_mlm_loss" if name == "bert" else "test_loss": 2.0}) + "\n")
        paths.append(str(path))
    bert, resnet = curves(paths)
    assert (bert["metric"], bert["epoch"]) == ("val_mlm_accuracy", ([1], [0.4]))
    assert resnet["metric"] == "test_accuracy"
    with pytest.raises(ValueError, match="no evaluation records with 'test_loss'; --metric can be one of "
                                         "val_mlm_accuracy, val_mlm_loss"):
        curves(paths, metric="test_loss")
