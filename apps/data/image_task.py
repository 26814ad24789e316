"""The image-classification Task the training loop consumes: batches, loss, evaluation."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.nn import functional as F

from mpicomm.training.device import to_device

from .images import ImageData, augment, shard_indices

__all__ = ["EVAL_CHUNK", "ImageTask", "check_sizes"]

EVAL_CHUNK = 128  # test images per forward pass: ResNet-20's activations for 500 took ~200 MB a rank


def check_sizes(batch_size: int, eval_limit: int = 0) -> None:
    """Raise ``ValueError`` naming the option unless ``batch_size`` >= 1 and ``eval_limit`` >= 0 are integers."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"--batch-size must be a positive integer, got {batch_size}")
    if isinstance(eval_limit, bool) or not isinstance(eval_limit, int) or eval_limit < 0:
        raise ValueError(f"--eval-limit must be 0 (the whole test set) or a positive number of images, "
                         f"got {eval_limit}")


class ImageTask:
    """This rank's view of an image dataset for a model: deterministic batches, cross-entropy, test accuracy.

    Every rank takes the same number of batches per epoch, ``steps_per_epoch`` = the training images //
    (ranks x batch size): a function of the whole dataset, the same on every rank by construction (the
    training loop still agrees it). Uneven shards (a Dirichlet split, or N not divisible by the ranks) are
    met as ``DistributedSampler`` meets them: a rank whose shard holds more images than an epoch takes
    leaves the rest (each epoch draws a fresh order, so all of it is seen over epochs); a rank whose shard
    holds fewer goes on into a fresh permutation of it (its images repeat within the epoch).

    ``family``: the task family whose measured accuracy costs ``--algorithm auto`` weighs.
    """

    family = "image"

    def __init__(self, model: torch.nn.Module, data: ImageData, *, rank: int, size: int, batch_size: int,
                 seed: int, dirichlet_alpha: float = 0.0, augment_images: bool = True, eval_limit: int = 0):
        check_sizes(batch_size, eval_limit)
        self.model, self.data = model, data
        self.rank, self.batch_size, self.seed = rank, batch_size, seed
        self.augment = augment_images and data.augmentable
        self.indices = shard_indices(data.y_train, rank, size, seed, dirichlet_alpha)
        self.steps_per_epoch = len(data.y_train) // (size * batch_size)
        if self.steps_per_epoch < 1:
            raise ValueError(f"--batch-size {batch_size} on {size} ranks needs {batch_size * size} training images "
                             f"per step; {data.name} has {len(data.y_train)}: lower --batch-size")
        limit = eval_limit if eval_limit > 0 else len(data.y_test)
        self.x_test, self.y_test = data.x_test[:limit], data.y_test[:limit]  # uint8: normalised per chunk

    def to_device(self, device: torch.device) -> None:
        """Hold the images (uint8) and test set on ``device`` whole: batches are then cut there, no copies."""
        self.data.to_device(device)
        self.x_test, self.y_test = self.x_test.to(device), self.y_test.to(device)

    def _generator(self, *key: int) -> torch.Generator:
        value = self.seed
        for k in (self.rank, *key):
            value = value * 1_000_003 + k
        return torch.Generator().manual_seed(value % (2**63))

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """This rank's image indices for ``epoch``, at least ``steps_per_epoch * batch_size`` of them: a seeded
        permutation of the shard, followed by further ones while the shard is smaller than the epoch."""
        need = self.steps_per_epoch * self.batch_size
        parts = [torch.randperm(len(self.indices), generator=self._generator(epoch))]
        while sum(len(p) for p in parts) < need:
            parts.append(torch.randperm(len(self.indices), generator=self._generator(epoch, -1, len(parts))))
        return self.indices[torch.cat(parts)]

    def train_batches(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches ``start``, ``start + 1``, … of ``epoch`` (a pure function of seed, rank, epoch, index)."""
        order = self.epoch_order(epoch)
        for b in range(start, self.steps_per_epoch):
            idx = to_device(order[b * self.batch_size:(b + 1) * self.batch_size], self.data.x_train.device)
            x = self.data.x_train[idx]
            if self.augment:
                x = augment(x, self._generator(epoch, b), self.data.flip, self.data.pad)
            yield self.data.normalise(x), self.data.y_train[idx]

    def loss(self, model: torch.nn.Module, batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Cross-entropy, with correct/count counters for the training accuracy."""
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits, y), {"correct": (logits.argmax(1) == y).sum(), "count": len(y)}

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """Test loss and accuracy (in chunks of :data:`EVAL_CHUNK` images to bound memory)."""
        total_loss, correct = 0.0, 0
        for start in range(0, len(self.y_test), EVAL_CHUNK):
            x = self.data.normalise(self.x_test[start:start + EVAL_CHUNK])
            y = self.y_test[start:start + EVAL_CHUNK]
            logits = model(x)
            total_loss += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(1) == y).sum())
        n = max(len(self.y_test), 1)
        return {"test_loss": total_loss / n, "test_accuracy": correct / n}
