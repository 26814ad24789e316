"""Weights no gradient reached stay where they are under every built-in optimizer, as under torch's own.

The model: an embedding of 16 rows, a Linear that is used and one that never is. Rows 0-7 are in every batch
from the start, rows 8-11 only from step LATE on (after the 1-bit family's warm-up), rows 12-15 never. torch's
Adam, on the same model and the same batches in one process, leaves exactly the never-used Linear and rows
12-15 bit-equal to their initial values and moves everything else; each built-in optimizer, at the ranks of the
tier and with weight decay on (which alone would move every weight), must leave exactly the same entries
bit-equal after 50 steps past its warm-up. A reached-flag reset by a checkpoint would show too: the second half
of the run resumes from a state_dict.
"""

import pytest
import torch

from mpicomm import topology as topo
from mpicomm.algorithms import make_algorithm
from mpicomm.comm import Communicator

from .conftest import run_all

pytestmark = pytest.mark.mpi

ROWS, WIDTH, CLASSES, BATCH = 16, 6, 4, 8
LATE, STEPS = 8, 58   # 50 steps after the warm-ups below, which end by step 8


class Branchy(torch.nn.Module):
    """An embedding, a used head and a head the forward never takes."""

    def __init__(self):
        super().__init__()
        torch.random.default_generator.manual_seed(3)
        self.emb = torch.nn.Embedding(ROWS, WIDTH)
        self.used = torch.nn.Linear(WIDTH, CLASSES)
        self.unused = torch.nn.Linear(WIDTH, CLASSES)

    def forward(self, tokens):
        return self.used(self.emb(tokens).mean(1))


def batch(rank: int, step: int):
    """Rank ``rank``'s batch at ``step``: 3 tokens a sample from rows 0-7, or 0-11 from step LATE on."""
    g = torch.Generator().manual_seed(100 * rank + step)
    tokens = torch.randint(0, 12 if step >= LATE else 8, (BATCH, 3), generator=g)
    return tokens, torch.randint(0, CLASSES, (BATCH,), generator=g)


def entries(model) -> dict:
    """Each entry whose movement is checked: the Linears' tensors and the embedding's rows, by name."""
    out = {f"emb row {r}": model.emb.weight[r] for r in range(ROWS)}
    out.update({n: p for n, p in model.named_parameters() if not n.startswith("emb")})
    return {k: v.detach().clone() for k, v in out.items()}


def unmoved(before: dict, after: dict) -> set:
    return {k for k in before if torch.equal(before[k], after[k])}


def torch_reference(ranks: int) -> set:
    """What torch.optim.Adam leaves bit-equal, on the mean loss over every rank's batches (one process)."""
    model = Branchy()
    start = entries(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = sum(torch.nn.functional.cross_entropy(model(x), y) for x, y in (batch(r, step) for r in range(ranks)))
        (loss / ranks).backward()
        optimizer.step()
    return unmoved(start, entries(model))


EXPECTED = {"unused.weight", "unused.bias", *(f"emb row {r}" for r in range(12, 16))}

METHODS = {
    "allreduce_adam": dict(lr=1e-2),
    "allreduce_adam, sharded, 4-bit reduce-scatter": dict(lr=1e-2, shard=True, shard_bits=4),
    "lamb": dict(lr=1e-2),
    "apmsqueeze": dict(lr=1e-2, warmup_steps=4),
    "apmsqueeze, no floor": dict(lr=1e-2, warmup_steps=4, denominator_floor=0.0),
    "apmsqueeze, sharded": dict(lr=1e-2, warmup_steps=4, shard=True),
    "apmsqueeze, overlapped": dict(lr=1e-2, warmup_steps=4, overlap=True),
    "zeroone_adam": dict(lr=1e-2, var_freeze_step=6),
    "onebit_lamb": dict(lr=1e-2, freeze_step=4),
    "diloco": dict(lr=0.1, momentum=0.9, period=3),
    "diloco, inner AdamW": dict(lr=1e-2, inner_optimizer="adamw", period=3),
    "diloco, 1-bit pseudo-gradients": dict(lr=0.1, period=3, codec="sign"),
    "streaming_diloco": dict(lr=0.1, period=4, fragments=2),
    "sparseloco": dict(lr=0.1, period=3),
    "decentralized_diloco": dict(lr=0.1, period=3),
}


@pytest.mark.parametrize("label", list(METHODS))
def test_unreached_weights_stay_bit_equal(comm, label):
    def body():
        assert torch_reference(comm.Get_size()) == EXPECTED  # what torch does is what is expected here
        model = Branchy()
        start = entries(model)
        algo = make_algorithm(label.split(",")[0], model, Communicator(comm, topo.ring(comm.Get_size())),
                              weight_decay=0.01, **METHODS[label])
        initial = algo.flat.data.clone()
        half = STEPS // 2
        for step in range(STEPS):
            if step == half:  # resume from a state_dict: the reached-flags must come back with it
                state = algo.state_dict()
                model = Branchy()
                algo = make_algorithm(label.split(",")[0], model, Communicator(comm, topo.ring(comm.Get_size())),
                                      weight_decay=0.01, **METHODS[label])
                algo.load_state_dict(state)
            tokens, labels = batch(comm.Get_rank(), step)
            algo.zero_grad()
            torch.nn.functional.cross_entropy(model(tokens), labels).backward()
            algo.step()
        after = entries(model)
        assert all(torch.isfinite(v).all() for v in after.values()), f"{label}: non-finite weights"
        left = unmoved(start, after)
        assert left == EXPECTED, f"{label}: moved {sorted(EXPECTED - left)}, left {sorted(left - EXPECTED)}"
        flags = algo.state_dict()["reached"]["agreed"]
        assert flags.tolist() == [1] * 12 + [0] * 4 + [1, 1, 0, 0]  # rows, then used/unused weight and bias
        never = algo.reached.unreached_index()
        for name in ("synced", "global_params"):  # a shared copy of the model: 0/1 Adam's x_s, DiLoCo's x_g
            if hasattr(algo, name):
                assert torch.equal(getattr(algo, name)[never], initial[never]), f"{label}: {name} moved"

    run_all(comm, body)
