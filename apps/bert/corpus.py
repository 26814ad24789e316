"""Text for BERT pre-training: documents, a fixed train/validation split, and fixed-length sequences.

Sources (``load_documents``):

* ``None`` or ``""``: the embedded default, real English that ships with Python itself — the
  documentation topics of ``pydoc_data.topics`` (79 topics, ~0.5 MB of text), one document per topic;
  or, with ``dataset="python-docs"``, the standard library's docstrings and comments (~5 MB,
  :mod:`.documents`; built once by the set-up).
* a folder: every ``*.txt`` file below it (sorted by path), one document per file; a folder holding a
  single file is treated like that file.
* a ``.txt`` file: one document per paragraph (blocks separated by blank lines), or per line when the
  file has no blank lines.

``split_documents`` holds out a fraction of the documents (a seeded permutation, so the split is
deterministic and documents never straddle it). ``pack_sequences`` tokenizes each split (the
pre-tokenizer splits at every line break and space, so a document is its lines' words in order),
joins the documents into one stream with ``[SEP]`` between documents (RoBERTa's "full-sentences"
packing), and cuts it into ``[CLS] … [SEP]`` sequences of exactly ``seq_len`` tokens; only the last one
is padded. ``shard`` deals the training sequences to ranks round-robin (``rank::size``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

__all__ = ["DATASETS", "load_documents", "pack_sequences", "shard", "split_documents"]


def _read(path: Path) -> str:
    """A text file's contents; a binary or non-UTF-8 file is a ``ValueError`` naming it (training on it is noise)."""
    data = path.read_bytes()
    if b"\0" in data:
        raise ValueError(f"--data: {path} is not text (it holds NUL bytes: a binary file?)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--data: {path} is not UTF-8 text (byte {exc.start}); convert it, e.g. "
                         f"iconv -f latin1 -t utf-8") from None


def _paragraphs(text: str) -> list[str]:
    blocks = [b for b in re.split(r"\n(?:[ \t\r\f\v]*\n)+", text) if b.strip()]
    return blocks if len(blocks) > 1 else [line for line in text.splitlines() if line.strip()]


def _default_documents() -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # some stripped-down Python builds omit pydoc_data
        raise ValueError("--data not given and this Python lacks pydoc_data (the embedded default corpus); "
                         "pass --data PATH (a .txt file or a folder of .txt files)") from exc
    return [topics[name] for name in sorted(topics)]


DATASETS = ("pydoc", "python-docs")


def load_documents(data: str | os.PathLike | None, dataset: str = "pydoc") -> list[str]:
    """The corpus at ``data`` as a list of non-empty documents (see the module docstring for the rules);
    without ``data``, the named ``dataset``: ``pydoc`` (embedded) or ``python-docs`` (:mod:`.documents`)."""
    if data is not None and not isinstance(data, (str, os.PathLike)):
        raise TypeError(f"--data must be a path or None, got {type(data).__name__}")
    if dataset not in DATASETS:
        raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}, got {dataset!r}")
    if (data is None or str(data) == "") and dataset == "python-docs":
        from data.cache import cache_dir

        from .documents import load_python_docs

        docs = load_python_docs(cache_dir())
    elif data is None or str(data) == "":
        docs = _default_documents()
    else:
        path = Path(data)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*.txt") if p.is_file())
            if not files:
                raise ValueError(f"--data: no .txt files in {path}")
            docs = [_read(f) for f in files] if len(files) > 1 else _paragraphs(_read(files[0]))
        elif path.is_file():
            docs = _paragraphs(_read(path))
        elif path.exists():
            raise ValueError(f"--data: {path} is neither a file nor a folder (a device, pipe or socket); "
                             "expected a .txt file or a folder of .txt files")
        else:
            raise ValueError(f"--data: {path} does not exist (expected a .txt file or a folder of .txt files)")
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ValueError(f"--data: the corpus at {data or 'pydoc_data.topics'} is empty (no non-blank text)")
    return docs


def split_documents(docs: list[str], seed: int, val_fraction: float = 0.05) -> tuple[list[str], list[str]]:
    """(train, validation) documents: a ``seed``-ed permutation puts ``max(1, round(f * n))`` in validation.

    Both lists keep the corpus order; the split is a pure function of (documents, seed, fraction).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if len(docs) < 2:
        raise ValueError(f"--data: need at least 2 documents to hold one out for validation, got {len(docs)}")
    n_val = min(max(1, round(val_fraction * len(docs))), len(docs) - 1)
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    held_out = set(order[:n_val])
    train = [d for i, d in enumerate(docs) if i not in held_out]
    val = [d for i, d in enumerate(docs) if i in held_out]
    return train, val


def pack_sequences(tokenizer, docs: list[str], seq_len: int) -> torch.Tensor:
    """``docs`` as an int64 tensor (N, seq_len) of ``[CLS] … [SEP]`` rows cut from one token stream.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` with the ``[CLS] [SEP] [PAD]`` tokens; documents are
    separated by ``[SEP]``; the last row is right-padded with ``[PAD]``.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 3:
        raise ValueError(f"--seq-len must be an integer >= 3, got {seq_len!r}")
    cls_id, sep_id, pad_id = (tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]", "[PAD]"))
    stream: list[int] = []
    for index, encoding in enumerate(tokenizer.encode_batch(docs, add_special_tokens=False)):
        if index:
            stream.append(sep_id)
        stream.extend(encoding.ids)
    body = seq_len - 2
    rows = []
    for start in range(0, len(stream), body):
        chunk = stream[start:start + body]
        rows.append([cls_id, *chunk, sep_id] + [pad_id] * (body - len(chunk)))
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, seq_len)


def shard(sequences: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s IID share of ``sequences``: rows ``rank, rank + size, …``."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive integer, got {size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"rank must be an integer in [0, {size}), got {rank!r}")
    return sequences[rank::size]
