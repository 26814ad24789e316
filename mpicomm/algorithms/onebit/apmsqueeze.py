"""APMSqueeze: Adam-preconditioned momentum SGD with two-sided error-compensated 1-bit compression.

Tang, Gan, Rajbhandari, Lian, Liu, Zhang, He. "APMSqueeze: A Communication Efficient
Adam-Preconditioned Momentum SGD Algorithm", arXiv:2008.11343, 2020 (the basis of DeepSpeed's
1-bit Adam: Tang et al., "1-bit Adam", ICML 2021).

Warm-up, steps t = 1 .. T_w: exactly :class:`~mpicomm.algorithms.centralized.adam.AllReduceAdam`. From
step T_w + 1 on, v is frozen and, on rank i::

    m_i   = b1 m + (1 - b1) g_i                     # m: the shared momentum of the last step
    m    <- OneBitAverage(m_i)                      # two-sided error-compensated 1-bit average
    x    <- x (1 - lr wd) - lr / (1 - b1^t) * m / vhat,    vhat = max(sqrt(v_Tw) / sqrt(1 - b2^T_w), F) + eps

T_w: ``warmup_steps``, or ``warmup_fraction`` of ``total_steps``; given neither, decided while training
(:mod:`~mpicomm.algorithms.onebit.freeze`): the first step past 20 % of the run at which Adam's typical
denominator has settled, 50 % at the latest.

F = denominator_floor (default 0.01) times the mean of that denominator over the model: a coordinate the
warm-up barely saw (v ~ 0) moves by about lr / denominator_floor, not lr * scale / eps
(:mod:`~mpicomm.algorithms.onebit.floor`); 0 is the published method.

``hierarchical`` (auto: on over several nodes of several ranks): the warm-up's sum in two exact levels (as
AllReduce-Adam) and the 1-bit average between nodes of each node's exact mean, per local rank's shard
(:class:`~mpicomm.algorithms.onebit.average.NodeOneBitAverage`): the method over N node-workers.

``overlap=True`` (paper variant): both phases of the 1-bit average run chunk by chunk during backward, and the
warm-up's allreduce bucket by bucket (:mod:`~mpicomm.algorithms.onebit.pipelined`), bit for bit the blocking
step. Not with ``variant="deepspeed"``, whose one worker scale spans the whole vector (known after backward),
nor with ``hierarchical``.

``shard=True`` (:mod:`~mpicomm.algorithms.shared.sharding`): Adam's m and v (vhat after the switch) of this rank's
1/n shard only -- the shards are the 1-bit average's server chunks, so each rank also owns its chunk's server
error. The warm-up is sharded AllReduce-Adam; a compression step runs the same 1-bit average (m whole in its
input buffer), steps the shard with the shard's vhat and allgathers the parameters: in fp32 bit for bit the
unsharded method (the floor's mean summed in another order may move a floored coordinate by an ulp), at the price
of that allgather's 4 d (n - 1) / n bytes per step; ``gather_bits=8`` or ``4`` sends each shard's update quantized with
error feedback instead (:mod:`~mpicomm.algorithms.shared.shard_gather`), a quarter or an eighth of that.

A weight that no rank's gradient has reached yet (a branch never taken, an embedding row no batch used) is not
moved in either phase, weight decay included, and its m stays zero (:mod:`~mpicomm.algorithms.shared.reached`):
the 1-bit average would otherwise give it +-(its chunk's scale) at every step. What DeepSpeed's ``exp_avg_mask``
asks the user to list by hand. A coordinate first reached after the freeze (a rare token's row) had v = 0 then: its
vhat becomes the mean vhat of its tensor's coordinates reached before, so it steps like them and not by
lr * scale / (floor or eps).

``variant="deepspeed"`` reproduces DeepSpeed's ``OnebitAdam`` (one worker scale, no bias correction).
``optimizer=`` and ``clip_grad_norm_`` are refused. Bias correction, the variant, bytes and memory:
``docs/algorithms/apmsqueeze.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...checkpoint.resize_rules import ONEBIT_RULES
from ...codecs.base import check_float32
from ..base import check_range
from ..centralized.adam import AllReduceAdam, AllReduceAdamConfig
from ..shared.buckets import LaunchedTraffic, OverlapConfig
from ..shared.hierarchy import mean_over_ranks
from .average import onebit_average_for
from .floor import DenominatorFloorConfig, raise_to_floor
from .freeze import FreezePolicy
from .pipelined import PipelinedOneBitAverage

__all__ = ["APMSqueeze", "APMSqueezeConfig"]

_OPS = ("allreduce", "alltoall", "allgather", "alltoallv", "allgatherv")
VARIANTS = ("paper", "deepspeed")


def _check_count(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")


@dataclass(frozen=True)
class APMSqueezeConfig(AllReduceAdamConfig, OverlapConfig, DenominatorFloorConfig):
    """Adam options plus the warm-up, which must leave at least one compression step, hierarchical, overlap
    and the denominator's floor.

    warmup_steps: full-precision Adam steps before the variance is frozen. warmup_fraction: the warm-up as
    a fraction of total_steps when warmup_steps is not given. total_steps: the run's length (the apps fill it
    in); given it alone, the warm-up ends once the variance has settled, between 20 % and 50 % of the run
    (:mod:`~mpicomm.algorithms.onebit.freeze`).
    variant: "paper" (default) or "deepspeed" (one worker scale, no bias correction; see the module
    docstring). overlap: the exchange chunk by chunk during backward (paper variant; bucket sizes: see
    OverlapConfig, boundaries moved to the 1-bit average's chunks).
    """

    warmup_steps: int | None = None
    warmup_fraction: float | None = None
    total_steps: int | None = None
    variant: str = "paper"

    def __post_init__(self):
        super().__post_init__()
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.shard and self.variant == "deepspeed":
            raise ValueError("apmsqueeze shards the paper variant only: variant='deepspeed' steps its own Adam on the "
                             "whole model; use variant='paper' with shard=True")
        if self.shard and self.hierarchical:
            raise ValueError("apmsqueeze with shard=True exchanges in one level: its shards are the 1-bit average's "
                             "server chunks over all ranks; leave hierarchical at auto or off")
        if self.shard and self.shard_bits != 32:
            raise ValueError("apmsqueeze with shard=True reduce-scatters its warm-up exactly (shard_bits=32); its "
                             "compression phase is the 1-bit average itself")
        if self.overlap and self.variant == "deepspeed":
            raise ValueError("apmsqueeze cannot overlap with variant='deepspeed': its one worker scale spans the "
                             "whole momentum, known only after backward; use variant='paper' or overlap=False")
        _check_count("warmup_steps", self.warmup_steps)
        _check_count("total_steps", self.total_steps)
        if self.warmup_fraction is not None:
            check_range("warmup_fraction", self.warmup_fraction, lo=0.0, hi=1.0, lo_open=True, hi_open=True)
            if self.warmup_steps is not None:
                raise ValueError("give warmup_steps or warmup_fraction, not both")
        if self.warmup_steps is None and self.total_steps is None:
            raise ValueError(
                "apmsqueeze needs its warm-up length: give warmup_steps, or total_steps (the warm-up then ends "
                "once the variance has settled, between 20 % and 50 % of it; or warmup_fraction of it)"
            )
        if self.total_steps is not None and self.warmup is not None and self.warmup >= self.total_steps:
            raise ValueError(
                f"the warm-up ({self.warmup} steps) must be shorter than total_steps ({self.total_steps}); "
                "otherwise the compression phase never runs"
            )

    @property
    def warmup(self) -> int | None:
        """T_w as given: the number of AllReduce-Adam steps before compression starts (at least 1); None when it is
        decided while training (total_steps alone)."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        if self.warmup_fraction is None:
            return None
        return max(1, round(self.warmup_fraction * self.total_steps))


class APMSqueeze(LaunchedTraffic, AllReduceAdam):
    """AllReduce-Adam warm-up, then frozen-v momentum SGD with 1-bit two-sided error-compensated exchange."""

    name = "apmsqueeze"
    config_class = APMSqueezeConfig
    resize_sharded = True
    centralized = True
    clips_average = False
    takes_optimizer = False
    shard_levels = False  # its shards are the flat 1-bit average's server chunks
    optimizer_refusal = ("its Adam (exact during warm-up, frozen-variance 1-bit momentum after) is part of the "
                         "method; set lr, beta1, beta2, eps and weight_decay instead")

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        check_float32(self.name, self.flat.data, "the sign codec decodes to float32")
        self.policy = FreezePolicy(self.name, self.config.warmup, self.config.total_steps)
        self.warmup = self.config.warmup  # T_w; None until the policy decides it
        self.deepspeed = self.config.variant == "deepspeed"
        self.onebit = onebit_average_for(self.two_level, self.comm, self.flat.numel, self.flat.data.device,
                                         one_worker_scale=self.deepspeed)
        self._frozen = False
        self._momentum_whole = False  # sharded: whether the 1-bit input holds the whole m (see the sharded step)
        self._last_ops = dict.fromkeys(_OPS, 0)
        cfg = self.config
        self.pipelined = (PipelinedOneBitAverage(self, self.onebit, self._fill, cfg.bucket_numel,
                                                 cfg.first_bucket_numel) if cfg.overlap else None)

    worker_error = property(lambda self: self.onebit.worker_error, doc="The worker error e_i (padded).")
    server_error = property(lambda self: self.onebit.server_error, doc="The server error e'_k of my chunk.")
    chunk = property(lambda self: self.onebit.chunk, doc="L, the elements per chunk.")
    padded = property(lambda self: self.onebit.padded, doc="D = n L.")
    chunk_payload = property(lambda self: self.onebit.chunk_payload, doc="P = 4 + L / 8 bytes.")

    @property
    def phase(self) -> str:
        """``"warmup"`` or ``"compression"``: the phase the next :meth:`step` runs in."""
        return "warmup" if self.warmup is None or self.step_count < self.warmup else "compression"

    def _prepare(self, grad: torch.Tensor) -> None:
        """With overlap each bucket was divided by the micro-batch count at its launch: nothing here."""
        if self.pipelined is None:
            super()._prepare(grad)

    def _fill(self, lo: int, hi: int) -> None:
        """u_i[lo:hi] = b1 m + (1 - b1) g_i into the 1-bit average's input (the pipelined exchange's fill)."""
        m = self.adam_state()["exp_avg"]
        torch.lerp(m[lo:hi], self.flat.grad[lo:hi], 1 - self.config.beta1, out=self.onebit.input[lo:hi])

    def _step(self, grad: torch.Tensor) -> None:
        before = self.bytes_sent_by_op()
        self._first_launch = None
        if self.pipelined is not None:
            self._first_launch = self.pipelined.finish(grad)
            before = self.pipelined.sent_before
        warming = self.phase == "warmup"
        if self.sharding is not None and warming:
            self.sharding.step(grad, self._adam_update)
        elif self.sharding is not None:
            self._sharded_compressed_step(grad)
        elif warming:
            self._adam_step(grad, averaged=self.pipelined is not None)
        else:
            self._compressed_step(grad, averaged=self.pipelined is not None)
        if warming:
            self._decide_freeze()
        now = self.bytes_sent_by_op()
        self._last_ops = {op: now[op] - before[op] for op in _OPS}

    def _decide_freeze(self) -> None:
        """After a warm-up step: ask the policy whether the warm-up ends here (T_w is then this step)."""
        t = self.step_count + 1
        if self.policy.decide(t, self.adam_state()["exp_avg_sq"], self.config.beta2,
                              self.comm if self.sharding is not None else None, self.flat.numel):
            self.warmup = t

    def metrics(self):
        """When the variance froze (None while warming up), why, and the typical denominator's last change."""
        return self.policy.metrics()

    def bytes_sent_by_op(self) -> dict[str, int]:
        """Bytes sent so far by each collective this method uses (the Ledger's, per operation)."""
        return {op: self.comm.ledger.bytes_sent(op) for op in _OPS}

    def _adam_step(self, grad: torch.Tensor, averaged: bool = False) -> None:
        """The warm-up step: AdamW (paper variant), or Adam without bias correction (deepspeed variant)."""
        if not self.deepspeed:
            super()._adam_step(grad, averaged)
            return
        cfg, x = self.config, self.flat.data
        mean_over_ranks(grad, self.comm, self.two_level)
        state = self.optimizer.state[self.param]
        if not state:
            state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(x), exp_avg_sq=torch.zeros_like(x))
        state["step"] += 1
        state["exp_avg"].lerp_(grad, 1 - cfg.beta1)
        state["exp_avg_sq"].mul_(cfg.beta2).addcmul_(grad, grad, value=1 - cfg.beta2)
        if cfg.weight_decay:
            x.mul_(1 - self.lr * cfg.weight_decay)
        x.addcdiv_(state["exp_avg"], torch.sqrt(state["exp_avg_sq"]).add_(cfg.eps), value=-self.lr)

    @property
    def frozen_denominator(self) -> torch.Tensor:
        """vhat of the compression phase: Adam's ``exp_avg_sq`` buffer, turned into vhat in place at the switch."""
        return self.adam_state()["exp_avg_sq"]

    def _freeze(self) -> None:
        """vhat = max(sqrt(v) / sqrt(1 - b2^T_w), F) + eps (deepspeed: max(sqrt(v), F) + eps; F the floor),
        once, in v's own buffer.

        v is never read again after the switch, so it becomes vhat in place instead of a model-sized copy
        (a checkpoint of the compression phase holds vhat there, and ``frozen`` in its extra state says so).
        """
        state = self.adam_state()
        t_w = float(state["step"])
        denom = state["exp_avg_sq"].sqrt_()
        if not self.deepspeed:
            denom.div_((1 - self.config.beta2**t_w) ** 0.5)
        mean = None
        if self.sharding is not None:  # the floor's mean over the whole model, from every rank's shard
            total = denom.sum(dtype=torch.float64).reshape(1)
            self.comm.allreduce(total)
            mean = float(total) / self.flat.numel
        raise_to_floor(denom, self.config.denominator_floor, mean)
        denom.add_(self.config.eps)
        self._frozen = True

    def _compressed_step(self, grad: torch.Tensor, averaged: bool = False) -> None:
        """One compression-phase step: m_i into the exchange, the 1-bit average becomes m, update x
        (``averaged``: the pipelined exchange has already left the average in the 1-bit input)."""
        if not self._frozen:
            self._freeze()
        cfg = self.config
        m = self.adam_state()["exp_avg"]
        if averaged:
            m.copy_(self.onebit.input)
        else:
            torch.lerp(m, grad, 1 - cfg.beta1, out=self.onebit.input)   # m_i
            m.copy_(self.onebit.average())
        x = self.flat.data
        if cfg.weight_decay:
            x.mul_(1 - self.lr * cfg.weight_decay)
        correction = 1.0 if self.deepspeed else 1 - cfg.beta1 ** (self.step_count + 1)
        x.addcdiv_(m, self.frozen_denominator, value=-self.lr / correction)

    def _zero_unreached(self, reached):
        """Warm-up: Adam's m and v where no gradient has reached. Compression: m only (v is the frozen denominator),
        which the 1-bit average fills with +-(its chunk's scale) everywhere, and the whole m a sharded step keeps in
        the 1-bit input."""
        if not self._frozen:
            super()._zero_unreached(reached)
            return
        offset = self.sharding.lo if self.sharding is not None else 0
        reached.zero(self.adam_state()["exp_avg"], offset)
        if self._momentum_whole:
            reached.zero(self.onebit.input[:self.flat.numel])

    def _newly_reached(self, index):
        """In the compression phase, a coordinate first reached now has no variance of its own (v was 0 at the
        freeze): its vhat becomes the mean vhat of its tensor's coordinates reached before, not the floor."""
        if self.phase != "compression":
            return
        if not self._frozen:
            self._freeze()
        offset = self.sharding.lo if self.sharding is not None else 0
        self.reached.fill_with_tensor_means(self.frozen_denominator, index, self.reached.before, offset,
                                            self.comm if self.sharding is not None else None)

    def _sharded_compressed_step(self, grad: torch.Tensor) -> None:
        """The compression-phase step with ``shard=True``: the same 1-bit average on every rank, then this rank
        steps its shard with its shard of vhat, and the parameters are allgathered.

        m lives whole in the 1-bit average's input, where each average leaves its result (the next step's m); the
        shard's ``exp_avg`` keeps a copy of its part for checkpoints. After the warm-up or a restore the input is
        filled once by an allgather of the shards' m."""
        if not self._frozen:
            self._freeze()
        cfg, sharding = self.config, self.sharding
        lo, hi = sharding.lo, sharding.hi
        m_shard, u = self.adam_state()["exp_avg"], self.onebit.input
        if not self._momentum_whole:
            u[lo:hi].copy_(m_shard)
            sharding.gather.exact(u)
            self._momentum_whole = True
        torch.lerp(u, grad, 1 - cfg.beta1, out=u)                       # m_i
        m_shard.copy_(self.onebit.average()[lo:hi])
        x = self.flat.data[lo:hi]

        def update() -> None:
            if cfg.weight_decay:
                x.mul_(1 - self.lr * cfg.weight_decay)
            x.addcdiv_(m_shard, self.frozen_denominator, value=-self.lr / (1 - cfg.beta1 ** (self.step_count + 1)))

        sharding.apply(update)

    def stats(self):
        """Base stats plus ``phase`` (of the next step), ``warmup_steps`` and bytes sent per collective.

        Warm-up traffic is the ``allreduce`` entry; compression traffic is ``alltoall`` + ``allgather``.
        """
        out = super().stats()
        out["phase"] = self.phase
        out["warmup_steps"] = self.warmup
        for op in _OPS:
            out[f"step_bytes_sent_{op}"] = self._last_ops[op]
            out[f"total_bytes_sent_{op}"] = self.comm.ledger.bytes_sent(op)
        return out

    def _extra_state(self):
        out = super()._extra_state()
        out.update(phase=self.phase, frozen=self._frozen, freeze=self.policy.state_dict(), **self.onebit.state_dict())
        return out

    def _resize_rules(self):
        """On a resize, the 1-bit average's errors follow :data:`~mpicomm.checkpoint.resize_rules.ONEBIT_RULES`."""
        return {**super()._resize_rules(), **ONEBIT_RULES}

    def _load_extra_state(self, extra):
        self.policy.load_state_dict(extra.get("freeze"), self.step_count, extra["phase"] == "compression")
        if self.policy.frozen_at is not None:
            self.warmup = self.policy.frozen_at
        if extra["phase"] != self.phase:
            raise ValueError(f"state says phase {extra['phase']!r} at step {self.step_count}, "
                             f"but the warm-up of {self.warmup} steps puts it in {self.phase!r}")
        self.onebit.load_state_dict(extra)
        super()._load_extra_state(extra)
        self._momentum_whole = False
        self._frozen = bool(extra.get("frozen", False))  # older checkpoints kept v and a separate vhat
