"""The apps' --device and --precision end to end under mpiexec, on the CPU.

bf16 is held to the stored fp32 reference curve of ``resnet-dpsgd-2`` within 5 % per logged loss
(bf16 keeps 8 bits of mantissa; 4 steps at lr 0.1 with momentum 0.9 measured 0.04-3 % here); fp16
(autocast + the agreed loss scale) must train with finite losses, halve its scale once per skipped step, and match the
first fp32 loss (before any update) within 1 %.
"""

import json
import math

import pytest

from mpicomm.training.metrics import read_metrics

from .test_apps import CASES, FIRST_RTOL, REFERENCE, _launch

BF16_FIRST_LOSS_DIFFERS = 10 * FIRST_RTOL  # relative; measured: bf16's first loss is 6.4e-4 below fp32's


def _losses(path) -> tuple[list[float], dict]:
    records = read_metrics(str(path / "metrics.jsonl"))
    return [r["loss"] for r in records if r["event"] == "train"], next(r for r in records if r["event"] == "end")


def test_device_cuda_without_cuda_is_exit_2_with_one_message_and_nothing_trained(tmp_path):
    proc = _launch(2, "train_resnet.py", ["--device", "cuda", "--max-steps", "1", "--no-progress",
                                          "--out-dir", str(tmp_path)], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("--device cuda: CUDA is not available") == 1, proc.stderr[-2000:]  # rank 0 only
    assert not (tmp_path / "metrics.jsonl").exists()


def test_bf16_follows_the_fp32_reference_curve(tmp_path):
    """bf16 is in effect, and trains like fp32: the start event records it, the first loss (before any update,
    which fp32 reproduces to 1e-5 on any CPU) differs from fp32's by more than fp32's own spread, as bf16's
    8-bit mantissa must make it, and every logged loss is within 5 % of the stored fp32 curve."""
    ranks, app, args = CASES["resnet-dpsgd-2"]
    proc = _launch(ranks, app, [*args, "--precision", "bf16", "--out-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses, _ = _losses(tmp_path)
    start = next(r for r in read_metrics(str(tmp_path / "metrics.jsonl")) if r["event"] == "start")
    assert start["train_config"]["precision"] == "bf16", start["train_config"]
    expected = json.load(open(REFERENCE))["resnet-dpsgd-2"]
    assert abs(losses[0] - expected[0]) > BF16_FIRST_LOSS_DIFFERS * expected[0], (losses[0], expected[0])
    assert losses == pytest.approx(expected, rel=0.05), f"bf16 {losses} vs fp32 reference {expected}"


def test_fp16_trains_with_an_agreed_loss_scale(tmp_path):
    ranks, app, args = CASES["resnet-dpsgd-2"]
    args = [a if a != "4" else "2" for a in args]  # --max-steps 2: fp16 convolutions are slow on a CPU
    proc = _launch(ranks, app, [*args, "--precision", "fp16", "--out-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses, end = _losses(tmp_path)
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert 0 <= end["skipped_steps"] <= 2
    assert end["loss_scale"] == 2.0 ** (16 - end["skipped_steps"])  # halved once per skipped step, no growth yet
    expected = json.load(open(REFERENCE))["resnet-dpsgd-2"]
    assert losses[0] == pytest.approx(expected[0], rel=0.01)
