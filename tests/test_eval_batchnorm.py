"""Recomputing the averaged model's BatchNorm statistics for an evaluation leaves training untouched.

Two 2-rank D-PSGD ResNet-20 runs evaluate after every step, one recomputing the statistics (8 batches per
rank), one not (``--eval-bn-batches 0``): their training losses must be identical and their final
checkpoints (parameters, optimizer state, every rank's BatchNorm buffers, RNG states), read with plain
h5py, equal bit for bit; the recomputation must also have changed what was evaluated. That the recomputed
statistics are the right ones is checked against an independent computation in ``tests/test_export.py``.
"""


import h5py
import numpy as np

from .app_runs import RESNET, launch, strict_records


def _run(tmp_path, name: str, bn_batches: int):
    out = tmp_path / name
    proc = launch(2, "train_resnet.py", [*RESNET, "--algorithm", "dpsgd", "--momentum", "0.9", "--eval-every", "1",
                                         "--eval-bn-batches", str(bn_batches), "--save-every", "4",
                                         "--out-dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = strict_records(out / "metrics.jsonl")
    return out, records


def _datasets(path) -> dict[str, np.ndarray]:
    """Every dataset of the ranks' state that training depends on (not counters, clocks, configs, or the
    evaluated model the final checkpoint keeps for export)."""
    out = {}

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset) and "/counters/" not in f"/{name}/" and "config" not in name \
                and "/evaluated/" not in f"/{name}/":
            out[name] = obj[()]

    with h5py.File(path, "r") as f:
        for rank in f["ranks"]:  # external links to the per-rank files, which visititems does not follow
            f["ranks"][rank].visititems(lambda name, obj, rank=rank: visit(f"{rank}/{name}", obj))
    return out


def test_recomputing_statistics_does_not_touch_training(tmp_path):
    recomputed, with_recompute = _run(tmp_path, "recompute", 8)
    plain, without = _run(tmp_path, "plain", 0)
    losses = [[r["loss"] for r in records if r["event"] == "train"] for records in (with_recompute, without)]
    assert len(losses[0]) == 4 and losses[0] == losses[1]
    a = _datasets(recomputed / "step-000000004" / "checkpoint.h5")
    b = _datasets(plain / "step-000000004" / "checkpoint.h5")
    assert sorted(a) == sorted(b) and any("running_var" in k for k in a)
    for key in a:
        assert np.array_equal(a[key], b[key]), key
    evals = [[r["test_loss"] for r in records if r["event"] == "eval"] for records in (with_recompute, without)]
    assert len(evals[0]) == 4 and evals[0] != evals[1]
