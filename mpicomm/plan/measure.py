"""``mpicomm plan --measure``: the compute seconds of one training step of an app model on this machine.

Times a few forward and backward passes (after one warm-up) of the apps' ResNet-20 on 3 x 32 x 32 images or
their BERT presets on 128-token sequences, at the given batch size, and returns the median. The apps'
models live in the checkout's ``apps/`` folder, which must be present.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

__all__ = ["MEASURABLE", "measure_step_time"]

MEASURABLE = ("resnet20", "bert-base", "bert-large")


def _apps() -> Path:
    apps = Path(__file__).resolve().parents[2] / "apps"
    if not (apps / "models").is_dir():
        raise ValueError(f"--measure needs the checkout's apps/ folder (not found at {apps}); give --step-time")
    if str(apps) not in sys.path:
        sys.path.insert(0, str(apps))
    return apps


def _resnet20(batch: int):
    _apps()
    from models.resnet import build_model

    model = build_model("resnet20")
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    return lambda: torch.nn.functional.cross_entropy(model(x), y).backward()


def _bert(preset: str, batch: int):
    _apps()
    from bert.model import build_model

    model = build_model(preset, 30522, seed=0)
    ids = torch.randint(5, 30522, (batch, 128))
    return lambda: model(input_ids=ids, labels=ids).loss.backward()


def measure_step_time(model: str, batch: int, repeats: int = 3) -> float:
    """Median seconds of ``repeats`` forward + backward passes of ``model`` at ``batch`` samples (per rank)."""
    if model not in MEASURABLE:
        raise ValueError(f"--measure knows {', '.join(MEASURABLE)}, got {model!r}; give --step-time")
    step = _resnet20(batch) if model == "resnet20" else _bert(model.split("-")[1], batch)
    step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
