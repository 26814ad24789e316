"""Train a CIFAR ResNet with any mpicomm algorithm.

    mpiexec -n 4 python apps/train_resnet.py --algorithm moniqua --bits 1 --epochs 3
    mpiexec -n 8 python apps/train_resnet.py --dataset mnist --algorithm moniqua --epochs 2 --out-dir runs/mnist
    mpiexec -n 8 python apps/train_resnet.py --dataset mnist1d --algorithm dpsgd --epochs 10 --out-dir runs/m1d
    mpiexec -n 8 python apps/train_resnet.py --data-dir ~/data/cifar10 --model resnet20 --algorithm dpsgd \\
        --epochs 160 --lr 0.1 --momentum 0.9 --weight-decay 5e-4 --lr-schedule step --out-dir runs/r20 --save-every 500

Without ``--dataset`` or ``--data-dir`` it trains on the embedded default (scikit-learn's real digit scans
upsampled to 32x32), so it runs on a fresh machine with no download; ``--dataset mnist`` takes the 60,000
MNIST digits the set-up fetched; ``--dataset mnist1d`` trains a small 1-D CNN on MNIST-1D's sequences,
generated offline on first use. ``--help`` lists every option, including the
chosen algorithm's (``--algorithm NAME --help``). Rank 0 shows a progress bar and writes
``--out-dir/metrics.jsonl``; ``mpicomm plot`` turns metrics files into curves.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mpicomm.training.console import announce_start  # noqa: E402  (light: before the slow imports)

announce_start("train_resnet", "importing torch")

from data.image_task import ImageTask, check_sizes  # noqa: E402
from data.images import DATASETS, load_dataset  # noqa: E402
from models.conv1d import CONV1D_MODELS, build_conv1d  # noqa: E402
from models.resnet import MODELS, build_model, check_model  # noqa: E402

from mpicomm.training.apprun import run_app  # noqa: E402
from mpicomm.training.arguments import app_parser  # noqa: E402


def build_parser():
    """The app's parser: shared training options plus data and model options."""
    p = app_parser(__doc__.splitlines()[0], default_algorithm="moniqua", epochs=3)
    p.add_argument("--model", default="", help=f"one of {', '.join(sorted(MODELS))} (images) or "
                                                f"{', '.join(CONV1D_MODELS)} (mnist1d's sequences); "
                                                "default: conv1d with --dataset mnist1d, else resnet20")
    p.add_argument("--norm", default="batch", choices=["batch", "group"],
                   help="the model's normalisation layers: BatchNorm, or GroupNorm (no running statistics)")
    p.add_argument("--dataset", default="", choices=["", *DATASETS], metavar="{" + ",".join(DATASETS) + "}",
                   help="digits (embedded, 1,438 training images), mnist (60,000; fetched once by the set-up: "
                        "python apps/fetch_data.py mnist), mnist1d (40,000 sequences of 40 values, generated "
                        "offline on first use) or cifar10 (needs --data-dir); "
                        "default: cifar10 with --data-dir, else digits")
    p.add_argument("--data-dir", default="", help="the folder of CIFAR-10's python archive (cifar-10-batches-py)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--dirichlet-alpha", type=float, default=0.0, help="non-IID label split (0: IID shards)")
    p.add_argument("--no-augment", action="store_true", help="no random crop / flip")
    p.add_argument("--eval-limit", type=int, default=0, help="evaluate on the first N test images (0: all)")
    return p


def dataset_of(args) -> str:
    """The dataset the run trains on: ``--dataset``, else cifar10 with ``--data-dir``, else digits."""
    return args.dataset or ("cifar10" if args.data_dir else "digits")


def model_of(args) -> str:
    """The model the run trains: ``--model``, else conv1d for mnist1d's sequences, else resnet20."""
    return args.model or ("conv1d" if dataset_of(args) == "mnist1d" else "resnet20")


def run_settings(args) -> dict:
    """This app's options a run's trajectory depends on, by flag: a resume compares them with the checkpoint's.

    ``--data-dir`` is a path and not compared (the archive may move); ``--eval-limit`` only evaluates.
    """
    return {"--dataset": dataset_of(args), "--model": model_of(args), "--norm": args.norm,
            "--batch-size": args.batch_size, "--dirichlet-alpha": args.dirichlet_alpha, "--no-augment": args.no_augment}


def check_args(args) -> None:
    """This app's option values that need no data, refused (``ValueError``) before anything is built: by the
    launch and by ``mpicomm slurm check`` (the rules are the model's and the task's own)."""
    model = model_of(args)
    if model not in CONV1D_MODELS:
        check_model(model, args.norm)
    if (model in CONV1D_MODELS) != (dataset_of(args) == "mnist1d"):
        raise ValueError(f"--model {model} does not fit --dataset {dataset_of(args)}: {', '.join(CONV1D_MODELS)} "
                         "takes mnist1d's sequences, the ResNets take images")
    check_sizes(args.batch_size, args.eval_limit)


def build_task(args, rank: int, size: int) -> ImageTask:
    """Data and model for this rank."""
    data = load_dataset(dataset_of(args), args.data_dir, seed=args.seed)
    if model_of(args) in CONV1D_MODELS:
        model = build_conv1d(data.num_classes, data.x_train.shape[-1], seed=args.seed)
    else:
        model = build_model(model_of(args), data.num_classes, args.norm, seed=args.seed, in_channels=data.channels)
    return ImageTask(model, data, rank=rank, size=size, batch_size=args.batch_size, seed=args.seed,
                     dirichlet_alpha=args.dirichlet_alpha, augment_images=not args.no_augment,
                     eval_limit=args.eval_limit)


def main(argv=None) -> int:
    """Parse, set up on every rank, train, and print the final summary on rank 0."""
    return run_app("train_resnet", build_parser(), build_task, argv, settings=run_settings, check=check_args,
                   headline=("test_accuracy", "final test accuracy of the averaged model"))


if __name__ == "__main__":
    sys.exit(main())
