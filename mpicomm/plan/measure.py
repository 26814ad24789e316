"""Timing the compute of a training step: ``mpicomm plan --measure`` and ``--algorithm auto``'s measurement.

:func:`median_pass_seconds` is the one step timer: it runs forward and backward passes, the first a warm-up,
and returns the median seconds of the others. :func:`measure_step_time` (``mpicomm plan --measure``) times the
library's ResNet-20 (:mod:`mpicomm.models.resnet`) on 3 x 32 x 32 images or its BERT presets
(:mod:`mpicomm.models.bert`, which need ``transformers``) on 128-token sequences, at the given batch size.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable

import torch

__all__ = ["MEASURABLE", "measure_step_time", "median_pass_seconds"]

MEASURABLE = ("resnet20", "bert-base", "bert-large")


def median_pass_seconds(passes: Iterable[Callable[[], object]], device: torch.device | None = None) -> float:
    """Median seconds of each of ``passes`` (a forward and backward pass each) after the first, a warm-up (0.0
    when there is no other); on a CUDA ``device`` each pass is timed to the end of its kernels."""
    times = []
    for i, one in enumerate(passes):
        t0 = time.perf_counter()
        one()
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) if times else 0.0


def _resnet20(batch: int):
    from ..models.resnet import build_model

    model = build_model("resnet20")
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    return lambda: torch.nn.functional.cross_entropy(model(x), y).backward()


def _bert(preset: str, batch: int):
    from ..models.bert import build_model

    model = build_model(preset, 30522, seed=0)
    ids = torch.randint(5, 30522, (batch, 128))
    return lambda: model(input_ids=ids, labels=ids).loss.backward()


def measure_step_time(model: str, batch: int, repeats: int = 3) -> float:
    """Median seconds of ``repeats`` forward + backward passes of ``model`` at ``batch`` samples (per rank),
    after one warm-up; ``ValueError`` (one line) for a model it cannot build."""
    if model not in MEASURABLE:
        raise ValueError(f"--measure knows {', '.join(MEASURABLE)}, got {model!r}; give --step-time")
    try:
        step = _resnet20(batch) if model == "resnet20" else _bert(model.split("-")[1], batch)
    except ImportError as exc:
        raise ValueError(f"--measure {model}: {exc}; or give --step-time") from None
    return median_pass_seconds([step] * (repeats + 1))
