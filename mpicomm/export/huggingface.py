"""A Hugging Face ``save_pretrained`` folder from exported weights: model, config and, when found, the tokenizer.

The model is rebuilt from the class name and config JSON the checkpoint's meta records for a
transformers model (``meta["model"]["transformers"]``, see :mod:`mpicomm.checkpoint.model_record`),
loaded strictly with the exported ``state_dict`` and saved with ``save_pretrained``: the folder loads
with ``transformers.BertForMaskedLM.from_pretrained(folder)`` (or ``AutoModelForMaskedLM``), no mpicomm.

The tokenizer is not part of a checkpoint. ``apps/train_bert.py`` either loads ``--tokenizer PATH``
or trains one and caches it in its ``--out-dir`` as ``tokenizer-v<V>-<hash>.json``, which is the run
directory holding the checkpoints. So the tokenizer is looked for, in order: the ``--tokenizer`` of
the run's last ``start`` record in ``metrics.jsonl`` (when that path still exists), then the cached
``tokenizer-v*.json`` files of the run directory whose vocabulary has the model's size (used when they
all agree). Found, it is saved beside the model as a ``tokenizers``-backed fast tokenizer (``[PAD]``,
``[UNK]``, ``[CLS]``, ``[SEP]``, ``[MASK]`` as its special tokens), so ``AutoTokenizer.from_pretrained``
loads it; not found, the folder holds the model alone and the returned note says so.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..training.metrics import read_metrics
from .weights import ExportError, Weights

__all__ = ["find_tokenizer", "save_pretrained"]

_SPECIAL = {"unk_token": "[UNK]", "pad_token": "[PAD]", "cls_token": "[CLS]", "sep_token": "[SEP]",
            "mask_token": "[MASK]"}


def _transformers_record(weights: Weights) -> dict:
    """The meta's record of the transformers class and config, or a clear refusal naming what the run trained."""
    record = weights.meta.get("model") or {}
    if "transformers" not in record:
        what = record.get("class") or "a model without a transformers record"
        raise ExportError(f"--format hf needs a run of a transformers model (apps/train_bert.py); "
                          f"{weights.directory} holds {what}: use --format torch")
    return record["transformers"]


def _tokenizer_candidates(run_dir: Path) -> list[Path]:
    """The ``--tokenizer`` path of the run's last start record (if it exists), else its cached tokenizers."""
    metrics = run_dir / "metrics.jsonl"
    argv: list[str] = []
    if metrics.is_file():
        starts = [r for r in read_metrics(str(metrics)) if r.get("event") == "start" and "argv" in r]
        argv = list(starts[-1]["argv"]) if starts else []
    given = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--tokenizer"]
    given += [arg.split("=", 1)[1] for arg in argv if arg.startswith("--tokenizer=")]
    if given and given[-1] and Path(given[-1]).is_file():
        return [Path(given[-1])]
    return sorted(run_dir.glob("tokenizer-v*.json"))


def find_tokenizer(run_dir: Path, vocab_size: int):
    """(the run's ``tokenizers.Tokenizer`` or None, a note on where it came from or why there is none)."""
    from tokenizers import Tokenizer

    found = {}
    for path in _tokenizer_candidates(run_dir):
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception on a malformed file
            continue
        if tok.get_vocab_size() == vocab_size:
            found.setdefault(tok.to_str(), (tok, path))
    if len(found) == 1:
        tok, path = next(iter(found.values()))
        return tok, f"tokenizer from {path}"
    why = (f"{len(found)} different tokenizers with its {vocab_size} tokens" if found
           else f"no tokenizer with its {vocab_size} tokens (no --tokenizer file, no tokenizer-v*.json)")
    return None, f"no tokenizer saved: {run_dir} holds {why}; save the run's tokenizer into the folder yourself"


def _fast_tokenizer(tok, model_type: str):
    """``tok`` wrapped as a transformers fast tokenizer (BERT's class for a BERT model)."""
    import transformers

    cls = transformers.BertTokenizerFast if model_type == "bert" else transformers.PreTrainedTokenizerFast
    special = {name: token for name, token in _SPECIAL.items() if tok.token_to_id(token) is not None}
    return cls(tokenizer_object=tok, **special)


def save_pretrained(weights: Weights, out: Path) -> list[str]:
    """Write ``weights`` as a ``save_pretrained`` folder at ``out`` (created); return notes for the user."""
    record = _transformers_record(weights)
    import transformers

    cls = getattr(transformers, record["class"], None)
    if cls is None:
        raise ExportError(f"this transformers ({transformers.__version__}) has no class {record['class']!r}, "
                          "which the run trained")
    config = cls.config_class.from_dict(json.loads(record["config"]))
    with torch.random.fork_rng(devices=[]):  # the random initialisation is overwritten: leave the caller's RNG be
        model = cls(config)
    model.load_state_dict(weights.state_dict, strict=True)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # one file of a few tensors: no bar on stderr
    try:
        model.save_pretrained(out)
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    tok, note = find_tokenizer(weights.directory.parent, config.vocab_size)
    if tok is not None:
        _fast_tokenizer(tok, config.model_type).save_pretrained(out)
    return [note]
