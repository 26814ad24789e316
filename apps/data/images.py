"""Data for the image app: full MNIST, CIFAR-10 from its standard archive, MNIST-1D, or the embedded digits default.

* ``digits`` (the default, embedded): scikit-learn's handwritten digits (1,797 real 8x8 scans shipped
  inside the package, no download) upsampled bilinearly to 32x32 and repeated over 3 channels, split
  80/20 with a fixed seed — real images in the CIFAR tensor format, so the same models and pipeline run
  offline. A quick demo: 1,438 training images.
* ``mnist``: the 60,000 + 10,000 MNIST digits, 1 channel of 28x28 (:mod:`.mnist`: fetched once by the
  set-up, cached and verified) — the real yardstick at the scale clusters run.
* ``cifar10``: the ``cifar-10-batches-py`` folder (``data_batch_1`` … ``data_batch_5``, ``test_batch``:
  pickled dicts of ``b"data"`` (N x 3072 uint8, channel-major) and ``b"labels"``) in ``--data-dir`` or
  in ``--data-dir/cifar-10-batches-py``.
* ``mnist1d``: 40,000 + 10,000 sequences of 40 values, generated offline by the ``mnist1d`` package
  (:mod:`.mnist1d`: once, then cached) — a task small enough for seconds per epoch on which training
  methods still end apart (a small CNN reaches about 94 %).

Each rank trains on its own shard: IID (a seeded permutation dealt round-robin) or non-IID by a
Dirichlet(alpha) label split (Hsu, Qi, Brown 2019). Augmentation is the usual random crop with zero
padding (4 pixels on 32x32 images, 2 on MNIST's 28x28) and, for CIFAR only, a horizontal flip (digits are
chiral); every random draw comes from a generator seeded by (seed, rank, epoch, batch index), so a
resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import gzip
import importlib.util
import math
import os
import pickle
import warnings
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from mpicomm.training.device import to_device

__all__ = ["DATASETS", "ImageData", "load_cifar10", "load_dataset", "load_digits32", "load_mnist", "shard_indices"]

DATASETS = ("digits", "mnist", "mnist1d", "cifar10")


def channel_statistics(blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and standard deviation, in [0, 1], of uint8 images given as blocks (n, C, H, W),
    summed in float64 one block at a time (no float copy of the whole set)."""
    total = squares = None
    count = 0
    for block in blocks:
        block = np.asarray(block, dtype=np.float64) / 255
        sums, sum_squares = block.sum(axis=(0, 2, 3)), np.square(block).sum(axis=(0, 2, 3))
        total = sums if total is None else total + sums
        squares = sum_squares if squares is None else squares + sum_squares
        count += block.shape[0] * block.shape[2] * block.shape[3]
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - mean**2, 0) * count / max(count - 1, 1))
    shape = (1, len(mean), 1, 1)
    return torch.tensor(mean, dtype=torch.float32).view(shape), torch.tensor(std, dtype=torch.float32).view(shape)


class ImageData:
    """Train/test images as uint8 tensors (N, C, H, W) with int64 labels and per-channel statistics.

    ``pad``: the random crop's zero padding in pixels; ``flip``: whether augmentation flips horizontally;
    ``statistics``: the training images' per-channel (mean, std) when the caller computed them already.
    ``augmentable``: whether the random crop (and flip) applies to these images.
    """

    augmentable = True

    def __init__(self, x_train, y_train, x_test, y_test, name: str, flip: bool, pad: int = 4, statistics=None):
        self.x_train, self.y_train, self.x_test, self.y_test = x_train, y_train, x_test, y_test
        self.name, self.flip, self.pad = name, flip, pad
        if statistics is None:
            statistics = channel_statistics(x_train[i:i + 4096].numpy() for i in range(0, len(x_train), 4096))
        self.mean, self.std = statistics[0], statistics[1] + 1e-6
        self.num_classes = int(max(y_train.max(), y_test.max())) + 1
        self.channels = int(x_train.shape[1])

    def to_device(self, device: torch.device) -> None:
        """Move the images, labels and channel statistics to ``device``."""
        for name in ("x_train", "y_train", "x_test", "y_test", "mean", "std"):
            setattr(self, name, getattr(self, name).to(device))

    def normalise(self, x_uint8: torch.Tensor) -> torch.Tensor:
        """uint8 images -> float32, standardised per channel with the training set's statistics."""
        return (x_uint8.float() / 255 - self.mean) / self.std


