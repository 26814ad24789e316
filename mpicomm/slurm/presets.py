"""The named job templates: ``slurm/<name>.sbatch`` is ``slurm/generic.sbatch`` rendered with these settings.

Edit a preset here, then run ``mpicomm slurm regenerate``; ``tests/test_slurm_templates.py`` fails if a
checked-in template drifts from its preset. Paper settings: Moniqua trains ResNet-20/110 on CIFAR-10 with 8
workers on a ring (Lu & De Sa 2020); CPD-SGDM and APMSqueeze use ResNet-18 on CIFAR-10; APMSqueeze
pre-trains BERT-Base and BERT-Large (Tang et al. 2020). Data paths are placeholders to adapt per site.
"""

from __future__ import annotations

__all__ = ["PRESETS"]

_CIFAR = "--data-dir data/cifar-10-batches-py --batch-size 16 --momentum 0.9 --weight-decay 1e-4 --lr-schedule step"
_GPU = {"nodes": "1", "ntasks-per-node": "8", "gpus-per-task": "1", "cpus-per-task": "4"}

PRESETS: dict[str, dict[str, str]] = {
    "resnet20_moniqua": {
        **_GPU, "job-name": "r20-moniqua", "time": "12:00:00", "APP": "apps/train_resnet.py",
        "ALGORITHM": "moniqua", "EPOCHS": "200", "SAVE_EVERY": "1000",
        "EXTRA_ARGS": f"--model resnet20 --bits 1 --lr 0.1 {_CIFAR}",
    },
    "resnet110_moniqua": {
        **_GPU, "job-name": "r110-moniqua", "time": "2-00:00:00", "APP": "apps/train_resnet.py",
        "ALGORITHM": "moniqua", "EPOCHS": "200", "SAVE_EVERY": "1000",
        "EXTRA_ARGS": f"--model resnet110 --bits 1 --lr 0.1 {_CIFAR}",
    },
    "resnet18_cpdsgdm": {
        **_GPU, "job-name": "r18-cpdsgdm", "time": "12:00:00", "APP": "apps/train_resnet.py",
        "ALGORITHM": "cpdsgdm", "EPOCHS": "200", "SAVE_EVERY": "1000",
        "EXTRA_ARGS": f"--model resnet18 --codec sign --period 4 --gamma 0.5 --lr 0.1 {_CIFAR}",
    },
    "resnet18_apmsqueeze": {
        **_GPU, "job-name": "r18-apmsqueeze", "time": "12:00:00", "APP": "apps/train_resnet.py",
        "ALGORITHM": "apmsqueeze", "EPOCHS": "200", "SAVE_EVERY": "1000", "TOPOLOGY": "complete",
        "EXTRA_ARGS": "--model resnet18 --warmup-fraction 0.15 --lr 1e-3 --data-dir data/cifar-10-batches-py "
                      "--batch-size 16 --lr-schedule step",
    },
    "bert_base_apmsqueeze": {
        "nodes": "4", "ntasks-per-node": "8", "gpus-per-task": "1", "cpus-per-task": "4",
        "job-name": "bert-base-apms", "time": "3-00:00:00", "APP": "apps/train_bert.py",
        "ALGORITHM": "apmsqueeze", "EPOCHS": "40", "SAVE_EVERY": "2000", "TOPOLOGY": "complete",
        "EXTRA_ARGS": "--preset base --data data/corpus --seq-len 128 --batch-size 32 --lr 4e-4 "
                      "--warmup-fraction 0.2 --lr-warmup-steps 10000 --lr-schedule cosine",
    },
    "bert_large_apmsqueeze": {
        "nodes": "8", "ntasks-per-node": "8", "gpus-per-task": "1", "cpus-per-task": "4",
        "job-name": "bert-large-apms", "time": "5-00:00:00", "APP": "apps/train_bert.py",
        "ALGORITHM": "apmsqueeze", "EPOCHS": "40", "SAVE_EVERY": "2000", "TOPOLOGY": "complete",
        "EXTRA_ARGS": "--preset large --data data/corpus --seq-len 128 --batch-size 16 --lr 2e-4 "
                      "--warmup-fraction 0.2 --lr-warmup-steps 10000 --lr-schedule cosine",
    },
}
