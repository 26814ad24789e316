"""A BERT WordPiece tokenizer trained on the corpus with ``tokenizers``, reproducibly, or loaded from JSON.

Pipeline: BERT normalizer (lower-case, accents stripped), BERT pre-tokenizer (whitespace and
punctuation), WordPiece with ``##`` continuation pieces, ``[CLS] $A [SEP]`` post-processor; special
tokens ``[PAD] [UNK] [CLS] [SEP] [MASK]`` get ids 0-4 when trained here.

Reproducibility: ``tokenizers``' ``WordPieceTrainer`` is not deterministic across processes
(huggingface/tokenizers#1794): it creates the ``##c`` single-character tokens while iterating a hash
map, so their ids (which break ties between equally frequent merges) change from run to run, and so
does the vocabulary. ``train_tokenizer`` hands the trainer every ``##c`` it could create up front, in
sorted order, as extra special tokens, so every id is fixed before the merges start; then it rebuilds
the tokenizer from the learned vocabulary with only the five real special tokens. The same documents
and vocabulary size therefore give the same tokenizer on every rank and in every run, and each rank
can simply train its own. ``obtain_tokenizer`` adds loading from ``--tokenizer PATH`` and a cache file
in the output folder (written atomically by one rank).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import tokenizers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

__all__ = ["SPECIAL_TOKENS", "cache_name", "load_tokenizer", "obtain_tokenizer", "save_tokenizer", "train_tokenizer"]

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_PREFIX = "##"


def _with_pipeline(model) -> Tokenizer:
    tok = Tokenizer(model)
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix=_PREFIX)
    return tok


def _continuation_pieces(tok: Tokenizer, docs: list[str]) -> list[str]:
    """Sorted ``##c`` for every normalized character ``c`` of ``docs`` that can continue a word."""
    chars: set[str] = set()
    for raw in set().union(*map(set, docs)):
        chars.update(tok.normalizer.normalize_str(raw))
    return [_PREFIX + c for c in sorted(chars)
            if not c.isspace() and len(tok.pre_tokenizer.pre_tokenize_str("a" + c)) == 1]


def train_tokenizer(docs: list[str], vocab_size: int) -> Tokenizer:
    """A WordPiece tokenizer with about ``vocab_size`` tokens learned from ``docs`` (deterministic)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"--vocab-size must be an integer > {len(SPECIAL_TOKENS)}, got {vocab_size!r}")
    if not docs:
        raise ValueError("cannot train a tokenizer on an empty list of documents")
    draft = _with_pipeline(models.WordPiece(unk_token="[UNK]", continuing_subword_prefix=_PREFIX))
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False, continuing_subword_prefix=_PREFIX,
        special_tokens=[*SPECIAL_TOKENS, *_continuation_pieces(draft, docs)])
    draft.train_from_iterator(docs, trainer=trainer, length=len(docs))
    vocab = draft.get_vocab(with_added_tokens=True)
    tok = _with_pipeline(models.WordPiece(vocab=vocab, unk_token="[UNK]", continuing_subword_prefix=_PREFIX))
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    cls_id, sep_id = vocab["[CLS]"], vocab["[SEP]"]
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    return tok


def _check(tok: Tokenizer, source: str) -> Tokenizer:
    missing = [t for t in SPECIAL_TOKENS if tok.token_to_id(t) is None]
    if missing:
        raise ValueError(f"--tokenizer: {source} lacks the special token(s) {' '.join(missing)}")
    return tok


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer saved as JSON at ``path`` (it must have all of ``SPECIAL_TOKENS``)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--tokenizer: {path} is not a file (expected a tokenizer .json saved by tokenizers)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
        raise ValueError(f"--tokenizer: {path} is not a tokenizers JSON file ({exc})") from exc
    tok.no_truncation()  # a saved truncation/padding setting would silently cut documents when packing
    tok.no_padding()
    return _check(tok, str(path))


def save_tokenizer(tok: Tokenizer, path: str | os.PathLike) -> Path:
    """Write ``tok`` as JSON to ``path`` atomically (a temporary file, then a rename); return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(tok.to_str(), encoding="utf-8")
    os.replace(tmp, path)
    return path


def cache_name(docs: list[str], vocab_size: int) -> str:
    """File name of the cached tokenizer for (documents, vocabulary size, tokenizers version)."""
    digest = hashlib.sha256(f"wordpiece-v1|{tokenizers.__version__}|{vocab_size}".encode())
    for doc in docs:
        digest.update(b"\0" + doc.encode("utf-8", errors="replace"))
    return f"tokenizer-v{vocab_size}-{digest.hexdigest()[:16]}.json"


def obtain_tokenizer(docs: list[str], vocab_size: int, *, path: str | os.PathLike | None = None,
                     cache_dir: str | os.PathLike | None = None, write_cache: bool = True) -> Tokenizer:
    """``load_tokenizer(path)`` if ``path``; else the cached one in ``cache_dir``, or train (and cache) it."""
    if path:
        return load_tokenizer(path)
    cached = Path(cache_dir) / cache_name(docs, vocab_size) if cache_dir else None
    if cached is not None and cached.is_file():
        return load_tokenizer(cached)
    tok = train_tokenizer(docs, vocab_size)
    if cached is not None and write_cache:
        save_tokenizer(tok, cached)
    return tok