def _unpickle(path: str) -> dict:
    """One batch file of the archive, checked: rows of 3072 bytes (10,000 in the real one), labels in 0..9."""
    try:
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        data, labels = np.asarray(batch[b"data"]), np.asarray(batch[b"labels"])
    except Exception as exc:  # noqa: BLE001 - any failure to read it means the same thing to the user
        raise ValueError(f"--data-dir: the CIFAR-10 file {path} is truncated or corrupt ({type(exc).__name__}: "
                         f"{exc}); download and unpack cifar-10-python.tar.gz again") from exc
    images = data.shape[0] if data.ndim == 2 else -1
    if images < 1 or data.shape[1] != 3072 or data.dtype != np.uint8 or labels.shape != (images,) \
            or labels.min() < 0 or labels.max() > 9:
        raise ValueError(f"--data-dir: the CIFAR-10 file {path} holds data of shape {data.shape} ({data.dtype}) and "
                         f"labels of shape {labels.shape}; expected N x 3072 uint8 images with N labels in 0..9")
    return batch


def load_cifar10(data_dir: str) -> ImageData:
    """Read the standard ``cifar-10-batches-py`` archive from ``data_dir`` (or its sub-folder of that name)."""
    folder = data_dir
    if os.path.isdir(os.path.join(data_dir, "cifar-10-batches-py")):
        folder = os.path.join(data_dir, "cifar-10-batches-py")
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
    if os.path.exists(data_dir) and not os.path.isdir(data_dir):
        raise ValueError(f"--data-dir {data_dir!r} is not a folder; expected the CIFAR-10 python archive's "
                         "(cifar-10-batches-py with data_batch_1..5 and test_batch)")
    if not os.path.isdir(data_dir) or missing:
        raise ValueError(
            f"--data-dir {data_dir!r}: expected the CIFAR-10 python archive (cifar-10-batches-py with "
            f"data_batch_1..5 and test_batch); missing {missing if os.path.isdir(data_dir) else 'the folder'}"
        )
    parts = [_unpickle(os.path.join(folder, n)) for n in names]

    def stack(batches):
        x = np.concatenate([b[b"data"] for b in batches]).reshape(-1, 3, 32, 32)
        y = np.concatenate([np.asarray(b[b"labels"]) for b in batches])
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.uint8)), torch.from_numpy(y.astype(np.int64))

    x_train, y_train = stack(parts[:5])
    x_test, y_test = stack(parts[5:])
    return ImageData(x_train, y_train, x_test, y_test, "cifar10", flip=True)


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as ``load_digits`` gives them: images (1797, 8, 8) float64 in 0..16, targets int.

    Read from the CSV that scikit-learn ships, found without importing scikit-learn (its import costs each rank
    about 1.8 s of start-up, ten times the read); through ``load_digits`` if the file has moved.
    """
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz") if spec else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits

        digits = load_digits()
        return digits.images, digits.target
    with gzip.open(path, mode="rt", encoding="utf-8") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


def load_digits32(seed: int = 0) -> ImageData:
    """scikit-learn's digits, upsampled to 3x32x32 uint8, 80/20 split (no horizontal flips: digits are chiral)."""
    images, targets = digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
    x = (x.clamp(0, 1) * 255).round().to(torch.uint8).repeat(1, 3, 1, 1)
    y = torch.tensor(targets, dtype=torch.int64)
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(x)))
    n_test = len(x) // 5
    test, train = order[:n_test], order[n_test:]
    return ImageData(x[train], y[train], x[test], y[test], "digits32", flip=False)


