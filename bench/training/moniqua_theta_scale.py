"""Why 1-bit Moniqua does not train ResNet-20 here: its theta next to each layer's weights and steps.

    python bench/training/moniqua_theta_scale.py [--steps 5,20]

One process trains ResNet-20 on the embedded digits (32 images a step, SGD lr 0.1, momentum 0.9, the
ResNet app's data and model) and, at the given steps, computes what Moniqua's adaptive rule would set:
``theta = 2 C M t_mix`` with C = 1, ``M = max over all coordinates of |lr (mu buf + g)|`` (the local
step) and ``t_mix`` of a 4-rank ring with gamma 0.5 (``mpicomm.algorithms.moniqua.theta.mixing_time``). At
1 bit the quantization error is about theta on every coordinate, every step. Printed per layer: the
largest and median local step, the median |weight|, and theta over each.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "apps")]

import torch  # noqa: E402
from data.image_task import ImageTask  # noqa: E402
from data.images import load_digits32  # noqa: E402
from models.resnet import build_model  # noqa: E402

from bench.common import markdown_table  # noqa: E402
from mpicomm import topology  # noqa: E402
from mpicomm.algorithms.moniqua.theta import mixing_time  # noqa: E402

LR, MOMENTUM, GAMMA, RANKS = 0.1, 0.9, 0.5, 4


def main() -> None:
    """Train, and print the table at each requested step."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="5,20", help="comma list of steps to report")
    args = parser.parse_args()
    report_at = {int(s) for s in args.steps.split(",")}
    torch.set_num_threads(1)
    data = load_digits32(seed=0)
    model = build_model("resnet20", data.num_classes, "batch", seed=0)
    task = ImageTask(model, data, rank=0, size=RANKS, batch_size=32, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    t_mix = mixing_time(topology.ring(RANKS), GAMMA)
    step, epoch = 0, 0
    while step < max(report_at):
        for batch in task.train_batches(epoch):
            opt.zero_grad()
            loss, _ = task.loss(model, batch)
            loss.backward()
            opt.step()
            step += 1
            if step in report_at:
                _report(model, opt, t_mix, step)
            if step >= max(report_at):
                break
        epoch += 1


def _report(model, opt, t_mix: float, step: int) -> None:
    rows = []
    for name, p in model.named_parameters():
        local = (LR * (MOMENTUM * opt.state[p]["momentum_buffer"] + p.grad)).abs().flatten()
        rows.append((name, float(local.max()), float(local.median()), float(p.detach().abs().median())))
    bound, source = max((r[1], r[0]) for r in rows)
    theta = 2 * bound * t_mix
    print(f"\nstep {step}: M = {bound:.3g} (set by {source}), t_mix = {t_mix:.2f}, theta = {theta:.3g}\n")
    header = ["layer", "max step", "median step", "median abs(w)", "theta / median step", "theta / median abs(w)"]
    print(markdown_table(header, [[n, f"{mx:.1e}", f"{med:.1e}", f"{w:.1e}", f"{theta / med:.0f}", f"{theta / w:.1f}"]
                                  for n, mx, med, w in rows if _is_weight(n)]))


def _is_weight(name: str) -> bool:
    """Convolution and classifier weights (BatchNorm parameters left out of the table)."""
    return name.endswith("weight") and ("conv" in name or "fc" in name)


if __name__ == "__main__":
    main()
