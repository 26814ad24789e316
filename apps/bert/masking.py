"""BERT's masked-language-model corruption (Devlin et al., 2019, §3.1 and appendix A.1).

Each non-special token is selected independently with probability ``rate`` (0.15). A selected token is
replaced by ``[MASK]`` with probability 0.8, by a token drawn uniformly from the non-special vocabulary
with probability 0.1, and left unchanged with probability 0.1; its label is its original id. Every other
position (special tokens such as ``[CLS] [SEP] [PAD]`` included) gets the label -100, which
cross-entropy ignores. All draws come from the ``torch.Generator`` the caller passes, so the same
generator state reproduces the same masks.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["IGNORE_INDEX", "Masker"]

IGNORE_INDEX = -100


class Masker:
    """Masks batches of token ids for a vocabulary of ``vocab_size`` ids with the given special ids."""

    def __init__(self, vocab_size: int, special_ids: Iterable[int], mask_id: int, rate: float = 0.15,
                 mask_prob: float = 0.8, random_prob: float = 0.1):
        special = sorted(set(int(i) for i in special_ids))
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= len(special):
            raise ValueError(f"vocab_size must be an integer > the {len(special)} special ids, got {vocab_size!r}")
        if any(not 0 <= i < vocab_size for i in special):
            raise ValueError(f"special_ids must lie in [0, {vocab_size}), got {special}")
        if mask_id not in special:
            raise ValueError(f"mask_id {mask_id} must be one of the special_ids {special}")
        if not 0.0 < rate < 1.0:
            raise ValueError(f"rate must be in (0, 1), got {rate}")
        if mask_prob < 0 or random_prob < 0 or mask_prob + random_prob > 1:
            raise ValueError(f"mask_prob and random_prob must be >= 0 with sum <= 1, got {mask_prob}, {random_prob}")
        self.vocab_size, self.mask_id, self.rate = vocab_size, mask_id, rate
        self.mask_prob, self.random_prob = mask_prob, random_prob
        self.special = torch.tensor(special, dtype=torch.int64)
        keep = torch.ones(vocab_size, dtype=torch.bool)
        keep[self.special] = False
        self.candidates = torch.arange(vocab_size)[keep]

    def __call__(self, input_ids: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(corrupted ids, labels) for int64 ``input_ids`` of any shape; ``input_ids`` is not modified."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.int64:
            raise TypeError(f"input_ids must be an int64 tensor, got {getattr(input_ids, 'dtype', type(input_ids))}")
        shape = input_ids.shape
        selected = (torch.rand(shape, generator=generator) < self.rate) & ~torch.isin(input_ids, self.special)
        u = torch.rand(shape, generator=generator)
        random_ids = self.candidates[torch.randint(len(self.candidates), shape, generator=generator)]
        to_mask = selected & (u < self.mask_prob)
        to_random = selected & (u >= self.mask_prob) & (u < self.mask_prob + self.random_prob)
        corrupted = torch.where(to_mask, self.mask_id, torch.where(to_random, random_ids, input_ids))
        labels = torch.where(selected, input_ids, IGNORE_INDEX)
        return corrupted, labels
