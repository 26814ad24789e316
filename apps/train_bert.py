"""BERT masked-language-model pre-training with any mpicomm algorithm.

    mpiexec -n 4 python apps/train_bert.py --preset tiny --algorithm apmsqueeze --lr 1e-3 --epochs 2
    mpiexec -n 4 python apps/train_bert.py --preset tiny --algorithm allreduce_adam --lr 1e-3 --epochs 2

The model is a ``transformers`` BertForMaskedLM built from a config (presets tiny / base / large; no
weights are downloaded); the tokenizer is a WordPiece vocabulary trained on the corpus (or ``--tokenizer``);
masking follows BERT's 15 % with 80/10/10. Without ``--data`` the corpus is the English documentation
topics that ship with Python itself (``pydoc_data``), so it runs offline. APMSqueeze and AllReduce-Adam
are the natural pair here.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mpicomm.training.console import announce_start  # noqa: E402  (light: before the slow imports)

announce_start("train_bert", "importing torch and transformers")

from bert.task import build_task as build_bert_task  # noqa: E402
from bert.task import check_options  # noqa: E402

from mpicomm.training.apprun import run_app  # noqa: E402
from mpicomm.training.arguments import app_parser  # noqa: E402


def build_parser():
    """The app's parser: shared training options plus model, corpus and tokenizer options."""
    p = app_parser(__doc__.splitlines()[0], default_algorithm="apmsqueeze", epochs=2)
    p.add_argument("--preset", default="tiny", choices=["tiny", "base", "large"],
                   help="BERT's size: tiny (2 layers, hidden 64), base (12, 768) or large (24, 1024)")
    p.add_argument("--dataset", default="pydoc", choices=["pydoc", "python-docs"],
                   help="without --data: pydoc (Python's 79 documentation topics, embedded, 0.5 MB) or python-docs "
                        "(the standard library's docstrings and comments, 6 MB; built once by the set-up: "
                        "python apps/fetch_data.py python-docs)")
    p.add_argument("--data", default="", help="a .txt file or folder of .txt files (instead of --dataset)")
    p.add_argument("--tokenizer", default="", help="a saved tokenizer JSON (default: train one on the corpus)")
    p.add_argument("--vocab-size", type=int, default=0, help="WordPiece vocabulary (0: the preset's default)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per training sequence")
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--dropout", type=float, default=0.1, help="BERT's dropout probability")
    p.add_argument("--eval-sequences", type=int, default=256, help="validation sequences per evaluation")
    return p


def run_settings(args) -> dict:
    """This app's options a run's trajectory depends on, by flag: a resume compares them with the checkpoint's.

    ``--data`` and ``--tokenizer`` are paths and not compared (the files may move); ``--dataset`` counts
    without ``--data``, ``--vocab-size`` without ``--tokenizer``; ``--eval-sequences`` only evaluates.
    """
    out = {"--preset": args.preset, "--seq-len": args.seq_len, "--batch-size": args.batch_size,
           "--dropout": args.dropout}
    if not args.data:
        out["--dataset"] = args.dataset
    if not args.tokenizer:
        out["--vocab-size"] = args.vocab_size
    return out


def check_args(args) -> None:
    """This app's option values that need no data, refused (``ValueError``) before anything is built: by the
    launch and by ``mpicomm slurm check`` (the rules are the task's own)."""
    check_options(args.preset, args.seq_len, args.batch_size, args.seed, args.eval_sequences)


def build_task(args, rank: int, size: int):
    """Corpus, tokenizer, model and batches for this rank."""
    return build_bert_task(args.preset, args.data or None, args.tokenizer or None, args.seq_len, args.batch_size,
                           rank, size, args.seed, args.vocab_size or None, args.out_dir or None,
                           dropout=args.dropout, eval_sequences=args.eval_sequences, dataset=args.dataset)


def main(argv=None) -> int:
    """Parse, set up on every rank, train, and print the final summary on rank 0."""
    return run_app("train_bert", build_parser(), build_task, argv, settings=run_settings, check=check_args,
                   preparing="reading the corpus, training the tokenizer and building BERT",
                   headline=("val_mlm_accuracy", "final masked-token accuracy of the averaged model"))


if __name__ == "__main__":
    sys.exit(main())
