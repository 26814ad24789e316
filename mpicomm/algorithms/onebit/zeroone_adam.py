"""0/1 Adam: 1-bit compressed Adam with adaptive variance freezing and local steps on a growing interval.

Lu, Li, Zhang, Tang, Zhang, He. "Maximizing Communication Efficiency for Large-scale Training via
0/1 Adam", ICLR 2023 (arXiv:2202.06009), Algorithm 1, with the schedules of DeepSpeed's ``ZeroOneAdam``.

Step t on rank i (Avg the error-compensated 1-bit average of :mod:`.average`; the exact fp32 mean with
``compression=False``)::

    phase 1, t <= var_freeze_step: one shared x, m, v
      variance step (t mod I_v == 0):  g = allreduce mean of g_i;  v <- b2 v + (1 - b2) g^2
      otherwise:                        g = Avg(g_i)
      m <- b1 m + (1 - b1) g;   x <- x (1 - lr wd) - lr m / denom      (I_v doubles, T_v)
    phase 2: v frozen; local steps x_i <- x_i (1 - lr wd) - lr m_i / denom, u_i <- u_i + lr m_i
      sync step (t mod I_u == 0):  ubar = Avg(u_i);  m <- ubar / sum(lr);  x <- c x_s - ubar / denom

var_freeze_step: as given; with ``total_steps`` alone, decided while training (the first step past 20 % of the run
at which the variance has settled, 50 % at the latest, :mod:`~mpicomm.algorithms.onebit.freeze`); with neither,
DeepSpeed's 100,000. A freeze decided while training comes with no thinning (unless ``var_update_scaler`` is
given): every step before it updates v, as APMSqueeze's warm-up does. On the BERT masked-LM yardstick (3,000
steps) DeepSpeed's thinning (var_update_scaler 16) kept the model on its first loss plateau: training loss 6.3
at step 1,090, where AllReduce-Adam was at 5.6 and had left the plateau by step 300.

denom = max(sqrt(v), F) + eps, set when v changes: F = denominator_floor (default 0.01) times the mean of
sqrt(v) over the model, so that a coordinate no variance step has seen (v = 0), whose 1-bit momentum is never
zero, moves by about lr / denominator_floor and not lr * scale / eps
(:mod:`~mpicomm.algorithms.onebit.floor`). F is 0 until a 1-bit average first feeds m (the first compressed
step, or phase 2; never with ``compression=False``): until then m is Adam's own and the step the published
one. ``denominator_floor=0`` is the published method throughout.

``hierarchical`` (auto: on over several nodes of several ranks): the exact means in two levels, the 1-bit
averages between nodes of each node's exact mean per local rank's shard
(:class:`~mpicomm.algorithms.onebit.average.NodeOneBitAverage`): Algorithm 1 over N node-workers.

A weight that no gradient has reached yet (a branch never taken, an embedding row no batch used) is not moved,
weight decay included, and m and u stay zero there (:mod:`~mpicomm.algorithms.shared.reached`); the ranks agree on
what was reached at the steps that communicate anyway, and a local step holds what this rank has not reached.

``optimizer=`` and ``clip_grad_norm_`` are refused. The schedules, the differences from DeepSpeed's
code and the bytes per step: ``docs/algorithms/zeroone_adam.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...checkpoint.resize_rules import ONEBIT_RULES, replica_mean
from ...codecs.base import check_float32
from ..base import Algorithm, check_bool, check_int
from ..centralized.adam import AdamConfig
from ..shared.hierarchy import HierarchicalConfig, mean_over_ranks, two_level_for
from .average import onebit_average_for
from .floor import DenominatorFloorConfig, raise_to_floor
from .freeze import FreezePolicy

__all__ = ["KINDS", "ZeroOneAdam", "ZeroOneAdamConfig"]

KINDS = ("variance", "compressed", "local", "sync")


@dataclass(frozen=True)
class ZeroOneAdamConfig(AdamConfig, HierarchicalConfig, DenominatorFloorConfig):
    """Adam options plus the schedules (DeepSpeed's names and defaults), hierarchical and the denominator's floor.

    var_freeze_step: steps with variance updates before v is frozen and local steps begin (None: decided while
    training when total_steps is given, else DeepSpeed's 100,000). total_steps: the run's length (the apps fill
    it in). var_update_scaler: variance steps after which their interval doubles (kappa; None: DeepSpeed's 16,
    or, when the freeze is decided while training, no thinning: every step before the freeze updates v).
    local_step_scaler: steps after which the interval between synchronisations doubles. local_step_clipper: the
    longest such interval (H).
    compression: 1-bit averages (False: exact fp32 means, for reference runs).
    """

    var_freeze_step: int | None = None
    total_steps: int | None = None
    var_update_scaler: int | None = None
    local_step_scaler: int = 32_678
    local_step_clipper: int = 16
    compression: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.var_freeze_step is not None:
            check_int("var_freeze_step", self.var_freeze_step, 1)  # step 1 is a variance step: v != 0
        if self.total_steps is not None:
            check_int("total_steps", self.total_steps, 1)
        if self.var_update_scaler is not None:
            check_int("var_update_scaler", self.var_update_scaler, 1)
        for name in ("local_step_scaler", "local_step_clipper"):
            check_int(name, getattr(self, name), 1)
        check_bool("compression", self.compression)


class ZeroOneAdam(Algorithm):
    """0/1 Adam: variance updated on an exponentially thinning schedule, then frozen; 1-bit momentum
    averages, and after the freeze local steps synchronised by 1-bit averages of the accumulated momentum."""

    name = "zeroone_adam"
    config_class = ZeroOneAdamConfig
    masks_unreached = True
    resize_sharded = True
    centralized = True
    optimizer_refusal = ("0/1 Adam's frozen variance and local steps are the method; set lr, beta1, beta2, eps "
                         "and weight_decay instead")
    shard_refusal = ("after its variance freezes, 0/1 Adam's local steps give every rank its own model and momentum "
                     "and divide by the whole frozen denominator at every step, so a rank's state cannot be cut to a "
                     "shard without allgathering it at each local step, which the local steps exist to avoid")

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        check_float32(self.name, self.flat.data, "the sign codec decodes to float32")
        x = self.flat.data
        self.m, self.v, self.u, self.synced = (torch.zeros_like(x) for _ in range(4))
        self._denom = torch.zeros_like(x)
        self.two_level = two_level_for(self.config, comm, self.flat.numel, x)
        self.onebit = onebit_average_for(self.two_level, self.comm, self.flat.numel, x.device, one_worker_scale=True)
        self.schedule = {"var_interval": 1, "var_counter": 0, "local_interval": 1, "local_counter": 0,
                         "lrs": 0.0, "decay": 1.0}
        self.counts = dict.fromkeys(KINDS, 0)
        self.last_kind = ""
        cfg = self.config
        fixed = cfg.var_freeze_step if cfg.var_freeze_step is not None or cfg.total_steps is not None else 100_000
        self.policy = FreezePolicy(self.name, fixed, cfg.total_steps)
        self.var_freeze_step = fixed  # None until the policy decides it
        scaler = cfg.var_update_scaler
        self.var_update_scaler = scaler if scaler is not None else (None if self.policy.adaptive else 16)

    def kind(self, t: int) -> str:
        """The kind of step ``t`` (1-based) under the current schedule: one of :data:`KINDS`."""
        s = self.schedule
        if self.var_freeze_step is None or t <= self.var_freeze_step:
            return "variance" if t % s["var_interval"] == 0 else "compressed"
        return "sync" if t % s["local_interval"] == 0 else "local"

    def _average(self, vec: torch.Tensor) -> torch.Tensor:
        """``vec`` <- the average over ranks (1-bit with error feedback, or exact without compression)."""
        if not self.config.compression:
            return mean_over_ranks(vec, self.comm, self.two_level)
        self.onebit.input.copy_(vec)
        return vec.copy_(self.onebit.average())

    def _step(self, grad: torch.Tensor) -> None:
        cfg, s, x = self.config, self.schedule, self.flat.data
        t = self.step_count + 1
        kind = self.last_kind = self.kind(t)
        self.counts[kind] += 1
        if kind in ("variance", "compressed"):
            if kind == "variance":
                mean_over_ranks(grad, self.comm, self.two_level)
                self.m.lerp_(grad, 1 - cfg.beta1)
                self.v.mul_(cfg.beta2).addcmul_(grad, grad, value=1 - cfg.beta2)
                self._set_denominator()
            else:
                self.m.lerp_(self._average(grad), 1 - cfg.beta1)
                if self.counts["compressed"] == 1:
                    self._set_denominator()      # the floor applies from now on
            if cfg.weight_decay:
                x.mul_(1 - self.lr * cfg.weight_decay)
            x.addcdiv_(self.m, self._denom, value=-self.lr)
            if kind == "variance":
                s["var_counter"] += 1
                if s["var_counter"] == self.var_update_scaler:  # never when None: no thinning
                    s["var_counter"], s["var_interval"] = 0, 2 * s["var_interval"]
            if self.policy.decide(t, self.v, cfg.beta2):
                self.var_freeze_step = t
                self._start_local_phase()
            return
        self.m.lerp_(grad, 1 - cfg.beta1)
        if cfg.weight_decay:
            x.mul_(1 - self.lr * cfg.weight_decay)
            s["decay"] *= 1 - self.lr * cfg.weight_decay
        x.addcdiv_(self.m, self._denom, value=-self.lr)
        self.u.add_(self.m, alpha=self.lr)
        s["lrs"] += self.lr
        if kind == "sync":
            ubar = self._average(self.u)
            torch.div(ubar, s["lrs"], out=self.m)
            torch.mul(self.synced, s["decay"], out=x).sub_(ubar / self._denom)
            self.synced.copy_(x)
            self.u.zero_()
            s["lrs"], s["decay"] = 0.0, 1.0
        s["local_counter"] += 1
        if s["local_counter"] == cfg.local_step_scaler:
            s["local_counter"], s["local_interval"] = 0, min(cfg.local_step_clipper, 2 * s["local_interval"])

    def _agrees_now(self) -> bool:
        """The ranks agree on what was reached at every step that communicates anyway (all but the local steps)."""
        return self.kind(self.step_count + 1) != "local"

    def _frozen_before(self) -> bool:
        """Whether the variance froze before the coming step (x_s holds the last synchronised model)."""
        return self.var_freeze_step is not None and self.step_count >= self.var_freeze_step

    def _unreached_kept(self):
        """After the freeze, x_s (shared) where no rank has reached; the model (this rank's own after the freeze)
        where this rank has not."""
        return ([self.synced] if self._frozen_before() else []), [self.flat.data]

    def _zero_unreached(self, reached):
        """m and u (this rank's own after the freeze) where this rank has not been reached; v is exact: zero there.
        At the step that froze v, x_s was copied from a model the step had moved there: it takes the kept values."""
        reached.zero(self.m, which="local")
        reached.zero(self.u, which="local")
        if self.var_freeze_step == self.step_count + 1:
            reached.copy(self.synced, self.flat.data)

    def _set_denominator(self) -> None:
        """denom = max(sqrt(v), F) + eps: after each change of v (only variance steps change it) and when the
        floor F starts to apply (once a 1-bit average has fed m; before, F = 0)."""
        cfg, counts = self.config, self.counts
        frozen = self.var_freeze_step is not None and self.step_count + 1 >= self.var_freeze_step
        onebit = cfg.compression and (counts["compressed"] or counts["local"] or counts["sync"] or frozen)
        raise_to_floor(torch.sqrt(self.v, out=self._denom), cfg.denominator_floor if onebit else 0.0)
        self._denom.add_(cfg.eps)

    def _start_local_phase(self) -> None:
        """Freeze denom (with the floor: phase 2's m comes from 1-bit averages), remember x_s = x, clear both
        error buffers."""
        self._set_denominator()
        self.synced.copy_(self.flat.data)
        self.onebit.worker_error.zero_()
        self.onebit.server_error.zero_()

    def metrics(self):
        """When the variance froze (None until then), why, and the typical denominator's last change."""
        return self.policy.metrics()

    def stats(self):
        """Base stats plus the kind of the last step and how many steps of each kind ran."""
        out = super().stats()
        out["last_kind"] = self.last_kind
        out.update({f"{k}_steps": v for k, v in self.counts.items()})
        return out

    def _extra_state(self):
        return {"m": self.m.clone(), "v": self.v.clone(), "u": self.u.clone(), "synced": self.synced.clone(),
                "denom": self._denom.clone(), "schedule": dict(self.schedule), "counts": dict(self.counts),
                "freeze": self.policy.state_dict(), **self.onebit.state_dict()}

    def _resize_rules(self):
        """On a resize, the 1-bit average's errors follow :data:`~mpicomm.checkpoint.resize_rules.ONEBIT_RULES`; what
        0/1 Adam's local steps made differ per rank (the model and its moments) is averaged (:func:`replica_mean`),
        what is identical carried."""
        return {**super()._resize_rules(), "params": replica_mean, "extra": replica_mean, **ONEBIT_RULES}

    def _load_extra_state(self, extra):
        self.onebit.load_state_dict(extra)
        for key in ("m", "v", "u", "synced"):
            getattr(self, key).copy_(extra[key])
        self._denom.copy_(extra["denom"])
        self.schedule, self.counts = dict(extra["schedule"]), dict(extra["counts"])
        legacy_frozen = self.var_freeze_step is not None and self.step_count >= self.var_freeze_step
        self.policy.load_state_dict(extra.get("freeze"), self.step_count, legacy_frozen)
        if self.policy.frozen_at is not None:
            self.var_freeze_step = self.policy.frozen_at
