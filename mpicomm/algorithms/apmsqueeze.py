"""APMSqueeze: Adam-preconditioned momentum SGD with two-sided error-compensated 1-bit compression.

Tang, Gan, Rajbhandari, Lian, Liu, Zhang, He. "APMSqueeze: A Communication Efficient
Adam-Preconditioned Momentum SGD Algorithm", arXiv:2008.11343, 2020 (the basis of DeepSpeed's
1-bit Adam: Tang et al., "1-bit Adam", ICML 2021).

Warm-up, steps t = 1 .. T_w: exactly :class:`~mpicomm.algorithms.adam.AllReduceAdam` (the same
method runs, so the iterates are bit-identical). From step T_w + 1 on, v is frozen and, on rank i::

    m_i   = b1 m + (1 - b1) g_i                     # m: the shared momentum of the last step
    u_i   = m_i + e_i;   e_i <- u_i - C(u_i)          # worker error feedback, full vector, per chunk
    phase 1: rank i sends chunk k of C(u_i) to rank k (all-to-all); rank k is the server of chunk k
    s_k   = (1/n) sum_j C(u_j)[k] + e'_k;   e'_k <- s_k - C(s_k)   # server error feedback
    phase 2: allgather of the n server chunks C(s_k);   m <- concat_k C(s_k)   (identical everywhere)
    x    <- x (1 - lr wd) - lr / (1 - b1^t) * m / vhat,    vhat = sqrt(v_Tw) / sqrt(1 - b2^T_w) + eps

C is ``SignCodec(scale="l2")``: C(x) = (||x||_2 / sqrt(len x)) sign(x), sign(0) = +1, one scale per
chunk. The vector is zero-padded to D = n L elements, L = 8 ceil(d / (8 n)), and cut into n chunks
of L; padding positions are zero in u and in the server input, and are zeroed in both error buffers
after every step, so they never reach m or x (they only count in the length of the last scale).

Bias correction: vhat is exactly the denominator Adam used at its last warm-up step (v frozen with
its step-T_w correction applied); m keeps Adam's 1 / (1 - b1^t) (-> 1 long before T_w ends). With an
uncompressed exchange the compression phase would therefore be Adam with v frozen at T_w.

``variant="deepspeed"`` reproduces DeepSpeed's 1-bit Adam (``OnebitAdam`` with its NCCL/MPI
compressed allreduce) instead: (1) the worker compression uses *one* scale over the whole padded
vector u_i, ||u_i||_2 / sqrt(D), not one per chunk (the server side keeps one scale per chunk, as
DeepSpeed does); (2) no Adam bias correction anywhere: the warm-up is x <- x (1 - lr wd) - lr m /
(sqrt(v) + eps) (not torch's AdamW), the frozen denominator is sqrt(v_Tw) + eps and the compression
step is x <- x (1 - lr wd) - lr m / vhat. The one worker scale rides in the 4-byte header of each
chunk's payload (DeepSpeed allgathers it separately), so the bytes are the default variant's; padding
is zeroed in both error buffers as above (DeepSpeed lets it accumulate there; it never reaches x).

Bytes per compression step and rank, P = 4 + L/8 (one float32 scale + L sign bits per chunk):
alltoall contributes n P (sends (n - 1) P), allgather contributes P (sends (n - 1) P); an fp32
allreduce sends 2 (n - 1)/n * 4 d, i.e. 4 d / (n P) ~ 32x more. Every buffer of the compression
phase (2 D + 3 L + d floats, (3 n + 1) P bytes) is allocated at construction, so the switch adds no
allocation; the codec's own per-call temporaries (SignCodec.encode returns a fresh P-byte payload,
copied into place) are the same in every compression step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codecs import SignCodec
from .adam import AdamConfig, AllReduceAdam
from .base import check_range
from .registry import register

__all__ = ["APMSqueeze", "APMSqueezeConfig"]

_OPS = ("allreduce", "alltoall", "allgather")
_DEFAULT_FRACTION = 0.2
VARIANTS = ("paper", "deepspeed")


def _check_count(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")


@dataclass(frozen=True)
class APMSqueezeConfig(AdamConfig):
    """Adam options plus the warm-up: ``warmup_steps``, or ``warmup_fraction`` (default 0.2) of ``total_steps``.

    Give ``warmup_steps`` or ``total_steps`` (or both); the warm-up must leave at least one
    compression step when ``total_steps`` is known. ``variant``: ``"paper"`` (default) or
    ``"deepspeed"`` (one worker scale, no bias correction; see the module docstring).
    """

    warmup_steps: int | None = None
    warmup_fraction: float | None = None
    total_steps: int | None = None
    variant: str = "paper"

    def __post_init__(self):
        super().__post_init__()
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        _check_count("warmup_steps", self.warmup_steps)
        _check_count("total_steps", self.total_steps)
        if self.warmup_fraction is not None:
            check_range("warmup_fraction", self.warmup_fraction, lo=0.0, hi=1.0, lo_open=True, hi_open=True)
            if self.warmup_steps is not None:
                raise ValueError("give warmup_steps or warmup_fraction, not both")
        if self.warmup_steps is None and self.total_steps is None:
            raise ValueError(
                "apmsqueeze needs its warm-up length: give warmup_steps, or total_steps "
                f"(the warm-up is then warmup_fraction, default {_DEFAULT_FRACTION}, of it)"
            )
        if self.total_steps is not None and self.warmup >= self.total_steps:
            raise ValueError(
                f"the warm-up ({self.warmup} steps) must be shorter than total_steps ({self.total_steps}); "
                "otherwise the compression phase never runs"
            )

    @property
    def warmup(self) -> int:
        """T_w: the number of AllReduce-Adam steps before compression starts (at least 1)."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        fraction = _DEFAULT_FRACTION if self.warmup_fraction is None else self.warmup_fraction
        return max(1, round(fraction * self.total_steps))


