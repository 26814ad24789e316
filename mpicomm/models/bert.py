"""BERT masked-LM models built from a preset config, offline and deterministically initialised.

The model is ``transformers.BertForMaskedLM`` constructed from a ``BertConfig`` (random init, no
weights download: nothing here touches the Hugging Face hub, so it runs with ``HF_HUB_OFFLINE=1``).
``transformers`` (the ``apps`` extra) is imported only when a model is built; without it
:func:`build_model` raises one ``ImportError`` that says how to install it.
Initialisation draws from torch's global generator inside ``torch.random.fork_rng``, seeded with
``seed``: the same seed gives bit-identical weights on every rank, and the caller's RNG is untouched.
Dropout draws from the global torch generator during training, which the checkpoint captures
(``torch.get_rng_state``), so dropout does not break exact resume.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PRESETS", "BertPreset", "build_model", "get_preset"]


@dataclass(frozen=True)
class BertPreset:
    """Architecture of one model size (BERT paper notation L/H/A) and its default vocabulary size."""

    layers: int
    hidden: int
    heads: int
    intermediate: int
    max_positions: int
    vocab_size: int


PRESETS: dict[str, BertPreset] = {
    "tiny": BertPreset(layers=2, hidden=64, heads=2, intermediate=128, max_positions=128, vocab_size=4000),
    "base": BertPreset(layers=12, hidden=768, heads=12, intermediate=3072, max_positions=512, vocab_size=30522),
    "large": BertPreset(layers=24, hidden=1024, heads=16, intermediate=4096, max_positions=512, vocab_size=30522),
}


def get_preset(name: str) -> BertPreset:
    """The preset called ``name`` (``ValueError`` naming the choices otherwise)."""
    if name not in PRESETS:
        raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {name!r}")
    return PRESETS[name]


def build_model(preset: str, vocab_size: int, *, seed: int, pad_token_id: int = 0,
                dropout: float = 0.1) -> torch.nn.Module:
    """A freshly initialised ``transformers.BertForMaskedLM`` of ``preset`` size (same ``seed`` -> same weights)."""
    arch = get_preset(preset)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an integer >= 2, got {vocab_size!r}")
    if not 0 <= pad_token_id < vocab_size:
        raise ValueError(f"pad_token_id must be in [0, {vocab_size}), got {pad_token_id}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"--dropout must be in [0, 1), got {dropout}")
    try:
        from transformers import BertConfig, BertForMaskedLM
    except ImportError as exc:
        raise ImportError(f"BERT models need transformers ({exc}); install it with pip install 'mpicomm[apps]'") \
            from None
    config = BertConfig(
        vocab_size=vocab_size, hidden_size=arch.hidden, num_hidden_layers=arch.layers,
        num_attention_heads=arch.heads, intermediate_size=arch.intermediate,
        max_position_embeddings=arch.max_positions, pad_token_id=pad_token_id,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return BertForMaskedLM(config)
