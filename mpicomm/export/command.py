"""``mpicomm export``: a run's model as a torch ``state_dict`` file or a Hugging Face folder, without MPI.

Its arguments are parsed in :mod:`mpicomm.cli`. Bad input (no checkpoint there, ``--rank`` out of
range, ``--format hf`` for a model transformers cannot rebuild, an ``-o`` that cannot be written) is
one line on stderr and exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from ..checkpoint.tree import CheckpointError
from .weights import ExportError, read_weights

__all__ = ["EXIT_REFUSED", "export", "main"]

EXIT_REFUSED = 2


def _check_output(out: Path, fmt: str) -> None:
    """Refuse an ``-o`` that cannot be written, before anything is read (nothing is created here)."""
    if fmt == "torch" and out.is_dir():
        raise ExportError(f"-o {out} is a folder; --format torch writes one file (e.g. {out / 'model.pt'})")
    if fmt == "hf" and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"-o {out} exists and is not an empty folder; --format hf writes a new folder")
    ancestor = out.parent if fmt == "torch" else out
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ExportError(f"-o {out}: {ancestor} is not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ExportError(f"-o {out}: {ancestor} is not writable")


def _save_torch(state: dict, out: Path) -> None:
    """``torch.save`` to a temporary file beside ``out``, then rename it (a failed write leaves no partial file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        torch.save(state, tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def export(args: argparse.Namespace) -> list[str]:
    """Do what the parsed ``args`` ask; return the lines to print (raises ExportError/CheckpointError/OSError)."""
    out = Path(args.output)
    _check_output(out, args.format)
    if args.format == "hf":
        try:
            import transformers  # noqa: F401
        except ImportError as exc:
            raise ExportError("--format hf needs transformers: pip install 'mpicomm[apps]'") from exc
    weights = read_weights(args.checkpoint, rank=args.rank, buffers=args.buffers)
    notes = list(weights.notes)
    if args.format == "torch":
        _save_torch(weights.state_dict, out)
        kind = f"torch state_dict, {len(weights.state_dict)} entries"
    else:
        from .huggingface import save_pretrained

        notes += save_pretrained(weights, out)
        kind = "Hugging Face save_pretrained folder"
    lines = [f"wrote {weights.what} of step {weights.step} ({weights.directory}) to {out} ({kind})"]
    return lines + [f"  {note}" for note in notes]


def main(args: argparse.Namespace) -> int:
    """Run ``mpicomm export``: print what was written, or one error line and return 2."""
    try:
        lines = export(args)
    except (ExportError, CheckpointError) as exc:
        print(f"mpicomm export: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except OSError as exc:
        print(f"mpicomm export: error: cannot write -o {args.output}: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    print("\n".join(lines))
    return 0
