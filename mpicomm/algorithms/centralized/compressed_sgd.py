"""Centralized SGD with compressed gradients exchanged by allgather: QSGD, TernGrad, SignSGD, EF-SignSGD.

Every algorithm here runs the same step on rank i (x the shared iterate, g_i the local stochastic
gradient, C a codec seeded with ``seed + rank``, n ranks)::

    payload_i = encode(g_i)                              (packed bytes, d-independent header inside)
    all ranks: payloads = allgather(payload_i)           (each rank sends (n-1) * payload_bytes(d))
    S         = sum_r decode(payload_r)                  (recursive-doubling order, see allgather_sum)
    u         = aggregate(S)                             (mean S/n, or the majority vote sign(S))
    u        <- u + weight_decay * x                     (x is identical everywhere: decay is not sent)
    m <- mu m + u;  x <- x - alpha * m                   (torch.optim.SGD; plain SGD when mu = 0)

and with error feedback (EF-SGD, Karimireddy, Rebjock, Stich, Jaggi, "Error Feedback Fixes SignSGD and
other Gradient Compression Schemes", ICML 2019) the compressed quantity is the step itself::

    p_i = alpha * g_i + e_i;   Delta_i = C(p_i);   e_i <- p_i - Delta_i      (e_i starts at 0)
    u   = (1/n) sum_r Delta_r + alpha * weight_decay * x;   m <- mu m + u;  x <- x - m

Registered algorithms:

* ``compressed_sgd``: any codec of ``mpicomm.codecs.CODECS`` by name, mean aggregation, optional
  error feedback. With the lossless ``identity`` codec it is AllReduce-SGD bit for bit: the sum is
  formed in the order MPICH's allreduce adds (any MPI for n <= 2), then divided by n as
  ``allreduce_sgd`` does, and weight decay and the SGD step are the same code.
* ``qsgd``: QSGDCodec(bits, bucket_size), unbiased (Alistarh, Grubic, Li, Tomioka, Vojnovic, "QSGD:
  Communication-Efficient SGD via Gradient Quantization and Encoding", NeurIPS 2017).
* ``terngrad``: TernGradCodec, unbiased, one max-norm scale (Wen, Xu, Yan, Wu, Wang, Chen, Li,
  "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep Learning", NeurIPS 2017).
* ``signsgd``: SignCodec(scale="none") and majority vote u = sign(sum_r sign(g_r)) (Bernstein, Zhao,
  Azizzadenesheli, Anandkumar, "signSGD with Majority Vote is Communication Efficient and Fault
  Tolerant", ICLR 2019). Encoding maps 0 to +1 (the codec's rule); a tied vote (possible only for
  even n) gives 0, so a coordinate the ranks disagree on evenly does not move. With mu = 0 the step
  is x <- x - alpha * (vote + weight_decay * x).
* ``ef_signsgd``: SignCodec(scale="l1"), C(p) = (||p||_1 / d) sign(p), with error feedback.

With a user optimizer (``optimizer=opt``; not with error feedback, whose compressed quantity is the
step alpha g + e itself) the last line is ``opt.step()`` on u. ``clip_grad_norm_`` clips u (the
aggregated direction, the same on every rank; not with error feedback).

``overlap=True`` (``compressed_sgd``, ``qsgd``, ``signsgd``) encodes and ``iallgather``-s gradient buckets
while backward is still running, DDP's buckets with their boundaries moved to multiples of the codec's
``split_alignment`` (QSGD: bucket_size), and decodes and sums them after backward
(:class:`~mpicomm.algorithms.overlapped_sum.OverlappedPayloadSum`). Every step of the update above is
elementwise once the scales are known, and each QSGD scale block lies inside one bucket, so the result is
bit-identical to the whole-gradient path, random stream included (the uniforms are drawn for the whole
gradient at the first launch, as one encode would draw them). Refused, with a ValueError: ``terngrad``
(one max-norm scale over the whole gradient; ``qsgd`` with bits=2 and a bucket_size is its per-bucket
form), ``ef_signsgd`` (one l1 scale over the whole step) and any codec with a global scale (uniform,
top-k, random-k, hsq, sign with an l1/l2 scale, qsgd with bucket_size=None). Wire bytes: each bucket's
bit codes are padded to a whole byte, so at most one byte more per bucket than one payload.

Memory beyond the model: the codec's scratch, O(log n) decode buffers, torch's momentum buffer, and
for error feedback the error vector e (d floats). State (momentum, e, codec RNG) is in state_dict().
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from ..codecs import CODECS, Codec, QSGDCodec, SignCodec, TernGradCodec
from .allgather_sum import PayloadSum
from .base import Algorithm, check_range, clone_optimizer_state
from .buckets import LaunchedTraffic, OverlapConfig
from .overlapped_sum import OverlappedPayloadSum
from .registry import register

__all__ = [
    "CompressedSGD",
    "CompressedSGDConfig",
    "EFSignSGD",
    "EFSignSGDConfig",
    "GlobalScaleConfig",
    "QSGD",
    "QSGDConfig",
    "SignSGD",
    "TernGrad",
    "TernGradConfig",
    "build_codec",
]


def build_codec(name: str, options: dict, seed: int) -> Codec:
    """Codec ``name`` with keyword ``options``, given ``seed`` if it takes one (ValueError if it does not fit)."""
    if name not in CODECS:
        raise ValueError(f"codec must be one of {sorted(CODECS)}, got {name!r}")
    if not isinstance(options, dict):
        raise TypeError(f"codec_options must be a dict of keyword arguments, got {type(options).__name__}")
    if "seed" in options:
        raise ValueError("codec_options must not contain 'seed': the codec is seeded with config.seed + rank")
    kwargs = dict(options)
    if "seed" in inspect.signature(CODECS[name]).parameters:
        kwargs["seed"] = seed
    try:
        return CODECS[name](**kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"codec_options {options!r} do not fit codec {name!r}: {exc}") from exc


def _check_int(name: str, value, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    check_range(name, value, lo=lo, hi=hi)


OVERLAP_CODECS = "identity, fp16, bf16, qsgd (a scale per bucket_size elements) and sign with scale=none"


@dataclass(frozen=True)
class CompressedSGDConfig(OverlapConfig):
    """codec: a name in ``mpicomm.codecs.CODECS``; codec_options: its keyword arguments (not seed);
    error_feedback: compress alpha*g + e and keep e (EF-SGD). overlap: encode and allgather gradient
    buckets during backward (codecs whose encoding can be cut only: identity, fp16, bf16, qsgd, sign with
    scale=none)."""

    codec: str = "identity"
    codec_options: dict = field(default_factory=dict)
    error_feedback: bool = False

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.error_feedback, bool):
            raise TypeError(f"error_feedback must be a bool, got {self.error_feedback!r}")
        codec = build_codec(self.codec, self.codec_options, self.seed)
        if self.overlap and codec.split_alignment() is None:
            raise ValueError(f"compressed_sgd cannot overlap with {codec!r}: its encoding has one scale over the "
                             f"whole gradient, known only after backward; overlap works with {OVERLAP_CODECS}")


@dataclass(frozen=True)
class QSGDConfig(OverlapConfig):
    """bits: 1 sign + bits-1 magnitude bits per element, in [2, 8]; bucket_size: elements per max-norm scale.
    overlap: encode and allgather gradient buckets (cut on multiples of bucket_size) during backward."""

    bits: int = 4
    bucket_size: int = 512

    def __post_init__(self):
        super().__post_init__()
        _check_int("bits", self.bits, 2, 8)
        _check_int("bucket_size", self.bucket_size, 1)


@dataclass(frozen=True)
class GlobalScaleConfig(OverlapConfig):
    """overlap: refused (ValueError): the method's one scale spans the whole gradient."""

    method = "this method"
    refusal = "its compression has one scale over the whole gradient, known only after backward"

    def __post_init__(self):
        super().__post_init__()
        if self.overlap:
            raise ValueError(f"{self.method} cannot overlap: {self.refusal}")


