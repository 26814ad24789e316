"""When the 1-bit family freezes Adam's variance: at a step given, or once it has settled, within set parts of the run.

APMSqueeze (the end of its warm-up), 1-bit LAMB (``freeze_step``) and 0/1 Adam (``var_freeze_step``) stop updating
Adam's second moment v and compress from then on with v as it was. Frozen too early, v is the variance of a model
that has not started to learn: on the BERT masked-LM yardstick (docs/results/bert_mlm.md, 600 steps) all three froze
at step 120, on the loss plateau that AllReduce-Adam leaves between steps 150 and 300, and ended at the input-blind
baseline; frozen at step 300 they learned.

:class:`FreezePolicy`, for a run of T steps (``total_steps``, which the apps fill in) and no step given: the freeze
comes after the first step t >= ceil(``MIN_FRACTION`` T) at which the typical Adam denominator

    s_t = mean_j sqrt(v_t,j / (1 - b2^t))          (bias-corrected: the estimate, not the EMA filling up)

has changed by less than ``TOLERANCE`` relatively over the last K = max(1, round(``WINDOW_FRACTION`` T)) steps, |s_t
- s_(t-K)| < TOLERANCE s_t, and after step floor(``MAX_FRACTION`` T) at the latest, so that at least half the run
compresses. The bounds are the papers': APMSqueeze runs Adam for 15 % of BERT's training, DeepSpeed's 1-bit Adam
tutorials freeze at 15-25 %; where v has settled by 20 % the policy is a fixed warm-up of 20 %. The settling test is
the variance-change criterion the 1-bit Adam and 0/1 Adam papers discuss (the L1 norm of v flattens once training
leaves its first phase), on one scalar per step: no memory beyond K + 1 floats. The tolerance, 10 %, was set on the
BERT yardstick's first seed (3,000 steps): there s still changed by 8.1 % over the window at 20 % of the run and
fell under 5 % only at 26 % (docs/algorithms/apmsqueeze.md). The step, the reason ("settled", "latest" or "given")
and s's last relative change are the method's ``metrics()``, in every train record of the app's metrics.jsonl.
"""

from __future__ import annotations

import math
from collections import deque

import torch

__all__ = ["MAX_FRACTION", "MIN_FRACTION", "TOLERANCE", "WINDOW_FRACTION", "FreezePolicy", "typical_denominator"]

MIN_FRACTION = 0.2
MAX_FRACTION = 0.5
WINDOW_FRACTION = 0.05
TOLERANCE = 0.1


class FreezePolicy:
    """Decides, after each step, whether v freezes now: at ``fixed`` (a step count, when given), else by the
    settling test on a run of ``total_steps`` (see the module docstring). ``name``: the method, for its messages."""

    def __init__(self, name: str, fixed: int | None, total_steps: int | None):
        self.fixed, self.total = fixed, total_steps
        self.frozen_at: int | None = None
        self.reason = ""
        self.change: float | None = None  # s's relative change over the window at the last check
        if fixed is None and total_steps is not None:
            self.earliest = max(1, math.ceil(MIN_FRACTION * total_steps))
            self.latest = max(self.earliest, math.floor(MAX_FRACTION * total_steps))
            self.window = max(1, round(WINDOW_FRACTION * total_steps))
            if self.latest >= total_steps:
                raise ValueError(f"{name}: a run of {total_steps} step(s) is too short to compress at all: the "
                                 f"variance is measured for at least {self.earliest} step(s) and compression starts "
                                 "after them; train longer, or use allreduce_adam")
        self._history: deque = deque(maxlen=getattr(self, "window", 0) + 1)  # s at the window's steps

    @property
    def adaptive(self) -> bool:
        """Whether the freeze step is decided by the settling test (no step given, the run's length known)."""
        return self.fixed is None and self.total is not None

    def needs_scale(self, step: int) -> bool:
        """Whether :meth:`after_step` needs s at ``step`` (the steps it is compared over, up to the freeze)."""
        return self.adaptive and self.frozen_at is None and step >= self.earliest - self.window

    def after_step(self, step: int, scale: float | None = None) -> bool:
        """After step ``step`` (1-based) of the warm-up, with s there (``scale``, when :meth:`needs_scale`): whether
        v freezes now (compression from step ``step`` + 1 on). Decided once; the same on every rank, as v is."""
        if self.frozen_at is not None:
            return False
        if not self.adaptive:
            if self.fixed is not None and step >= self.fixed:
                self._freeze(step, "given")
            return self.frozen_at is not None
        if scale is not None:
            self._history.append(scale)
        if step < self.earliest:
            return False
        if len(self._history) == self._history.maxlen and scale:
            self.change = abs(scale - self._history[0]) / scale
            if self.change < TOLERANCE:
                self._freeze(step, "settled")
        if self.frozen_at is None and step >= self.latest:
            self._freeze(step, "latest")
        return self.frozen_at is not None

    def decide(self, step: int, v: torch.Tensor, beta2: float, comm=None, numel: int | None = None) -> bool:
        """:meth:`after_step` with s computed from Adam's ``v`` when it is needed (:func:`typical_denominator`; ``comm``
        and ``numel`` for a shard of v). Collective with ``comm`` when s is needed."""
        scale = typical_denominator(v, step, beta2, comm, numel) if self.needs_scale(step) else None
        return self.after_step(step, scale)

    def _freeze(self, step: int, reason: str) -> None:
        self.frozen_at, self.reason = step, reason

    def metrics(self) -> dict:
        """``variance_frozen_at`` (the last step that measured v; None until then), why, and s's last change."""
        return {"variance_frozen_at": self.frozen_at, "variance_frozen_because": self.reason or None,
                "variance_change": self.change}

    def state_dict(self) -> dict:
        """What a resume needs: the freeze step and reason, and the window of s."""
        return {"frozen_at": -1 if self.frozen_at is None else self.frozen_at, "reason": self.reason,
                "history": torch.tensor(list(self._history), dtype=torch.float64),
                "change": -1.0 if self.change is None else self.change}

    def load_state_dict(self, saved: dict | None, step: int, legacy_frozen: bool) -> None:
        """Restore :meth:`state_dict`; ``saved`` None (a checkpoint from before the policy): frozen at ``step`` if
        ``legacy_frozen`` (the checkpoint was in its compression phase), else not yet."""
        if saved is None:
            self.frozen_at, self.reason = (step, "given") if legacy_frozen else (None, "")
            return
        frozen = int(saved["frozen_at"])
        self.frozen_at = None if frozen < 0 else frozen
        self.reason = str(saved["reason"])
        self.change = None if float(saved["change"]) < 0 else float(saved["change"])
        self._history.clear()
        self._history.extend(float(x) for x in saved["history"])


def typical_denominator(v: torch.Tensor, step: int, beta2: float, comm=None, numel: int | None = None) -> float:
    """s = mean_j sqrt(v_j / (1 - beta2^step)) over the model: ``v`` whole, or one rank's shard of it (``comm``
    then sums the shards and ``numel`` is the model's size; collective)."""
    total = torch.sqrt(v).sum(dtype=torch.float64).reshape(1)
    if comm is not None:
        comm.allreduce(total)
    return float(total) / (numel or v.numel()) / math.sqrt(1 - beta2**step)
