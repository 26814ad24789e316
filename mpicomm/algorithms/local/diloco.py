"""DiLoCo: H local steps of any inner optimizer, then an outer Nesterov step on the averaged pseudo-gradient.

Douillard et al. "DiLoCo: Distributed Low-Communication Training of Language Models." 2023 (arXiv:2311.08455).

Step t on rank i (H = ``period``; x_g the global copy, the same on every rank; eta = ``outer_lr``,
mu = ``outer_momentum``)::

    x_i <- InnerOpt(x_i, g_i)       (torch.optim.SGD from lr/momentum/weight_decay; inner_optimizer="adamw":
                                     torch.optim.AdamW from lr/beta1/beta2/eps/weight_decay, the paper's; or yours)
    if (t + 1) mod H == 0:
        Delta_i = x_g - x_i                          (the pseudo-gradient)
        Delta   = (1/n) allreduce_sum(Delta_i)
        m <- mu m + Delta;  x_g <- x_g - eta (Delta + mu m)     (torch.optim.SGD, nesterov=True)
        x_i <- x_g

A weight that no rank's gradient has reached yet (a branch never taken, an embedding row no batch used) is not
moved by the outer step, and with the built-in inner step not by the inner steps where this rank's gradient has
not reached it, weight decay included (:mod:`~mpicomm.algorithms.shared.reached`); the ranks agree on what was
reached at the outer steps only.

With ``codec`` set, Delta_i is compressed with error feedback: p_i = Delta_i + e_i, e_i <- p_i - C(p_i),
Delta = (1/n) sum_r C(p_r) (payloads allgathered, summed in MPICH's allreduce order, so ``identity`` gives
the uncompressed run bit for bit). Traffic: nothing between syncs; a sync is one allreduce of 4d bytes, or
one allgather of ``codec.payload_bytes(d)``. H = 1, eta = 1, mu = 0 and inner SGD is ``allreduce_sgd``
up to rounding. Options and reasoning: ``docs/algorithms/diloco.md``.

``hierarchical`` (auto: on over several nodes of several ranks; :mod:`~mpicomm.algorithms.shared.hierarchy`):
the sum of the Delta_i in two levels, the node's exact sum of each local rank's shard (reduce-scatter inside
the node), the allreduce (or the codec's error-fed allgather, e per node and shard) of it between nodes, the
allgather inside the node. Uncompressed it is DiLoCo up to the order of float32 additions; compressed, the N
nodes are the participants whose summed pseudo-gradients are compressed.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch

from ...checkpoint.resize_rules import own_rank, residual_mean
from ..base import Algorithm, AlgorithmConfig, check_bool, check_range, clone_optimizer_state
from ..shared.allgather_sum import PayloadSum
from ..shared.codec_options import check_codec, make_rank_codec
from ..shared.hierarchy import HierarchicalConfig, two_level_for
from ..shared.periodic import check_period

__all__ = ["INNER_OPTIMIZERS", "DiLoCo", "DiLoCoConfig", "OuterConfig", "OuterLoop", "OuterMomentumConfig"]

INNER_OPTIMIZERS = ("sgd", "adamw")


@dataclass(frozen=True)
class OuterConfig(AlgorithmConfig):
    """Options of the local-update methods with an outer step; lr, momentum and weight_decay set the inner step.

    period: inner steps between two outer steps, H >= 1. outer_lr: step size of the outer SGD on the
    pseudo-gradient, > 0. inner_optimizer: the built-in inner step, sgd (torch.optim.SGD with momentum; weight
    decay as an L2 term) or adamw (torch.optim.AdamW, decoupled weight decay, as in the DiLoCo paper; momentum
    must stay 0). beta1: AdamW's first-moment decay, in [0, 1) (inner_optimizer adamw only). beta2: AdamW's
    second-moment decay, in [0, 1) (adamw only). eps: AdamW's epsilon, > 0 (adamw only).
    """

    period: int = 10
    outer_lr: float = 0.7
    inner_optimizer: str = "sgd"
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self):
        super().__post_init__()
        check_period(self.period)
        check_range("outer_lr", self.outer_lr, lo=0.0, lo_open=True)
        if self.inner_optimizer not in INNER_OPTIMIZERS:
            raise ValueError(f"inner_optimizer must be one of {INNER_OPTIMIZERS}, got {self.inner_optimizer!r}")
        check_range("beta1", self.beta1, lo=0.0, hi=1.0, hi_open=True)
        check_range("beta2", self.beta2, lo=0.0, hi=1.0, hi_open=True)
        check_range("eps", self.eps, lo=0.0, lo_open=True)
        if self.inner_optimizer == "adamw" and self.momentum != 0.0:
            raise ValueError(f"momentum must be 0 with inner_optimizer 'adamw' (set beta1 instead), got "
                             f"{self.momentum!r}")
        if self.inner_optimizer == "sgd":
            changed = [f for f in ("beta1", "beta2", "eps") if getattr(self, f) != getattr(OuterConfig, f)]
            if changed:
                raise ValueError(f"{', '.join(changed)} set the AdamW inner step: add inner_optimizer 'adamw' "
                                 f"(the inner step is SGD)")


@dataclass(frozen=True)
class OuterMomentumConfig(OuterConfig):
    """outer_momentum: momentum of the outer SGD, in [0, 1). outer_nesterov: Nesterov's form of it (the
    paper's); False: heavy ball.
    """

    outer_momentum: float = 0.9
    outer_nesterov: bool = True

    def __post_init__(self):
        super().__post_init__()
        check_range("outer_momentum", self.outer_momentum, lo=0.0, hi=1.0, hi_open=True)
        check_bool("outer_nesterov", self.outer_nesterov)


class OuterLoop(Algorithm):
    """H inner steps of the local optimizer, then :meth:`_average` of the pseudo-gradient and an outer SGD step.

    ``global_params`` (x_g) is the outer optimizer's parameter and ``outer_grad`` its gradient; both, the
    outer optimizer's state and the inner optimizer's are in ``state_dict()``.
    """

    resize_family = "outer"
    masks_unreached = True

    takes_optimizer = True
    builtin_optimizer_fields = ("lr", "momentum", "weight_decay", "inner_optimizer", "beta1", "beta2", "eps")

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        self.period = self.config.period
        self.optimizer = self._inner_adamw() if self._adamw else self._local_sgd()
        self.two_level = None  # a method with a two-level sum sets its TwoLevel here
        self.global_params = self.flat.data.detach().clone()
        self.outer_grad = torch.zeros_like(self.global_params)
        param = torch.nn.Parameter(self.global_params, requires_grad=False)
        param.grad = self.outer_grad
        mu = float(getattr(self.config, "outer_momentum", 0.0))
        self.outer_optimizer = torch.optim.SGD([param], lr=self.config.outer_lr, momentum=mu,
                                               nesterov=bool(mu and getattr(self.config, "outer_nesterov", False)))

    def _masking(self) -> bool:
        """The outer step is always built in: it leaves unreached weights alone with a user's inner optimizer too."""
        return self.reached is not None

    def _agrees_now(self) -> bool:
        """The ranks agree on what was reached at each outer step only: the inner steps exchange nothing."""
        return (self.step_count + 1) % self.period == 0

    def _unreached_kept(self):
        """x_g where no rank has reached; with the built-in inner step, the model where this rank has not."""
        return [self.global_params], ([] if self.user_optimizer else [self.flat.data])

    def _zero_unreached(self, reached):
        """The outer momentum where no rank has reached, the built-in inner step's state where this rank has not."""
        start = self.global_params.storage_offset()
        for group in self.outer_optimizer.param_groups:
            for param in group["params"]:  # x_g, or one fragment of it
                buffer = self.outer_optimizer.state.get(param, {}).get("momentum_buffer")
                if buffer is not None:
                    reached.zero(buffer, param.storage_offset() - start)
        if not self.user_optimizer:
            for state in self.optimizer.state.values():
                for key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
                    if state.get(key) is not None:
                        reached.zero(state[key], which="local")

    @property
    def _adamw(self) -> bool:
        """Whether the built-in inner step is AdamW (its weight decay is decoupled, not folded into the gradient)."""
        return self.config.inner_optimizer == "adamw" and not self.user_optimizer

    def _inner_adamw(self) -> torch.optim.AdamW:
        """``torch.optim.AdamW`` over the flat buffer, from lr, beta1, beta2, eps and weight_decay."""
        cfg = self.config
        return torch.optim.AdamW([self._flat_parameter()], lr=self.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                 weight_decay=cfg.weight_decay)

    def _decayed(self, grad: torch.Tensor) -> torch.Tensor:
        return grad if self._adamw else super()._decayed(grad)

    def _step(self, grad: torch.Tensor) -> None:
        self._decayed(grad)
        self._local_step()
        if (self.step_count + 1) % self.period == 0:
            self._outer_step((self.step_count + 1) // self.period - 1)

    def _outer_step(self, round_index: int) -> None:
        """``outer_grad <- average of x_g - x_i``; x_g <- outer SGD step; x_i <- x_g."""
        torch.sub(self.global_params, self.flat.data, out=self.outer_grad)
        self._average(self.outer_grad, round_index)
        self.outer_optimizer.step()
        self.flat.data.copy_(self.global_params)

    @abc.abstractmethod
    def _average(self, delta: torch.Tensor, round_index: int) -> None:
        """Communication round ``round_index``: replace this rank's pseudo-gradient ``delta`` by the average used."""

    @property
    def between(self):
        """The Communicator the method's exchange spans: the world, or (``self.two_level``) this local rank's
        ranks on every node."""
        return self.comm if self.two_level is None else self.two_level.cross

    def _summed(self, delta: torch.Tensor, exchange) -> None:
        """Collective: ``delta`` <- its sum over all ranks by ``exchange(v)``, the method's in-place sum of ``v``
        over :attr:`between`: of ``delta`` itself, or (``self.two_level``) of the node's sum of this rank's
        shard, then every shard back inside the node."""
        levels = self.two_level
        if levels is None:
            exchange(delta)
            return
        shard = levels.reduce(delta)
        exchange(shard)
        levels.spread(delta, shard)

    def _extra_state(self):
        return {"optimizer": clone_optimizer_state(self.optimizer),
                "outer_optimizer": clone_optimizer_state(self.outer_optimizer),
                "global_params": self.global_params.clone()}

    def _load_extra_state(self, extra):
        self.optimizer.load_state_dict(extra["optimizer"])
        self.outer_optimizer.load_state_dict(extra["outer_optimizer"])
        self.global_params.copy_(extra["global_params"])


@dataclass(frozen=True)
class DiLoCoConfig(HierarchicalConfig, OuterMomentumConfig):
    """DiLoCo options (outer SGD with Nesterov momentum 0.9 at outer_lr 0.7 by default).

    codec: compress the pseudo-gradient with this codec of mpicomm.codecs.CODECS and error feedback (none:
    an uncompressed allreduce; "uniform" with codec_options bits=4 is 4-bit). codec_options: its keyword
    arguments (no seed). hierarchical: see the module docstring.
    """

    codec: str | None = None
    codec_options: dict = field(default_factory=dict)

    def __post_init__(self):
        super().__post_init__()
        if self.codec is None:
            if self.codec_options:
                raise ValueError(f"codec_options {self.codec_options!r} need a codec (codec is None: uncompressed)")
            return
        object.__setattr__(self, "codec_options", check_codec(self.codec, self.codec_options, self.seed))


class DiLoCo(OuterLoop):
    """DiLoCo: H inner steps, then outer Nesterov SGD on the allreduced pseudo-gradient (optionally compressed)."""

    name = "diloco"
    config_class = DiLoCoConfig
    resize_sharded = True

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        self.two_level = levels = two_level_for(self.config, comm, self.flat.numel, self.flat.data)
        self.codec = None
        if self.config.codec is not None:
            numel = self.flat.numel if levels is None else levels.hi - levels.lo
            self.codec = make_rank_codec(self.config, self.comm.rank)
            self.payload_sum = PayloadSum(self.between, self.codec, numel)
            self.error = torch.zeros(numel, dtype=self.flat.data.dtype, device=self.flat.data.device)

    def _average(self, delta, round_index):
        self._summed(delta, self._sum if self.codec is None else self._compressed_sum)
        delta.div_(self.comm.size)

    def _sum(self, v: torch.Tensor) -> None:
        """``v`` <- its exact sum over :attr:`between`."""
        self.between.allreduce(v)

    def _compressed_sum(self, v: torch.Tensor) -> None:
        """``v`` <- sum over :attr:`between` of C(p_r), p = v + e, e <- p - C(p)."""
        v.add_(self.error)  # p = Delta + e
        payload = self.codec.encode(v)
        self.codec.decode(payload, v.numel(), out=self.error)
        torch.sub(v, self.error, out=self.error)  # e <- p - C(p)
        self.payload_sum(payload, out=v)

    def _extra_state(self):
        state = super()._extra_state()
        if self.codec is not None:
            state.update(codec=self.codec.state_dict(), error=self.error.clone())
        return state

    def _resize_rules(self):
        """On a resize each rank's compression residual is the saved residuals' mean (:func:`residual_mean`: what
        is still owed is kept) and its codec generator its own."""
        rules = super()._resize_rules()
        if self.codec is not None:
            rules.update({"extra.error": residual_mean, "extra.codec": own_rank})
        return rules

    def _load_extra_state(self, extra):
        super()._load_extra_state(extra)
        if self.codec is not None:
            self.codec.load_state_dict(extra["codec"])
            self.error.copy_(extra["error"])
