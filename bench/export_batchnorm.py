"""The averaged model's test metrics with averaged vs one rank's BatchNorm statistics, through ``mpicomm export``.

    unshare -n bash -c 'ip link set lo up && python bench/export_batchnorm.py --out-dir /tmp/bn'

Trains ResNet-20 on the embedded digits with ``apps/train_resnet.py`` under ``mpiexec`` (D-PSGD,
momentum 0.9, a Dirichlet(0.1) non-IID split, 5 epochs; a finished run in ``--out-dir`` is reused),
exports the averaged model with ``--buffers average``, ``0`` and ``1``, loads each into a fresh model
and scores it on the whole test set as the app does. The ``0`` row is what ``metrics.jsonl`` reports.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "apps")]

import torch  # noqa: E402
from data.images import load_digits32  # noqa: E402
from models.resnet import build_model  # noqa: E402
from torch.nn import functional as F  # noqa: E402


def main() -> None:
    """Train (unless done), export three ways, print one line per way."""
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
        final = [r for r in map(json.loads, f) if r.get("event") == "eval"][-1]
    print(f"metrics.jsonl: test accuracy {final['test_accuracy']:.4f}, test loss {final['test_loss']:.4f}")
    data = load_digits32(seed=0)
    x, y = data.normalise(data.x_test), data.y_test
    for buffers in ["average", *map(str, range(args.ranks))]:
        out = os.path.join(args.out_dir, f"export-buffers-{buffers}.pt")
        subprocess.run([sys.executable, "-m", "mpicomm", "export", args.out_dir, "-o", out, "--buffers", buffers],
                       check=True, capture_output=True)
        model = build_model("resnet20", data.num_classes, "batch")
        model.load_state_dict(torch.load(out, weights_only=True))
        model.eval()
        with torch.no_grad():
            logits = model(x)
        print(f"--buffers {buffers}: test accuracy {(logits.argmax(1) == y).double().mean():.4f}, "
              f"test loss {F.cross_entropy(logits, y):.4f}")


if __name__ == "__main__":
    main()
