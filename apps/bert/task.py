"""The BERT masked-LM Task the training loop consumes: model, this rank's batches, MLM loss, evaluation.

``build_task`` wires the pieces: documents (``corpus``), a train/validation split with the fixed seed
``SPLIT_SEED`` (so every run, whatever its ``--seed``, holds out the same documents and scores the
same validation mask), a WordPiece tokenizer trained on the training documents (``tokenizer``), the
packed sequences, this rank's round-robin shard, and a ``BertForMaskedLM`` of the chosen preset.

Determinism and resume. Batch ``index`` of ``epoch`` on ``rank`` is a pure function of
(seed, rank, epoch, index): the epoch's order is a permutation drawn from a generator seeded by
(seed, rank, epoch), and the batch's masks from a generator seeded by (seed, rank, epoch, index)
(``mask_generator``). So no masking state needs checkpointing beyond the loop's position: resuming at
an epoch boundary is ``train_batches(epoch)``, and resuming mid-epoch is ``train_batches(epoch, start=k)``,
which yields exactly the batches k, k+1, … an uninterrupted run would have seen (it skips without
building the first k). Dropout draws from torch's global generator, which the loop's checkpoint holds.

Batches are dicts of int64 tensors (B, seq_len): ``input_ids`` (corrupted), ``attention_mask``
(1 except at ``[PAD]``) and ``labels`` (original id at the selected positions, -100 elsewhere).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
from tokenizers import Tokenizer
from torch.nn import functional as F
from transformers import BertForMaskedLM

from .corpus import load_documents, pack_sequences, shard, split_documents
from .masking import IGNORE_INDEX, Masker
from .model import build_model, get_preset
from .tokenizer import SPECIAL_TOKENS, obtain_tokenizer

__all__ = ["SPLIT_SEED", "BertTask", "build_task", "check_options"]

SPLIT_SEED = 0
_ORDER, _MASK, _EVAL = 0, 1, 2
_EVAL_CHUNK = 64  # validation sequences per forward pass


def _generator(seed: int, rank: int, epoch: int, stream: int, index: int) -> torch.Generator:
    """A CPU generator seeded from a fixed-length key (fixed length: SeedSequence pads keys with zeros)."""
    state = np.random.SeedSequence([seed, rank, epoch, stream, index]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


def _masked_logits(model: BertForMaskedLM, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and targets at the labelled positions only (the output layer skips the other ~85 %)."""
    if not isinstance(model, BertForMaskedLM):
        raise TypeError(f"model must be a transformers BertForMaskedLM, got {type(model).__name__}")
    device = model.device
    labels = batch["labels"].to(device)
    hidden = model.bert(input_ids=batch["input_ids"].to(device),
                        attention_mask=batch["attention_mask"].to(device)).last_hidden_state
    selected = labels != IGNORE_INDEX
    return model.cls(hidden[selected]), labels[selected]


