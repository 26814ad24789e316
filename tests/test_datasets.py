"""The datasets: the embedded digits read as scikit-learn gives them; the fetched full MNIST and BERT's
python-docs corpus, verified, refused in one line when damaged.

The set-up (``scripts/setup_env.sh``) fetched both into the data cache; these tests read that cache, and
damage copies of it in a temporary ``MPICOMM_DATA_DIR``.

Each of the two app runs is launched alone (its own ``mpiexec``): the refusal needs an environment of its own
(``MPICOMM_DATA_DIR`` naming the damaged copy, which any run sharing its processes would read too), and that
leaves the MNIST training run no other run to share a job with. The check that loading the digits never
imports scikit-learn needs a fresh Python of its own.
"""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from .app_runs import REPO, launch

sys.path.insert(0, os.path.join(REPO, "apps"))

from bert.corpus import load_documents  # noqa: E402
from bert.documents import load_python_docs  # noqa: E402
from data.cache import cache_dir  # noqa: E402
from data.images import digits_arrays, load_mnist, shard_indices  # noqa: E402
from data.mnist import FETCH_COMMAND, load_mnist_arrays  # noqa: E402

# The label counts of MNIST's 60,000 training (train + validation) and 10,000 test digits.
TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def test_digits_are_scikit_learns_and_read_without_importing_it():
    """The embedded digits equal ``sklearn.datasets.load_digits()`` exactly, and a process that loads them never
    imports scikit-learn (about 1.8 s of every rank's start-up)."""
    from sklearn.datasets import load_digits

    images, targets = digits_arrays()
    digits = load_digits()
    assert images.dtype == digits.images.dtype and targets.dtype == digits.target.dtype
    assert (images == digits.images).all() and (targets == digits.target).all()
    child = ("import sys; sys.path.insert(0, 'apps'); from data.images import load_digits32; "
             "data = load_digits32(); print(len(data.x_train) + len(data.x_test), 'sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", child], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["1797", "False"], out.stderr[-2000:]


@pytest.fixture(scope="module")
def mnist():
    return load_mnist()


def test_mnist_has_its_known_shapes_and_label_counts(mnist):
    assert tuple(mnist.x_train.shape) == (60000, 1, 28, 28) and mnist.x_train.dtype == torch.uint8
    assert tuple(mnist.x_test.shape) == (10000, 1, 28, 28)
    assert torch.bincount(mnist.y_train).tolist() == TRAIN_COUNTS
    assert torch.bincount(mnist.y_test).tolist() == TEST_COUNTS
    assert mnist.channels == 1 and not mnist.flip and mnist.num_classes == 10
    assert 0.12 < float(mnist.mean) < 0.14 and 0.30 < float(mnist.std) < 0.32  # MNIST's well-known 0.1307, 0.3081


@pytest.mark.parametrize("alpha", [0.0, 0.1])
def test_mnist_shards_are_disjoint_and_cover_the_training_set(mnist, alpha):
    shards = [shard_indices(mnist.y_train, rank, 8, seed=1, dirichlet_alpha=alpha) for rank in range(8)]
    together = torch.cat(shards)
    assert len(together) == 60000 and len(torch.unique(together)) == 60000


def _damaged_copy(tmp_path, name: str):
    shutil.copytree(cache_dir() / "mnist", tmp_path / "mnist")
    path = tmp_path / "mnist" / name
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    return tmp_path


def test_a_damaged_mnist_cache_is_refused_naming_the_fetch_command(tmp_path):
    root = _damaged_copy(tmp_path, "x_train.npy")
    with pytest.raises(ValueError, match="does not match its known SHA-256") as caught:
        load_mnist_arrays(root / "mnist")
    assert f"{FETCH_COMMAND} --force" in str(caught.value)
    shutil.copy(cache_dir() / "mnist" / "x_train.npy", root / "mnist" / "x_train.npy")
    load_mnist_arrays(root / "mnist")  # intact again
    (root / "mnist" / "y_test.npy").unlink()
    with pytest.raises(ValueError, match="y_test.npy is missing"):
        load_mnist_arrays(root / "mnist")


def test_the_app_refuses_a_damaged_mnist_cache_in_one_line(tmp_path):
    root = _damaged_copy(tmp_path, "y_train.npy")
    proc = launch(2, "train_resnet.py", ["--dataset", "mnist", "--no-progress"], env={"MPICOMM_DATA_DIR": str(root)})
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("train_resnet: error: --dataset mnist: ") and "y_train.npy does not match" in lines[0]


def test_two_ranks_train_on_mnist(tmp_path):
    """A short run on the real yardstick: 60,000 // (2 x 32) batches an epoch, the loss going down."""
    proc = launch(2, "train_resnet.py", ["--dataset", "mnist", "--model", "resnet8", "--algorithm", "dpsgd",
                                         "--momentum", "0.9", "--max-steps", "12", "--log-every", "4",
                                         "--eval-limit", "200", "--no-progress", "--out-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    from mpicomm.training.metrics import read_metrics

    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    start = next(r for r in records if r["event"] == "start")
    losses = [r["loss"] for r in records if r["event"] == "train"]
    assert start["steps_per_epoch"] == 60000 // 64 and len(losses) == 3 and losses[-1] < losses[0]


def test_python_docs_is_ten_times_the_pydoc_topics_and_verified(tmp_path):
    docs = load_python_docs(cache_dir())
    pydoc = load_documents(None)
    assert len(docs) > 1000 and sum(map(len, docs)) > 10 * sum(map(len, pydoc))
    assert load_documents(None, "python-docs") == docs
    shutil.copytree(cache_dir() / "python-docs", tmp_path / "python-docs")
    with open(tmp_path / "python-docs" / "documents.json", "r+b") as f:
        f.seek(1000)
        f.write(b"#")
    with pytest.raises(ValueError, match="does not match its manifest's SHA-256.*python apps/fetch_data.py "
                                         "python-docs"):
        load_python_docs(tmp_path)

