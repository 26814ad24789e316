"""Centralized SGD with compressed gradients exchanged by allgather: QSGD, TernGrad, SignSGD, EF-SignSGD.

Every algorithm here runs the same step on rank i (x the shared iterate, C a codec seeded with seed + rank)::

    payloads = allgather(encode(g_i));   S = sum_r decode(payload_r)   (recursive-doubling order)
    u = aggregate(S)                     (mean S/n, or the majority vote sign(S))
    u <- u + weight_decay * x;   m <- mu m + u;   x <- x - alpha * m      (torch.optim.SGD)

and with error feedback (Karimireddy et al., ICML 2019) the compressed quantity is the step itself::

    p_i = alpha g_i + e_i;   Delta_i = C(p_i);   e_i <- p_i - Delta_i;   u = (1/n) sum_r Delta_r + alpha wd x

``compressed_sgd``: any codec of ``mpicomm.codecs.CODECS`` (identity: ``allreduce_sgd`` bit for bit);
``qsgd``: QSGD (Alistarh et al., NeurIPS 2017); ``terngrad``: TernGrad (Wen et al., NeurIPS 2017);
``signsgd``: majority vote (Bernstein et al., ICLR 2019); ``ef_signsgd``: l1-scaled sign with error
feedback. ``overlap=True`` encodes and allgathers buckets during backward, bit-identical. Details, the
refused combinations and memory: ``docs/algorithms/centralized.md``.

``hierarchical`` (auto: on over several nodes of several ranks; :mod:`~mpicomm.algorithms.shared.hierarchy`)
runs the step in two levels. Node a's rank of local rank j holds s_a = sum_{i on a} g_i[shard j], summed in
full precision by a reduce-scatter inside the node; only s_a is compressed (p_a = alpha s_a + e_a with
error feedback, e_a shard-sized), allgathered among the N ranks of local rank j (one per node) and summed,
and the N-way sum goes back to the node's ranks by an allgather inside the node. The intra-node sum is exact,
so what changes is who the participants are: N nodes, each carrying the sum of L gradients, per shard.
QSGD's and TernGrad's arguments hold as they are: the codec is unbiased per element, so
E[sum_a C(s_a)] = sum_a s_a = sum_i g_i, and QSGD's variance bound (Alistarh et al. 2017, Lemma 3.1) applies
per shard (its buckets start again at each shard) to N compressed vectors instead of n, each the sum of L
gradients; TernGrad's scale becomes max |s_a| of each shard (Wen et al. 2017 bound each compressed vector
by its own scale). SignSGD votes by node: sign(sum_a sign(s_a)), the majority
of N voters each the sign of its node's sum (Bernstein et al. 2019's vote, with nodes as voters). EF-SignSGD
scales each shard by its own ||p_a||_1 / len (Karimireddy et al. 2019's argument needs only a compressor
with ||C(p) - p||^2 <= (1 - delta) ||p||^2, which the scaled sign is on each shard).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from ...checkpoint.resize_rules import own_rank, residual_mean
from ...codecs import CODECS, Codec, QSGDCodec, SignCodec, TernGradCodec
from ...codecs.base import check_float32
from ..base import Algorithm, check_range, clone_optimizer_state
from ..shared.allgather_sum import PayloadSum
from ..shared.buckets import LaunchedTraffic
from ..shared.hierarchy import TwoLevelConfig, two_level_for
from .overlapped_sum import OverlappedPayloadSum

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
class CompressedSGDConfig(TwoLevelConfig):
    """codec: a name in ``mpicomm.codecs.CODECS``; the default, identity, compresses nothing (AllReduce-SGD's
    step bit for bit, its gradients sent whole by allgather): name one to compress, e.g. qsgd, topk or fp16;
    codec_options: its keyword arguments (not seed);
    error_feedback: compress alpha*g + e and keep e (EF-SGD). overlap: encode and allgather gradient
    buckets during backward (codecs whose encoding can be cut only: identity, fp16, bf16, qsgd, sign with
    scale=none). hierarchical: see TwoLevelConfig."""

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
class QSGDConfig(TwoLevelConfig):
    """bits: 1 sign + bits-1 magnitude bits per element, in [2, 8]; bucket_size: elements per max-norm scale.
    overlap: encode and allgather gradient buckets (cut on multiples of bucket_size) during backward."""

    bits: int = 4
    bucket_size: int = 512

    def __post_init__(self):
        super().__post_init__()
        _check_int("bits", self.bits, 2, 8)
        _check_int("bucket_size", self.bucket_size, 1)


@dataclass(frozen=True)
class GlobalScaleConfig(TwoLevelConfig):
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


class CompressedSGD(LaunchedTraffic, Algorithm):
    """Allgather of codec payloads, decode and average (or vote) on every rank, then local SGD."""

    name = "compressed_sgd"
    config_class = CompressedSGDConfig
    centralized = True
    clips_average = True
    takes_optimizer = True
    resize_sharded = True

    def __init__(self, model, comm, config=None):
        super().__init__(model, comm, config)
        check_float32(self.name, self.flat.data)
        self.codec = self._make_codec(self.config.seed + self.comm.rank)
        self.two_level = two_level_for(self.config, self.comm, self.flat.numel, self.flat.grad)
        if self.two_level is None:
            self.payload_sum = PayloadSum(self.comm, self.codec, self.flat.numel)
            self.error = torch.zeros_like(self.flat.data) if self._error_feedback() else None
        else:  # the node's summed shard is what is compressed and error-compensated
            self.payload_sum = PayloadSum(self.two_level.cross, self.codec, self.two_level.shard.numel())
            self.error = torch.zeros_like(self.two_level.shard) if self._error_feedback() else None
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
        if self.two_level is None:
            p, out = grad, grad
        else:  # p = the node's sum of this rank's shard; the sum over nodes lands in the shard of grad
            p, out = self.two_level.reduce(grad), grad[self.two_level.lo:self.two_level.hi]
        if self.error is not None:
            p.mul_(self.lr).add_(self.error)  # p = alpha*g + e, in the gradient (or shard) buffer
        payload = self.codec.encode(p)
        if self.error is not None:
            self.codec.decode(payload, p.numel(), out=self.error)  # Delta = C(p), what every rank decodes
            torch.sub(p, self.error, out=self.error)  # e <- p - Delta
        self.payload_sum(payload, out=out)
        return grad if self.two_level is None else self.two_level.spread(grad)

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

    def _resize_rules(self):
        """On a resize each rank's codec generator is its own (:func:`own_rank`) and its error-feedback residual
        the saved residuals' mean (:func:`residual_mean`: what is still owed is kept)."""
        rules = {**super()._resize_rules(), "extra.codec": own_rank}
        if self.error is not None:
            rules["extra.error"] = residual_mean
        return rules


class QSGD(CompressedSGD):
    """QSGD: unbiased ``bits``-bit stochastic quantization with a max-norm scale per bucket."""

    name = "qsgd"
    config_class = QSGDConfig

    def _make_codec(self, seed):
        return QSGDCodec(self.config.bits, self.config.bucket_size, seed=seed)

    def _error_feedback(self):
        return False


class TernGrad(CompressedSGD):
    """TernGrad: gradients in max|g| * {-1, 0, +1}, stochastic and unbiased."""

    name = "terngrad"
    config_class = TernGradConfig

    def _make_codec(self, seed):
        return TernGradCodec(seed=seed)

    def _error_feedback(self):
        return False


class SignSGD(CompressedSGD):
    """SignSGD with majority vote: step along sign(sum_r sign(g_r)) (ties give 0)."""

    name = "signsgd"
    config_class = TwoLevelConfig

    def _make_codec(self, seed):
        return SignCodec(scale="none")

    def _error_feedback(self):
        return False

    def _aggregate(self, total):
        return total.sign_()


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
