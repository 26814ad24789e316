"""A training app around an MLP of a chosen size, for the recovery benchmarks (the apps' models are fixed sizes).

    scripts/ft_run.sh -n 4 python bench/recovery/mlp_app.py --params-m 10 --algorithm dpsgd --on-rank-loss continue

Every option of ``apps/train_resnet.py``'s shared set (``--on-rank-loss``, ``--save-every``, ``--resume`` …)
applies: it is the same :func:`~mpicomm.training.apprun.run_app` around another Task. Data: the embedded digits
(1,438 training images of 3x32x32, 10 classes), through the image app's own ``ImageTask``. Model:
``3072 -> W -> W -> 10`` with ReLUs, ``W`` chosen so that the parameters come to about ``--params-m`` million
(``W**2 + 3084 W + 10``).
"""

from __future__ import annotations

import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "apps"))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from data.image_task import ImageTask  # noqa: E402
from data.images import load_dataset  # noqa: E402

from mpicomm.training.apprun import run_app  # noqa: E402
from mpicomm.training.arguments import app_parser  # noqa: E402

INPUTS, CLASSES = 3 * 32 * 32, 10  # the digits as the image app loads them


def width_for(params_m: float) -> int:
    """The hidden width ``W`` whose MLP has about ``params_m`` million parameters."""
    b = INPUTS + 2 + CLASSES  # W**2 + (INPUTS + 2 + CLASSES) W + CLASSES = params
    return max(1, round((-b + math.sqrt(b * b + 4 * params_m * 1e6)) / 2))


def mlp_params(params_m: float) -> int:
    """The exact number of parameters of :func:`build_mlp`'s model."""
    w = width_for(params_m)
    return w * w + (INPUTS + 2 + CLASSES) * w + CLASSES


def build_mlp(params_m: float, seed: int) -> torch.nn.Module:
    """The seeded ``3072 -> W -> W -> 10`` ReLU MLP of about ``params_m`` million parameters."""
    width = width_for(params_m)
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(INPUTS, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, CLASSES))


def build_parser():
    """The shared app options plus ``--params-m`` and ``--batch-size``."""
    p = app_parser(__doc__.splitlines()[0], default_algorithm="allreduce_sgd", epochs=3)
    p.add_argument("--params-m", type=float, default=1.0, help="the MLP's size, millions of parameters")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    return p


def build_task(args, rank: int, size: int) -> ImageTask:
    """The digits and the MLP for this rank."""
    if args.params_m <= 0:
        raise ValueError(f"--params-m must be positive, got {args.params_m}")
    data = load_dataset("digits", "", seed=args.seed)
    return ImageTask(build_mlp(args.params_m, args.seed), data, rank=rank, size=size, batch_size=args.batch_size,
                     seed=args.seed, augment_images=False)


def main(argv=None) -> int:
    """Train the MLP under ``run_app``."""
    return run_app("mlp_app", build_parser(), build_task, argv,
                   settings=lambda args: {"--params-m": args.params_m, "--batch-size": args.batch_size},
                   headline=("test_accuracy", "final test accuracy of the averaged model"))


if __name__ == "__main__":
    sys.exit(main())
