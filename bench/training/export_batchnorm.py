"""The averaged model's test metrics with recomputed, averaged or one rank's BatchNorm statistics.

    unshare -n bash -c 'ip link set lo up && python bench/training/export_batchnorm.py --out-dir /tmp/bn'

Trains ResNet-20 on the embedded digits with ``apps/train_resnet.py`` under ``mpiexec`` (D-PSGD,
momentum 0.9, a Dirichlet(0.1) non-IID split, 5 epochs; a finished run in ``--out-dir`` is reused, whatever
app arguments made it: its seed, batch size, split and model are read from its ``metrics.jsonl``),
exports the averaged model with ``--buffers average`` and each rank's, loads each into a fresh model and
scores it on the run's test set as the app does. The ``recomputed`` row is what the app reports by default
(statistics recomputed for the averaged weights by ``mpicomm.training.batchnorm`` from each rank's first 8
training batches, then averaged over the ranks); ``0`` is what it reported before (``--eval-bn-batches 0``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "apps")]

import torch  # noqa: E402
from data.image_task import ImageTask  # noqa: E402
from data.images import load_digits32  # noqa: E402
from models.resnet import build_model  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from mpicomm.training.batchnorm import norm_layers, recomputed_statistics  # noqa: E402

BN_BATCHES = 8  # the apps' --eval-bn-batches default


def run_options(records: list[dict]) -> dict:
    """The app options of the run that wrote ``records`` (its start record's argv), with the app's defaults."""
    argv = records[0]["argv"]
    out = {"--seed": "0", "--batch-size": "32", "--dirichlet-alpha": "0", "--model": "resnet20"}
    for i, arg in enumerate(argv[:-1]):
        if arg in out:
            out[arg] = argv[i + 1]
    return out


def recomputed(state: dict, model_name: str, data, opts: dict, ranks: int) -> dict:
    """``state`` with BatchNorm statistics recomputed on every rank's batches and averaged over the ranks."""
    per_rank = []
    for rank in range(ranks):
        model = build_model(model_name, data.num_classes, "batch")
        model.load_state_dict(state)
        task = ImageTask(model, data, rank=rank, size=ranks, batch_size=int(opts["--batch-size"]),
                         seed=int(opts["--seed"]), dirichlet_alpha=float(opts["--dirichlet-alpha"]))
        with recomputed_statistics(model, task, BN_BATCHES, None):  # one process: no averaging inside
            per_rank.append([(m.running_mean.clone(), m.running_var.clone()) for m in norm_layers(model)])
    out = build_model(model_name, data.num_classes, "batch")
    out.load_state_dict(state)
    for k, m in enumerate(norm_layers(out)):
        m.running_mean.copy_(sum(r[k][0].double() for r in per_rank) / ranks)
        m.running_var.copy_(sum(r[k][1].double() for r in per_rank) / ranks)
    return out.state_dict()


def main() -> None:
    """Train (unless done), export, print one line per choice of statistics."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    if not os.path.isfile(os.path.join(args.out_dir, "latest")):
        subprocess.run(["mpiexec", "-n", str(args.ranks), sys.executable, os.path.join(ROOT, "apps", "train_resnet.py"),
                        "--model", "resnet20", "--algorithm", "dpsgd", "--momentum", "0.9", "--dirichlet-alpha", "0.1",
                        "--epochs", "5", "--no-progress", "--out-dir", args.out_dir, "--save-every", "100000"],
                       check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    with open(os.path.join(args.out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    final = [r for r in records if r.get("event") == "eval"][-1]
    print(f"metrics.jsonl: test accuracy {final['test_accuracy']:.4f}, test loss {final['test_loss']:.4f}")
    opts = run_options(records)
    data = load_digits32(seed=int(opts["--seed"]))  # the app's data for the run's seed
    x, y = data.normalise(data.x_test), data.y_test
    for buffers in ["recomputed", "average", *map(str, range(args.ranks))]:
        out = os.path.join(args.out_dir, f"export-buffers-{'0' if buffers == 'recomputed' else buffers}.pt")
        subprocess.run([sys.executable, "-m", "mpicomm", "export", args.out_dir, "-o", out, "--buffers",
                        "0" if buffers == "recomputed" else buffers], check=True, capture_output=True)
        state = torch.load(out, weights_only=True)
        if buffers == "recomputed":
            state = recomputed(state, opts["--model"], data, opts, args.ranks)
        model = build_model(opts["--model"], data.num_classes, "batch")
        model.load_state_dict(state)
        model.eval()
        with torch.no_grad():
            logits = model(x)
        print(f"{buffers:>10} statistics: test accuracy {(logits.argmax(1) == y).double().mean():.4f}, "
              f"test loss {F.cross_entropy(logits, y):.4f}")


if __name__ == "__main__":
    main()
