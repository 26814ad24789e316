"""``--no-decay-bias-norm``: parameter groups without weight decay on biases and norm weights, and the app's optimizer.

The usual recipe for BERT and ResNets (Goyal et al. 2017; Devlin et al. 2019): weight decay on
weights of linear and convolution layers only, none on biases or on the affine parameters of
BatchNorm, GroupNorm and LayerNorm. The app then hands the algorithm a torch optimizer over the two
groups (``optimizer=``, :meth:`~mpicomm.algorithms.base.Algorithm.use_optimizer`) built from the
algorithm's own ``lr``/``momentum``/``weight_decay`` (or AdamW's ``beta1``/``beta2``/``eps``) options.
"""

from __future__ import annotations

import torch

from ..algorithms import ALGORITHMS

__all__ = ["NORMS", "app_optimizer", "decay_groups"]

NORMS = (torch.nn.modules.batchnorm._NormBase, torch.nn.GroupNorm, torch.nn.LayerNorm, torch.nn.LocalResponseNorm)


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups of ``model``'s trainable parameters: ``weight_decay`` on the rest, 0 on biases and norm weights.

    A parameter belongs to the second group if its name is ``bias`` or its module is a norm layer
    (:data:`NORMS`, subclasses included, e.g. ``transformers``' LayerNorm). Order follows ``model.modules()``;
    a parameter shared by two modules (BERT's decoder weight and bias, tied to the embeddings) is listed
    once, where it first appears.
    """
    decayed, plain, seen = [], [], set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                (plain if name == "bias" or isinstance(module, NORMS) else decayed).append(p)
    return [{"params": decayed, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


def app_optimizer(algorithm: str, model: torch.nn.Module, options: dict) -> torch.optim.Optimizer:
    """The optimizer of ``--no-decay-bias-norm`` for ``algorithm``; pops its fields from ``options``.

    ``allreduce_adam`` and the local-update methods with ``inner_optimizer`` adamw: ``torch.optim.AdamW`` (their
    beta1/beta2/eps); every other algorithm that takes an optimizer: ``torch.optim.SGD`` with its momentum.
    Raises ``ValueError`` for an algorithm that refuses one.
    """
    cls = ALGORITHMS[algorithm]
    if not cls.takes_optimizer:
        raise ValueError(f"--no-decay-bias-norm needs an algorithm that accepts an optimizer "
                         f"({', '.join(sorted(n for n, c in ALGORITHMS.items() if c.takes_optimizer))}); "
                         f"{algorithm}: {cls.optimizer_refusal}")
    cls.config_class(**options)  # the same checks (and messages) as without the flag
    defaults = cls.config_class()
    value = {f: options.pop(f, getattr(defaults, f)) for f in cls.builtin_optimizer_fields}
    groups = decay_groups(model, value["weight_decay"])
    if value.get("inner_optimizer", "adamw" if "beta1" in value else "sgd") == "adamw":
        return torch.optim.AdamW(groups, lr=value["lr"], betas=(value["beta1"], value["beta2"]), eps=value["eps"])
    return torch.optim.SGD(groups, lr=value["lr"], momentum=value["momentum"])
