"""A Hugging Face model under mpicomm: a small BERT classifier, your AdamW, gradients averaged at 4 bits.

    mpiexec -n 2 python examples/huggingface.py                             # QSGD, 4-bit gradients
    mpiexec -n 2 python examples/huggingface.py --algorithm allreduce_sgd   # exact averages, as DDP

The model is built from a config (no weights are downloaded) and learns a toy task offline: does the
sequence contain token 7? ``qsgd`` sends 4-bit gradients (with their scales) and then steps your AdamW
on the decoded average, as DDP would step it on the exact one. Prints the accuracy on held-out sequences.
"""

from __future__ import annotations

import argparse

import torch
from transformers import BertConfig, BertForSequenceClassification

import mpicomm

VOCAB, LENGTH = 32, 12


def batch(generator: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token sequences; the label says whether token 7 occurs."""
    ids = torch.randint(1, VOCAB, (size, LENGTH), generator=generator)
    return ids, (ids == 7).any(dim=1).long()


def main(argv=None) -> float:
    """Train, evaluate the averaged model, return its held-out accuracy (the same on every rank)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="qsgd")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)

    job = mpicomm.init()
    torch.manual_seed(0)  # the same initial model on every rank
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=LENGTH, num_labels=2)
    model = BertForSequenceClassification(config).to(job.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    algo = mpicomm.wrap(model, optimizer, args.algorithm)

    data = torch.Generator().manual_seed(1 + job.rank)  # each rank its own batches
    for _ in range(args.steps):
        ids, labels = batch(data, 32)
        algo.zero_grad()
        model(input_ids=ids.to(job.device), labels=labels.to(job.device)).loss.backward()
        algo.step()

    ids, labels = batch(torch.Generator().manual_seed(0), 256)
    with algo.averaged_model() as averaged, torch.no_grad():
        predicted = averaged(input_ids=ids.to(job.device)).logits.argmax(-1).cpu()
    accuracy = float((predicted == labels).float().mean())
    if job.rank == 0:
        print(f"{args.algorithm}: held-out accuracy {100 * accuracy:.1f} % (always 'no' would score "
              f"{100 * float((labels == 0).float().mean()):.1f} %)")
    return accuracy


if __name__ == "__main__":
    main()
