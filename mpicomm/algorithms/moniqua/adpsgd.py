"""Moniqua-AD-PSGD: AD-PSGD's pull average on modulo-quantized models, theta per tensor, check then mix.

Lu, De Sa. "Moniqua: Modulo Quantized Communication in Decentralized SGD." ICML 2020 (Moniqua-AD-PSGD).

Step k of rank i, as AD-PSGD's (:mod:`..decentralized.adpsgd`), with j's message read instead of x_j
(:class:`~mpicomm.codecs.moniqua.MoniquaPullCodec`; v the number of steps j had taken when it published)::

    x_i[S_l] <- x_i[S_l] + (gamma/2) (x̂_j - x̂_i)[S_l]     for every tensor l whose recovery did not wrap
    x_i <- x_i - alpha g_i;   publish header + b-bit codes of x_i, v = k + 1

S_l is tensor l's part (v + l) mod P of j's message; x̂_j, x̂_i are recovered on j's grid and dither.
Nothing is agreed between ranks: theta per tensor comes from this rank's own step sizes and the distances it
recovered in its own pulls, never below the largest theta seen in its peers' headers. guard "skip" or "raise"
("resync" needs the peer). Rounding
defaults to "nearest" here: why, and the rest of the adaptation to asynchrony:
``docs/algorithms/adpsgd.md``. ``bits=32, parts=1`` is ``adpsgd`` bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import torch

from ...codecs.moniqua import MoniquaPullCodec
from ..decentralized.adpsgd import ADPSGD, expected_pull_matrix
from .config import IDENTITY_BITS, MoniquaConfig
from .guard import GuardRecord, ThetaBoundError
from .theta import TensorTheta, local_step_sizes, matrix_mixing_time, tensor_inf

__all__ = ["MoniquaADPSGD", "MoniquaADPSGDConfig"]

ASYNC_GUARDS = ("skip", "raise")


@dataclass(frozen=True)
class MoniquaADPSGDConfig(MoniquaConfig):
    """Moniqua-AD-PSGD options: those of Moniqua (bits, parts, gamma, theta, theta_per, theta_c, ...).

    theta: None (default): "observed" at 2 bits and more, "adaptive" at 1 bit. "observed": 2 C (D_l + P M_l),
    D_l the running max of the distances this rank recovered in its own pulls (no collective: a ring's
    neighbours read each other, so the distance a rank sees to its peers is the one they will see to it).
    "adaptive": the bound rule 2 C M_l P t_mix, t_mix of the expected pull matrix; at 8 ranks on a ring its
    theta grew to 18-60 per tensor, and 4-bit codes on that grid drove the ranks apart (on MNIST-1D the
    averaged model stayed at chance, 48-73 points below every rank's own). At 1 bit a recovered distance is 0
    or a whole cell, so the observed rule shrinks theta until no pull moves a model (on the least-squares test
    the ranks ended where ranks that never communicate end), and the bound rule keeps them 1.3x closer. Or a
    number.
    rounding: "nearest" (default here), "dither" (shared subtractive: its zero-mean noise enters the ranks'
    mean, which a one-sided pull does not preserve) or "stochastic" (bits >= 2). guard: "skip" (a wrapped
    tensor is left unmixed in that pull) or "raise"; "resync" is refused: it needs a full-precision exchange
    with the peer, which a one-sided read does not have.
    """

    rounding: str = "nearest"
    theta: Union[float, str, None] = None

    def __post_init__(self):
        if self.theta is None:
            object.__setattr__(self, "theta", "adaptive" if self.bits == 1 else "observed")
        super().__post_init__()
        if self.guard not in ASYNC_GUARDS:
            raise ValueError(f"guard must be one of {ASYNC_GUARDS} for moniqua_adpsgd, got {self.guard!r} "
                             "(a resync needs a full-precision exchange with the peer; AD-PSGD's reads are one-sided)")


class MoniquaADPSGD(ADPSGD):
    """Moniqua-AD-PSGD: AD-PSGD's pull average on modulo-quantized models, theta per tensor, check then mix."""

    name = "moniqua_adpsgd"
    asynchronous = True
    config_class = MoniquaADPSGDConfig

    def _setup_messages(self) -> None:
        config, count = self.config, len(self.flat.layers)
        self.record = GuardRecord([layer.name for layer in self.flat.layers])
        if config.bits == IDENTITY_BITS:
            super()._setup_messages()
            self.codec = None
            return
        device = self.flat.data.device
        self.codec = MoniquaPullCodec(self.flat.layers, config.bits, config.parts, config.rounding, config.seed,
                                 config.seed + self.comm.rank, device)
        t_mix = matrix_mixing_time([expected_pull_matrix(self.comm.schedule, config.gamma)])
        self.rule = TensorTheta(count, config, config.parts * t_mix)
        self.peer_theta = torch.zeros(count, dtype=torch.float64)  # running max (decay per read) of peers' thetas
        self.message_bytes = self.codec.nbytes
        self.own = torch.zeros(self.message_bytes, dtype=torch.uint8, device=device)
        self.peer_message = torch.empty_like(self.own)

    def _observe(self, grad, update):
        if self.codec is not None:
            sizes = self.codec.layout.sizes
            step = (local_step_sizes(grad, self.lr, self.optimizer, sizes) if update is None
                    else local_step_sizes(update, 1.0, None, sizes))
            self.rule.observe(self.rule.statistic(step, tensor_inf(self.flat.data, sizes)))

    def theta(self) -> torch.Tensor:
        """theta per tensor of this rank's next message: its own rule's, or a larger one seen in a peer's header."""
        return torch.maximum(self.rule.theta(), self.peer_theta)

    def _publish(self, steps: int) -> None:
        if self.codec is None:
            return super()._publish(steps)
        if self.rule.ready():
            self.codec.encode(self.flat.data, steps, self.theta(), self.own)
        else:  # an adaptive theta before the first step: readers see "nothing yet" (all still hold x_0)
            self.codec.empty(self.own)
        self.mailbox.publish(self.own)

    def _average_with(self, peer: int) -> None:
        if self.codec is None:
            return super()._average_with(peer)
        message = self.mailbox.read(peer, self.peer_message)
        version = self.codec.version(message)
        if version < 0:
            return
        self.peer_theta = torch.maximum(self.peer_theta * self.config.theta_decay,
                                        self.codec.thetas(self.codec.header_scales(message)))
        increment, wrapped = self.codec.pull(message, self.flat.data, version)  # check: x untouched so far
        if self.rule.observed:  # the distance to this peer per tensor, as recovered (a wrapped tensor's is not)
            sizes = [stop - start for start, stop in self.codec.layout.parts_at(version)]
            self.rule.observe_distance(tensor_inf(increment, sizes).clamp_min(0.0), wrapped)
        self.record.steps += 1
        if wrapped.any():
            self.record.add(wrapped)
            if self.config.guard == "raise":
                raise ThetaBoundError(f"{self.record.describe(self.step_count, wrapped)} (rank {self.comm.rank} "
                                      f"pulling rank {peer}'s model of its step {version}); raise theta or "
                                      "theta_c, or use guard='skip'")
        self.codec.mix(self.flat.data, version, increment, wrapped, self.gamma / 2.0)  # then mix
        self.rule.guard(wrapped)

    def stats(self) -> dict[str, Any]:
        """Base stats plus gamma, theta's range and the guard's counters (this rank's pulls and wrapped parts)."""
        out = {**super().stats(), "gamma": self.gamma, "wrapped_parts": self.record.total(), "pulls": self.record.steps}
        if self.codec is not None and self.rule.ready():
            theta = self.theta()
            out.update(theta_min=float(theta.min()), theta_max=float(theta.max()),
                       theta_scale_max=float(self.rule.scale.max()))
        return out

    def metrics(self) -> dict[str, Any]:
        """For ``metrics.jsonl``: this rank's largest theta and wrapped parts per tensor group (see GuardRecord)."""
        if self.codec is None or not self.rule.ready():
            return {}
        return self.record.metrics(self.theta())

    def close(self) -> None:
        """Collective: rank 0 logs one summary of every rank's wrapped parts, then the window is freed."""
        self.record.summed(self.comm).summarise(self.comm.rank, "skip")
        super().close()

    def resize_refusal(self) -> str:
        """Moniqua on AD-PSGD cannot change world size (see the returned reason)."""
        return ("moniqua_adpsgd cannot change world size: each rank's published message is a modulo code whose "
                "decoding needs the peer-specific theta the old ranks agreed with their old peers, and a "
                "re-encoded message would not match what those peers last read; resume at the saved size")

    def _extra_state(self):
        extra = {**super()._extra_state(), "record": self.record.state_dict()}
        if self.codec is not None:
            extra.update(rule=self.rule.state_dict(), peer_theta=self.peer_theta.clone(), message=self.own.clone())
            if self.codec.noise is not None:
                extra["noise"] = self.codec.noise.state_dict()
        return extra

    def _load_extra_state(self, extra):
        self.record.load_state_dict(extra["record"])
        if self.codec is not None:
            self.rule.load_state_dict(extra["rule"])
            self.peer_theta = extra["peer_theta"].clone().double()
            if self.codec.noise is not None:
                self.codec.noise.load_state_dict(extra["noise"])
        super()._load_extra_state(extra)

    def _restore_message(self, extra) -> None:
        """Publish the saved message byte for byte (re-encoding would draw stochastic rounding anew)."""
        if self.codec is None:
            return super()._restore_message(extra)
        self.own.copy_(extra["message"])
        self.mailbox.publish(self.own)