def load_mnist() -> ImageData:
    """Full MNIST from the verified cache (:func:`.mnist.load_mnist_arrays`): 1 x 28 x 28, no horizontal flips.

    The training images stay memory-mapped (read-only, shared by the ranks of a node through the page
    cache); a batch gathers its images from them. Their statistics are summed from plain file reads, so
    no rank maps pages it will not train on.
    """
    from .cache import cache_dir
    from .mnist import data_blocks, load_mnist_arrays

    arrays = load_mnist_arrays()
    statistics = channel_statistics(block[:, None] for block in data_blocks(cache_dir() / "mnist" / "x_train.npy"))
    with warnings.catch_warnings():  # torch warns that the read-only map is not writable: it is never written
        warnings.simplefilter("ignore", UserWarning)
        x_train = torch.from_numpy(arrays["x_train"]).unsqueeze(1)
    x_test = torch.from_numpy(np.array(arrays["x_test"])).unsqueeze(1)
    return ImageData(x_train, torch.from_numpy(np.array(arrays["y_train"])), x_test,
                     torch.from_numpy(np.array(arrays["y_test"])), "mnist", flip=False, pad=2, statistics=statistics)


def load_dataset(name: str, data_dir: str = "", seed: int = 0) -> ImageData:
    """The ``--dataset`` ``name`` (one of :data:`DATASETS`); ``data_dir`` is CIFAR-10's archive folder; ``seed``
    splits the digits (MNIST-1D is always the set of :data:`.mnist1d.SEED`)."""
    if name not in DATASETS:
        raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}, got {name!r}")
    if name == "cifar10":
        if not data_dir:
            raise ValueError("--dataset cifar10 needs --data-dir (the folder of cifar-10-batches-py)")
        return load_cifar10(data_dir)
    if data_dir:
        raise ValueError(f"--data-dir is CIFAR-10's archive; --dataset {name} takes none")
    if name == "mnist1d":
        from .mnist1d import load_mnist1d

        return load_mnist1d()
    return load_mnist() if name == "mnist" else load_digits32(seed=seed)


def shard_indices(labels: torch.Tensor, rank: int, size: int, seed: int, dirichlet_alpha: float = 0.0) -> torch.Tensor:
    """This rank's training indices: IID round-robin of a seeded permutation, or a Dirichlet(alpha) label split."""
    rng = np.random.default_rng(seed)
    if not (dirichlet_alpha >= 0 and math.isfinite(dirichlet_alpha)):
        raise ValueError(f"--dirichlet-alpha must be 0 (IID shards) or a finite number > 0, got {dirichlet_alpha}")
    if dirichlet_alpha == 0:
        return torch.from_numpy(rng.permutation(len(labels))[rank::size].copy())
    y = labels.numpy()
    shards: list[list[int]] = [[] for _ in range(size)]
    for c in range(int(y.max()) + 1):
        idx = rng.permutation(np.flatnonzero(y == c))
        cuts = (np.cumsum(rng.dirichlet([dirichlet_alpha] * size)) * len(idx)).astype(int)[:-1]
        for r, part in enumerate(np.split(idx, cuts)):
            shards[r].extend(part.tolist())
    mine = np.array(sorted(shards[rank]), dtype=np.int64)
    if len(mine) == 0:
        raise ValueError(f"--dirichlet-alpha {dirichlet_alpha}: rank {rank} got no training images; use a larger alpha")
    return torch.from_numpy(mine)


def augment(x: torch.Tensor, generator: torch.Generator, flip: bool, pad: int = 4) -> torch.Tensor:
    """A random crop of the ``pad``-pixel zero-padded batch at its own size, plus a random horizontal flip
    when ``flip``."""
    n, dev = x.shape[0], x.device
    height, width = x.shape[-2:]
    padded = F.pad(x, (pad, pad, pad, pad))
    offsets = to_device(torch.randint(0, 2 * pad + 1, (n, 2), generator=generator), dev)  # on the host: any device
    rows = (offsets[:, 0:1] + torch.arange(height, device=dev))[:, None, :, None]
    cols = (offsets[:, 1:2] + torch.arange(width, device=dev))[:, None, None, :]
    images = torch.arange(n, device=dev)[:, None, None, None]
    channels = torch.arange(x.shape[1], device=dev)[None, :, None, None]
    out = padded[images, channels, rows, cols]
    if flip:
        mask = to_device(torch.rand(n, generator=generator) < 0.5, dev)
        out = torch.where(mask[:, None, None, None], out.flip(-1), out)
    return out
