"""MNIST-1D (Greydanus & Kobak, "Scaling down deep learning with MNIST-1D", ICML 2024): ten 1-D digit
templates, each padded, dilated, scaled, translated, sheared and noised at random into a sequence of 40
values, so that a small CNN reaches about 94 %, an MLP about 68 % and logistic regression about 32 %: a
task on which training methods can tell apart, at a cost of seconds per epoch.

The ``mnist1d`` package generates the data offline from its templates (no download). :func:`generate`
calls its ``make_dataset`` with ``num_samples`` = train + test and the package's own 80/20 split, so the
default sizes are 40,000 training and 10,000 test sequences. The set depends on its seed alone; the app
always uses :data:`SEED` (the package's default), so every run and every ``--seed`` sees the same
sequences and a run's ``--seed`` only moves its initial weights and the order of its batches.

The generated arrays are cached as ``mnist1d/seed<S>-<train>-<test>.npz`` in the data cache
(:func:`.cache.cache_dir`): the first run generates them (about 15 s of one core), under a file lock so
that the ranks of a job generate them once; later runs read 6 MB.
"""

from __future__ import annotations

import fcntl
import os
import random
import zipfile
from pathlib import Path

import numpy as np
import torch

from .cache import cache_dir
from .images import ImageData

__all__ = ["LENGTH", "SEED", "SequenceData", "cached_arrays", "generate", "load_mnist1d"]

SEED = 42
"""The seed of the set the app trains on (the ``mnist1d`` package's default)."""
LENGTH = 40
"""Values per sequence (the package's ``final_seq_length``)."""
TRAIN, TEST = 40_000, 10_000


def generate(seed: int, num_train: int = TRAIN, num_test: int = TEST) -> dict[str, np.ndarray]:
    """MNIST-1D from the ``mnist1d`` package: ``x_train`` (num_train, 40) and ``x_test`` float32, ``y_train`` and
    ``y_test`` int64 labels 0..9, a pure function of the arguments.

    ``num_train + num_test`` must be a multiple of 10 (the package draws as many of each digit) and
    ``num_train`` 4 times ``num_test`` (its 80/20 split). The package seeds NumPy's and Python's global
    generators; their states are put back afterwards, so a caller's draws are not moved.
    """
    total = num_train + num_test
    if total % 10 or num_train != 4 * num_test or num_test < 1:
        raise ValueError(f"MNIST-1D sizes: train {num_train} must be 4 x test {num_test} (the package's 80/20 split) "
                         "and their sum a multiple of 10")
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples, args.seed = total, seed
    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        made = make_dataset(args)
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)
    return {"x_train": made["x"].astype(np.float32), "y_train": made["y"].astype(np.int64),
            "x_test": made["x_test"].astype(np.float32), "y_test": made["y_test"].astype(np.int64)}


def _intact(arrays: dict[str, np.ndarray], num_train: int, num_test: int) -> bool:
    """Whether cached ``arrays`` have the shapes, types and labels :func:`generate` gives."""
    try:
        return (arrays["x_train"].shape == (num_train, LENGTH) and arrays["x_test"].shape == (num_test, LENGTH)
                and arrays["y_train"].shape == (num_train,) and arrays["y_test"].shape == (num_test,)
                and all(arrays[k].dtype == np.float32 for k in ("x_train", "x_test"))
                and all(arrays[k].dtype == np.int64 and arrays[k].min() >= 0 and arrays[k].max() <= 9
                        for k in ("y_train", "y_test")))
    except (KeyError, ValueError):
        return False


def _read(path: Path) -> dict[str, np.ndarray] | None:
    """The arrays of a cached file, or None when it is missing or unreadable."""
    try:
        with np.load(path) as f:
            return {k: f[k] for k in f.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return None


def cached_arrays(seed: int = SEED, num_train: int = TRAIN, num_test: int = TEST,
                  root: Path | None = None) -> dict[str, np.ndarray]:
    """:func:`generate`'s arrays from the cache under ``root`` (default :func:`.cache.cache_dir`), generated and
    written there first when missing or damaged (one process at a time: the others wait and read them)."""
    folder = Path(root or cache_dir()) / "mnist1d"
    path = folder / f"seed{seed}-{num_train}-{num_test}.npz"
    arrays = _read(path)
    if arrays is not None and _intact(arrays, num_train, num_test):
        return arrays
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            arrays = _read(path)  # another process may have written it while this one waited
            if arrays is None or not _intact(arrays, num_train, num_test):
                arrays = generate(seed, num_train, num_test)
                partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                with open(partial, "wb") as f:
                    np.savez(f, **arrays)
                os.replace(partial, path)
    except OSError as exc:
        raise ValueError(f"--dataset mnist1d: could not write the generated set to {folder} ({exc}); set "
                         "MPICOMM_DATA_DIR to a writable folder") from exc
    return arrays


class SequenceData(ImageData):
    """1-D sequences (N, 1, length) float32 with int64 labels, in the form :class:`.image_task.ImageTask` takes.

    The sequences are used as generated (the generator centres the set and scales it to unit standard
    deviation) and not augmented (its random transformations are the task).
    """

    augmentable = False

    def __init__(self, x_train, y_train, x_test, y_test, name: str):
        unused = (torch.zeros(1, 1, 1), torch.ones(1, 1, 1))  # no statistics: normalise is the identity
        super().__init__(x_train, y_train, x_test, y_test, name, flip=False, pad=0, statistics=unused)

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        """The sequences as they are (already standardised by the generator)."""
        return x


def load_mnist1d(seed: int = SEED, num_train: int = TRAIN, num_test: int = TEST,
                 root: Path | None = None) -> SequenceData:
    """MNIST-1D as the app trains on it (by default 40,000 training and 10,000 test sequences of the set of
    :data:`SEED`), from the cache under ``root`` (see :func:`cached_arrays`)."""
    arrays = cached_arrays(seed, num_train, num_test, root)
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
    return SequenceData(tensors["x_train"].unsqueeze(1), tensors["y_train"], tensors["x_test"].unsqueeze(1),
                        tensors["y_test"], "mnist1d")
