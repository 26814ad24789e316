"""AllReduce-Adam: Adam (decoupled weight decay, i.e. AdamW) on the exactly averaged gradient.

Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015; decoupled weight decay from
Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019. The full-precision
baseline of APMSqueeze (Tang, Gan et al. 2020), whose warm-up runs exactly this code.

Update at step t = 1, 2, ... on every rank (g_i the local stochastic gradient, n ranks)::

    g  = (1/n) sum_i g_i                               # one fp32 allreduce of d floats
    x <- x (1 - lr wd)                                 # decoupled weight decay (AdamW)
    m <- b1 m + (1 - b1) g;     v <- b2 v + (1 - b2) g^2
    x <- x - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

The local step *is* ``torch.optim.AdamW`` over the flat buffer (one parameter whose grad is the
averaged flat gradient), so m, v and t live in the optimizer's state. Weight decay is decoupled
(AdamW), not an L2 term folded into g: APMSqueeze freezes v after its warm-up, and an L2 term
inside g would leak into the frozen preconditioner; decoupled decay keeps the same
``x <- x - lr (update + wd x)`` form in both of its phases. Traffic per step: one allreduce of
4 d bytes, booked by the Ledger at 2 (n - 1) / n * 4 d bytes sent per rank.

With a user optimizer (``optimizer=opt``, e.g. ``torch.optim.AdamW`` over two parameter groups) the
averaged gradient goes to ``opt.step()`` instead of the built-in AdamW (then ``lr``, ``beta1``,
``beta2``, ``eps`` and ``weight_decay`` belong to ``opt``). ``clip_grad_norm_`` clips the averaged g.

A weight that no rank's gradient has reached yet (a branch never taken, an embedding row no batch used) is not
moved, weight decay included (:mod:`~mpicomm.algorithms.shared.reached`), as torch's AdamW leaves a parameter whose
gradient is None.

``shard=True`` (ZeRO-1, :mod:`~mpicomm.algorithms.shared.sharding`): m and v of this rank's 1/n shard only; the
gradient reduce-scattered (exact: bit for bit the unsharded step; or 4/8-bit with error feedback), AdamW on the
shard, the parameters allgathered.

``hierarchical`` (auto: on over several nodes of several ranks) sums g in two levels, as AllReduce-SGD does
(:mod:`~mpicomm.algorithms.shared.hierarchy`): reduce-scatter inside the node, allreduce of each local
rank's shard between nodes, allgather inside the node. Every sum is exact, so the step is the flat one up
to the order of float32 additions. APMSqueeze's warm-up runs this code, two levels included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import Algorithm, AlgorithmConfig, check_range, clone_optimizer_state
from ..shared.hierarchy import HierarchicalConfig, mean_over_ranks, two_level_for
from ..shared.sharding import ShardConfig, Sharding

__all__ = ["AdamConfig", "AllReduceAdam", "AllReduceAdamConfig"]


@dataclass(frozen=True)
class AdamConfig(AlgorithmConfig):
    """Adam options (``lr`` defaults to 1e-3; ``weight_decay`` is decoupled, as in AdamW).

    beta1: first-moment decay in [0, 1), Adam's momentum (so ``momentum`` must stay 0). beta2: second-moment
    decay in [0, 1). eps: added to the square root of the second moment, > 0.
    """

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self):
        super().__post_init__()
        check_range("beta1", self.beta1, lo=0.0, hi=1.0, hi_open=True)
        check_range("beta2", self.beta2, lo=0.0, hi=1.0, hi_open=True)
        check_range("eps", self.eps, lo=0.0, lo_open=True)
        if self.momentum != 0.0:
            raise ValueError(f"momentum must be 0 for Adam-type algorithms (set beta1 instead), got {self.momentum!r}")


@dataclass(frozen=True)
class AllReduceAdamConfig(AdamConfig, HierarchicalConfig, ShardConfig):
    """AllReduce-Adam options: Adam's, hierarchical, shard and shard_bits (see ShardConfig).

    AdamConfig comes first: a dataclass takes a field's default from the last base in reverse method order that
    has the field, and HierarchicalConfig carries every algorithm's ``lr`` of 0.1, which would replace Adam's.
    """


class AllReduceAdam(Algorithm):
    """Adam (AdamW form) on the gradient averaged over all ranks by one fp32 allreduce per step."""

    name = "allreduce_adam"
    config_class = AllReduceAdamConfig
    centralized = True
    clips_average = True
    takes_optimizer = True
    builtin_optimizer_fields = ("lr", "weight_decay", "beta1", "beta2", "eps")
    masks_unreached = True

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        cfg = self.config
        self.sharding = Sharding(self, 8) if cfg.shard else None
        self.param = self._flat_parameter()
        self.optimizer = torch.optim.AdamW(
            [self.param], lr=self.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay
        )
        self.two_level = None if cfg.shard else two_level_for(cfg, comm, self.flat.numel, self.flat.grad)

    def _step(self, grad: torch.Tensor) -> None:
        if self.sharding is not None:
            self.sharding.step(grad, self._adam_update)
        else:
            self._adam_step(grad)

    def _adam_step(self, grad: torch.Tensor, averaged: bool = False) -> None:
        """Average ``grad`` (the flat gradient, in place) over all ranks unless ``averaged``, then one AdamW step."""
        if not averaged:
            mean_over_ranks(grad, self.comm, self.two_level)
        self._clip(grad)
        self._adam_update(grad)

    def _adam_update(self, grad: torch.Tensor) -> None:
        """One AdamW step on the averaged (and clipped) ``grad``: the whole flat one, or this rank's shard."""
        if not self.user_optimizer:
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr
        self.optimizer.step()

    def _zero_unreached(self, reached):
        """Adam's m and v where no gradient has reached (zero already with the exact average; not with a quantized
        reduce-scatter): whole, or this rank's shard of them."""
        offset = self.sharding.lo if self.sharding is not None else 0
        for key in ("exp_avg", "exp_avg_sq"):
            if key in self.adam_state():
                reached.zero(self.adam_state()[key], offset)

    def adam_state(self) -> dict[str, torch.Tensor]:
        """The live Adam buffers ``{"exp_avg": m, "exp_avg_sq": v, "step": t}`` (empty before the first step)."""
        return self.optimizer.state.get(self.param, {})

    def _extra_state(self):
        if self.sharding is not None:
            return {"shard": self.sharding.state_dict(self.optimizer)}
        return {"optimizer": clone_optimizer_state(self.optimizer)}

    def _resize_rules(self):
        """Sharded: the shard's optimizer state is re-cut by the new ownership."""
        rules = super()._resize_rules()
        return {**rules, **Sharding.resize_rules("extra.shard")} if self.sharding is not None else rules

    def _load_extra_state(self, extra):
        if self.sharding is not None:
            self.sharding.load_state_dict(self.optimizer, extra["shard"])
            return
        state = extra["optimizer"]
        # Load copies, so the restored buffers never alias the tensors of the caller's dictionary.
        self.optimizer.load_state_dict({
            "state": {k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in s.items()}
                      for k, s in state["state"].items()},
            "param_groups": [dict(g) for g in state["param_groups"]],
        })