@register
class APMSqueeze(AllReduceAdam):
    """AllReduce-Adam warm-up, then frozen-v momentum SGD with 1-bit two-sided error-compensated exchange."""

    name = "apmsqueeze"
    config_class = APMSqueezeConfig

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        if self.flat.data.dtype != torch.float32:
            raise TypeError(f"apmsqueeze needs float32 parameters (the sign codec decodes to float32), "
                            f"got {self.flat.data.dtype}")
        n, d, rank = self.comm.size, self.flat.numel, self.comm.rank
        self.warmup = self.config.warmup
        self.codec = SignCodec(scale="l2")
        self.chunk = 8 * -(-d // (8 * n))
        self.padded = n * self.chunk
        self._real = min(max(d - rank * self.chunk, 0), self.chunk)  # unpadded length of the chunk I serve
        self.chunk_payload = payload = self.codec.payload_bytes(self.chunk)  # P = 4 + L / 8
        floats = {"dtype": torch.float32, "device": self.flat.data.device}
        octets = {"dtype": torch.uint8, "device": self.flat.data.device}
        self.worker_error = torch.zeros(self.padded, **floats)
        self.server_error = torch.zeros(self.chunk, **floats)
        self._u = torch.zeros(self.padded, **floats)
        self._server = torch.zeros(self.chunk, **floats)
        self._scratch = torch.zeros(self.chunk, **floats)
        self._denom = torch.zeros(d, **floats)
        self._send = torch.zeros(n, payload, **octets)
        self._recv = torch.zeros(n, payload, **octets)
        self._server_payload = torch.zeros(payload, **octets)
        self._gathered = torch.zeros(n, payload, **octets)
        self._frozen = False
        self._last_ops = dict.fromkeys(_OPS, 0)
        self.deepspeed = self.config.variant == "deepspeed"
        self._whole = torch.zeros(self.codec.payload_bytes(self.padded) if self.deepspeed else 0, **octets)

    @property
    def phase(self) -> str:
        """``"warmup"`` or ``"compression"``: the phase the next :meth:`step` runs in."""
        return "warmup" if self.step_count < self.warmup else "compression"

    def _step(self, grad: torch.Tensor) -> None:
        before = {op: self.comm.ledger.bytes_sent(op) for op in _OPS}
        if self.step_count < self.warmup:
            self._adam_step(grad)
        else:
            self._compressed_step(grad)
        self._last_ops = {op: self.comm.ledger.bytes_sent(op) - before[op] for op in _OPS}

    def _adam_step(self, grad: torch.Tensor) -> None:
        """The warm-up step: AdamW (paper variant), or Adam without bias correction (deepspeed variant)."""
        if not self.deepspeed:
            super()._adam_step(grad)
            return
        cfg, x = self.config, self.flat.data
        self.comm.allreduce(grad)
        grad.div_(self.comm.size)
        state = self.optimizer.state[self.param]
        if not state:
            state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(x), exp_avg_sq=torch.zeros_like(x))
        state["step"] += 1
        state["exp_avg"].lerp_(grad, 1 - cfg.beta1)
        state["exp_avg_sq"].mul_(cfg.beta2).addcmul_(grad, grad, value=1 - cfg.beta2)
        if cfg.weight_decay:
            x.mul_(1 - self.lr * cfg.weight_decay)
        torch.sqrt(state["exp_avg_sq"], out=self._denom).add_(cfg.eps)
        x.addcdiv_(state["exp_avg"], self._denom, value=-self.lr)

    def _freeze(self) -> None:
        """vhat = sqrt(v) / sqrt(1 - b2^T_w) + eps (deepspeed: sqrt(v) + eps), once, into the denominator."""
        state = self.adam_state()
        t_w = float(state["step"])
        torch.sqrt(state["exp_avg_sq"], out=self._denom)
        if not self.deepspeed:
            self._denom.div_((1 - self.config.beta2**t_w) ** 0.5)
        self._denom.add_(self.config.eps)
        self._frozen = True

    def _encode_worker(self, u: torch.Tensor, err: torch.Tensor) -> None:
        """Chunk k of C(u) into ``_send[k]`` and C(u) into ``err`` (per-chunk scales, or one for deepspeed)."""
        codec, L, n = self.codec, self.chunk, self.comm.size
        if not self.deepspeed:
            for k in range(n):
                self._send[k].copy_(codec.encode(u[k * L:(k + 1) * L]))
                codec.decode(self._send[k], L, out=err[k * L:(k + 1) * L])
            return
        whole = self._whole
        whole.copy_(codec.encode(u))
        codec.decode(whole, self.padded, out=err)
        bits = whole[4:].view(n, L // 8)                         # chunk k's signs: bytes [k L/8, (k+1) L/8)
        self._send[:, :4].copy_(whole[:4].expand(n, 4))
        self._send[:, 4:].copy_(bits)

    def _compressed_step(self, grad: torch.Tensor) -> None:
        """One compression-phase step: worker compression, all-to-all, server compression, allgather, update."""
        if not self._frozen:
            self._freeze()
        cfg, codec = self.config, self.codec
        n, d, L, rank = self.comm.size, self.flat.numel, self.chunk, self.comm.rank
        m = self.adam_state()["exp_avg"]
        u, err = self._u, self.worker_error
        torch.lerp(m, grad, 1 - cfg.beta1, out=u[:d])          # m_i
        u[d:].zero_()                                            # padding (u held m-bar last step)
        u.add_(err)                                              # u_i = m_i + e_i
        self._encode_worker(u, err)
        torch.sub(u, err, out=err)                               # e_i = u_i - C(u_i)
        err[d:].zero_()

        received = self.comm.alltoall(self._send, out=self._recv)
        server = self._server.zero_()
        for j in range(n):
            server.add_(codec.decode(received[j], L, out=self._scratch))
        server.div_(n)
        server[self._real:].zero_()
        server.add_(self.server_error)                          # s_k = average + e'_k
        self._server_payload.copy_(codec.encode(server))

        gathered = self.comm.allgather(self._server_payload, out=self._gathered)
        mbar = u                                                 # u is free again: reuse it for m
        for k in range(n):
            codec.decode(gathered[k], L, out=mbar[k * L:(k + 1) * L])
        torch.sub(server, mbar[rank * L:(rank + 1) * L], out=self.server_error)
        self.server_error[self._real:].zero_()                  # e'_k = s_k - C(s_k)
        m.copy_(mbar[:d])

        x = self.flat.data
        if cfg.weight_decay:
            x.mul_(1 - self.lr * cfg.weight_decay)
        correction = 1.0 if self.deepspeed else 1 - cfg.beta1 ** (self.step_count + 1)
        x.addcdiv_(m, self._denom, value=-self.lr / correction)

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
        out.update(phase=self.phase, worker_error=self.worker_error.clone(), server_error=self.server_error.clone())
        return out

    def _load_extra_state(self, extra):
        for key, buf in (("worker_error", self.worker_error), ("server_error", self.server_error)):
            if tuple(extra[key].shape) != tuple(buf.shape):
                raise ValueError(
                    f"state's {key} has shape {tuple(extra[key].shape)}, expected {tuple(buf.shape)}: "
                    f"it was saved with a different number of ranks or model"
                )
        if extra["phase"] != self.phase:
            raise ValueError(f"state says phase {extra['phase']!r} at step {self.step_count}, "
                             f"but the warm-up of {self.warmup} steps puts it in {self.phase!r}")
        super()._load_extra_state(extra)
        self.worker_error.copy_(extra["worker_error"])
        self.server_error.copy_(extra["server_error"])
        self._frozen = False