@dataclass(frozen=True)
class TernGradConfig(GlobalScaleConfig):
    """TernGrad's options (no overlap: one max-norm scale)."""

    method = "terngrad"
    refusal = ("its one max-norm scale spans the whole gradient, known only after backward (qsgd with bits=2 "
               "and a bucket_size is TernGrad with a scale per bucket, and overlaps)")


@dataclass(frozen=True)
class EFSignSGDConfig(GlobalScaleConfig):
    """EF-SignSGD's options (no overlap: one l1 scale)."""

    method = "ef_signsgd"
    refusal = ("its scale ||p||_1 / d spans the whole step p = lr*g + e, known only after backward (a scale "
               "per bucket would be another method)")


@register
class CompressedSGD(LaunchedTraffic, Algorithm):
    """Allgather of codec payloads, decode and average (or vote) on every rank, then local SGD."""

    name = "compressed_sgd"
    config_class = CompressedSGDConfig
    centralized = True
    clips_average = True
    takes_optimizer = True

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        self.codec = self._make_codec(self.config.seed + self.comm.rank)
        self.payload_sum = PayloadSum(self.comm, self.codec, self.flat.numel)
        self.error = torch.zeros_like(self.flat.data) if self._error_feedback() else None
        self.optimizer = self._local_sgd()
        self.overlapped = (OverlappedPayloadSum(self, self.codec, self.error, self.config.bucket_numel,
                                                self.config.first_bucket_numel) if self.config.overlap else None)

    def _check_user_optimizer(self, optimizer):
        if self.error is not None:
            raise ValueError(f"{self.name}: error feedback compresses lr * g + e, so the step is part of the "
                             "method; use optimizer= without error_feedback, or lr/momentum/weight_decay")

    def clip_grad_norm_(self, max_norm):
        """As :meth:`Algorithm.clip_grad_norm_` (of u); refused with error feedback (u is a step, not a gradient)."""
        if max_norm is not None and self.error is not None:
            raise ValueError(f"{self.name} does not support clip_grad_norm_ with error feedback: what is "
                             "averaged is the compressed step lr * g + e, not a gradient")
        super().clip_grad_norm_(max_norm)

    def _make_codec(self, seed: int) -> Codec:
        """The codec this rank encodes with (seeded with ``seed``)."""
        return build_codec(self.config.codec, self.config.codec_options, seed)

    def _error_feedback(self) -> bool:
        """Whether to compress alpha*g + e and keep the error e."""
        return self.config.error_feedback

    def _aggregate(self, total: torch.Tensor) -> torch.Tensor:
        """Turn the sum of the n decoded payloads into the update direction, in place (here: the mean)."""
        return total.div_(self.comm.size)

    def _prepare(self, grad: torch.Tensor) -> None:
        """With overlap each bucket was divided by the micro-batch count before its encode: nothing here."""
        if self.overlapped is None:
            super()._prepare(grad)

    def _exchange(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad <- sum_r decode(C(p_r))`` with p = g, or alpha*g + e and e <- p - C(p); returns ``grad``."""
        if self.overlapped is not None:
            self._first_launch = self.overlapped.finish(grad)
            return grad
        self._first_launch = None
        if self.error is not None:
            grad.mul_(self.lr).add_(self.error)  # p = alpha*g + e, in the gradient buffer
        payload = self.codec.encode(grad)
        if self.error is not None:
            self.codec.decode(payload, self.flat.numel, out=self.error)  # Delta = C(p), what every rank decodes
            torch.sub(grad, self.error, out=self.error)  # e <- p - Delta
        return self.payload_sum(payload, out=grad)

    def _step(self, grad: torch.Tensor) -> None:
        self._aggregate(self._exchange(grad))
        if self.error is None:
            self._clip(grad)
            self._decayed(grad)
            self._local_step()
            return
        if self.config.weight_decay:
            grad.add_(self.flat.data, alpha=self.lr * self.config.weight_decay)
        self._sgd_step(self.optimizer, 1.0)

    def _extra_state(self):
        state = {"optimizer": clone_optimizer_state(self.optimizer), "codec": self.codec.state_dict()}
        if self.error is not None:
            state["error"] = self.error.clone()
        return state

    def _load_extra_state(self, extra):
        self.optimizer.load_state_dict(extra["optimizer"])
        self.codec.load_state_dict(extra["codec"])
        if self.error is not None:
            self.error.copy_(extra["error"])


@register
class QSGD(CompressedSGD):
    """QSGD: unbiased ``bits``-bit stochastic quantization with a max-norm scale per bucket."""

    name = "qsgd"
    config_class = QSGDConfig

    def _make_codec(self, seed):
        return QSGDCodec(self.config.bits, self.config.bucket_size, seed=seed)

    def _error_feedback(self):
        return False


@register
class TernGrad(CompressedSGD):
    """TernGrad: gradients in max|g| * {-1, 0, +1}, stochastic and unbiased."""

    name = "terngrad"
    config_class = TernGradConfig

    def _make_codec(self, seed):
        return TernGradCodec(seed=seed)

    def _error_feedback(self):
        return False


@register
class SignSGD(CompressedSGD):
    """SignSGD with majority vote: step along sign(sum_r sign(g_r)) (ties give 0)."""

    name = "signsgd"
    config_class = OverlapConfig

    def _make_codec(self, seed):
        return SignCodec(scale="none")

    def _error_feedback(self):
        return False

    def _aggregate(self, total):
        return total.sign_()


@register
class EFSignSGD(CompressedSGD):
    """EF-SignSGD: error-compensated scaled sign (||p||_1/d) sign(p) of p = alpha*g + e, averaged."""

    name = "ef_signsgd"
    config_class = EFSignSGDConfig
    takes_optimizer = False
    optimizer_refusal = ("its error feedback compresses lr * g, so the step is part of the method; "
                         "set lr, momentum and weight_decay instead")

    def _make_codec(self, seed):
        return SignCodec(scale="l1")

    def _error_feedback(self):
        return True