@dataclass(eq=False)
class BertTask:
    """One rank's masked-LM training task (satisfies ``mpicomm.training.loop.Task``).

    Fields:
        model: the ``BertForMaskedLM`` being trained (identical initial weights on every rank).
        tokenizer: the ``tokenizers.Tokenizer`` that produced the ids (same on every rank).
        masker: the BERT 80/10/10 corruption over this vocabulary (``masking.Masker``).
        train_sequences: int64 (n, seq_len), this rank's shard of the packed training sequences.
        val_inputs: int64 (m, seq_len), the fixed evaluation sequences, already corrupted (fixed mask).
        val_labels: int64 (m, seq_len), their labels (-100 where not selected).
        batch_size: sequences per batch on this rank.
        seed: the run's seed (order, masks and model init derive from it).
        rank: this rank's index (its shard and its generators derive from it).
        steps_per_epoch: batches per epoch, the same on every rank (shards differ by at most one sequence;
            each epoch uses the first ``steps_per_epoch * batch_size`` sequences of a fresh permutation).
        pad_id: id of ``[PAD]`` (attention is masked there).

    ``family``: the task family whose measured accuracy costs ``--algorithm auto`` weighs.
    """

    family: ClassVar[str] = "masked-lm"

    model: BertForMaskedLM = field(repr=False)
    tokenizer: Tokenizer = field(repr=False)
    masker: Masker = field(repr=False)
    train_sequences: torch.Tensor = field(repr=False)
    val_inputs: torch.Tensor = field(repr=False)
    val_labels: torch.Tensor = field(repr=False)
    batch_size: int
    seed: int
    rank: int
    steps_per_epoch: int
    pad_id: int

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The permutation of this rank's shard used in ``epoch`` (seeded by seed, rank, epoch)."""
        return torch.randperm(len(self.train_sequences), generator=_generator(self.seed, self.rank, epoch, _ORDER, 0))

    def mask_generator(self, epoch: int, index: int) -> torch.Generator:
        """The freshly seeded generator that draws batch ``index`` of ``epoch``'s masks."""
        return _generator(self.seed, self.rank, epoch, _MASK, index)

    def train_batches(self, epoch: int, start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Batches ``start``, ``start + 1``, … ``steps_per_epoch - 1`` of ``epoch`` (pure in seed, rank, epoch)."""
        epoch = _integer("epoch", epoch, 0)
        start = _integer("start", start, 0, self.steps_per_epoch)
        return self._batches(epoch, start)

    def _batches(self, epoch: int, start: int) -> Iterator[dict[str, torch.Tensor]]:
        order = self.epoch_order(epoch)
        for index in range(start, self.steps_per_epoch):
            ids = self.train_sequences[order[index * self.batch_size:(index + 1) * self.batch_size]]
            inputs, labels = self.masker(ids, self.mask_generator(epoch, index))
            yield {"input_ids": inputs, "attention_mask": (ids != self.pad_id).long(), "labels": labels}

    def loss(self, model: BertForMaskedLM, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, int]]:
        """Mean MLM cross-entropy over the batch's masked tokens, with ``masked_tokens`` and ``correct`` counts.

        Calls ``model.bert`` then ``model.cls`` on the labelled positions only (the same maths as
        ``model(...)``, about half the time for the tiny preset). A batch without a masked token gives 0.
        """
        logits, targets = _masked_logits(model, batch)
        count = int(targets.numel())
        loss = F.cross_entropy(logits, targets, reduction="sum") / max(count, 1)
        return loss, {"masked_tokens": count, "correct": (logits.argmax(-1) == targets).sum()}

    def evaluate(self, model: BertForMaskedLM) -> dict[str, float]:
        """MLM loss and accuracy on the fixed validation subset and mask (eval mode, no grad; mode restored).

        Every rank holds the same subset (at most ``eval_sequences`` rows) and mask, so equal models
        score equally; the loss is the mean over all masked tokens of the subset.
        """
        was_training = model.training
        model.eval()
        total, correct, count = 0.0, 0, 0
        try:
            with torch.no_grad():
                for begin in range(0, len(self.val_inputs), _EVAL_CHUNK):
                    inputs = self.val_inputs[begin:begin + _EVAL_CHUNK]
                    batch = {"input_ids": inputs, "attention_mask": (inputs != self.pad_id).long(),
                             "labels": self.val_labels[begin:begin + _EVAL_CHUNK]}
                    logits, targets = _masked_logits(model, batch)
                    total += float(F.cross_entropy(logits, targets, reduction="sum"))
                    correct += int((logits.argmax(-1) == targets).sum())
                    count += int(targets.numel())
        finally:
            model.train(was_training)
        return {"val_mlm_loss": total / count, "val_mlm_accuracy": correct / count}


def _integer(name: str, value, minimum: int, maximum: int | None = None) -> int:
    """``value`` as an int in [minimum, maximum] (numpy integers accepted); else a clear error naming it."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    value = operator.index(value)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def check_options(preset: str, seq_len: int, batch_size: int, seed: int, eval_sequences: int) -> tuple:
    """``(preset's architecture, seq_len, batch_size, seed, eval_sequences)`` checked (``ValueError`` naming the
    option otherwise): what :func:`build_task` refuses before it reads any data."""
    arch = get_preset(preset)
    return (arch, _integer("--seq-len", seq_len, 8, arch.max_positions), _integer("--batch-size", batch_size, 1),
            _integer("--seed", seed, 0), _integer("eval_sequences", eval_sequences, 1))


def build_task(preset: str, data: str | os.PathLike | None, tokenizer_path: str | os.PathLike | None,
               seq_len: int, batch_size: int, rank: int, size: int, seed: int, vocab_size: int | None,
               out_dir: str | os.PathLike | None = None, *, dropout: float = 0.1, val_fraction: float = 0.1,
               eval_sequences: int = 256, dataset: str = "pydoc") -> BertTask:
    """Rank ``rank`` of ``size``'s BERT masked-LM task (collective-free: every rank builds the same data).

    ``data``: a .txt file, a folder of .txt files, or None/"" for the named ``dataset`` (``pydoc``, embedded;
    ``python-docs``, built by the set-up).
    ``tokenizer_path``: a saved tokenizer JSON to load; otherwise one is trained on the training documents
    with ``vocab_size`` tokens (None: the preset's default) — deterministically, so every rank gets the
    same one — and cached as ``out_dir/tokenizer-v<V>-<hash>.json`` (written by rank 0) when ``out_dir``
    is given. ``vocab_size`` is ignored when a tokenizer is loaded. ``eval_sequences`` bounds evaluation.
    """
    arch, seq_len, batch_size, seed, eval_sequences = check_options(preset, seq_len, batch_size, seed, eval_sequences)
    size = _integer("size", size, 1)
    rank = _integer("rank", rank, 0, size - 1)
    vocab_size = arch.vocab_size if vocab_size is None else vocab_size

    train_docs, val_docs = split_documents(load_documents(data, dataset), SPLIT_SEED, val_fraction)
    tok = obtain_tokenizer(train_docs, vocab_size, path=tokenizer_path, cache_dir=out_dir, write_cache=rank == 0)
    ids = {name: tok.token_to_id(name) for name in SPECIAL_TOKENS}
    masker = Masker(tok.get_vocab_size(), ids.values(), ids["[MASK]"])
    train_all = pack_sequences(tok, train_docs, seq_len)
    steps_per_epoch = len(train_all) // size // batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"--batch-size {batch_size} is larger than the {len(train_all) // size} training sequences "
                         f"each of the {size} ranks holds ({len(train_all)} sequences of {seq_len} tokens in all); "
                         "lower --batch-size or --seq-len, or give more --data")
    val = pack_sequences(tok, val_docs, seq_len)
    if len(val) > eval_sequences:
        val = val[torch.randperm(len(val), generator=_generator(SPLIT_SEED, 0, 0, _EVAL, 0))[:eval_sequences].sort()[0]]
    val_inputs, val_labels = masker(val, _generator(SPLIT_SEED, 0, 0, _EVAL, 1))
    if not (val_labels != IGNORE_INDEX).any():
        raise ValueError(f"--data: the validation split ({len(val_docs)} documents) yields no masked token; "
                         "give more --data")
    model = build_model(preset, tok.get_vocab_size(), seed=seed, pad_token_id=ids["[PAD]"], dropout=dropout)
    return BertTask(model=model, tokenizer=tok, masker=masker, train_sequences=shard(train_all, rank, size),
                    val_inputs=val_inputs, val_labels=val_labels, batch_size=batch_size, seed=seed, rank=rank,
                    steps_per_epoch=steps_per_epoch, pad_id=ids["[PAD]"])
