"""Recomputing the averaged model's BatchNorm statistics for an evaluation leaves training untouched.

Two 2-rank D-PSGD ResNet-20 runs evaluate after every step, one recomputing the statistics (8 batches per
rank), one not (``--eval-bn-batches 0``): their training losses must be identical and their final
checkpoints (parameters, optimizer state, every rank's BatchNorm buffers, RNG states), read with plain
h5py, equal bit for bit; the recomputation must also have changed what was evaluated. That the recomputed
statistics are the right ones is checked against an independent computation in ``tests/test_export.py``.

The two runs read only their exit status and files, so they run one after another in one 2-rank MPI job
(``run_apps``: Python and torch start once).
"""


import h5py
import numpy as np
import pytest

from .app_runs import RESNET, run_apps, strict_records

BN_BATCHES = {"recompute": 8, "plain": 0}


@pytest.fixture(scope="module")
def app_runs(tmp_path_factory):
    """``(folder, results)``: one run for each of :data:`BN_BATCHES`, run in one batch; each writes into
    ``folder / name``."""
    root = tmp_path_factory.mktemp("eval_bn")
    runs = {name: ("train_resnet.py", [*RESNET, "--algorithm", "dpsgd", "--momentum", "0.9", "--eval-every", "1",
                                       "--eval-bn-batches", str(bn_batches), "--save-every", "4",
                                       "--out-dir", str(root / name)])
            for name, bn_batches in BN_BATCHES.items()}
    return root, run_apps(2, runs, root / "batch")


def _run(app_runs, name: str):
    root, results = app_runs
    out = root / name
    proc = results[name]
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


def test_recomputing_statistics_does_not_touch_training(app_runs):
    recomputed, with_recompute = _run(app_runs, "recompute")
    plain, without = _run(app_runs, "plain")
    losses = [[r["loss"] for r in records if r["event"] == "train"] for records in (with_recompute, without)]
    assert len(losses[0]) == 4 and losses[0] == losses[1]
    a = _datasets(recomputed / "step-000000004" / "checkpoint.h5")
    b = _datasets(plain / "step-000000004" / "checkpoint.h5")
    assert sorted(a) == sorted(b) and any("running_var" in k for k in a)
    for key in a:
        assert np.array_equal(a[key], b[key]), key
    evals = [[r["test_loss"] for r in records if r["event"] == "eval"] for records in (with_recompute, without)]
    assert len(evals[0]) == 4 and evals[0] != evals[1]
