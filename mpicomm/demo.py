"""``mpicomm demo``: one neighbour exchange per codec on a ring, with what each rank received and the bytes.

Every rank holds a model-like vector x_r = base + 0.01 * noise_r (neighbours are close, as in
decentralized training). For each codec the rank encodes x_r, exchanges payloads with its ring
neighbours, decodes what arrived and compares it with the neighbour's true vector (which it can
regenerate from the neighbour's seed). Rank 0 prints one table; every rank prints what it received.
"""

from __future__ import annotations

import torch

from . import topology
from .codecs import MoniquaCodec, make_codec
from .comm import Communicator
from .flat import Layer

__all__ = ["run_demo"]

DEMO_CODECS = [
    ("identity", {}),
    ("fp16", {}),
    ("uniform", {"bits": 8}),
    ("qsgd", {"bits": 4}),
    ("terngrad", {}),
    ("sign", {}),
    ("topk", {"ratio": 0.01}),
]


def _vector(rank: int, numel: int) -> torch.Tensor:
    base = torch.randn(numel, generator=torch.Generator().manual_seed(1234))
    noise = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    return base + 0.01 * noise


def run_demo(world, numel: int = 100_000, theta: float = 0.1) -> list[dict]:
    """Exchange ``numel``-element vectors on a ring of ``world``'s ranks (:func:`mpicomm.comm.world`) once per
    codec; return (and on rank 0 print) the rows."""
    comm = Communicator(world, topology.ring(world.size))
    x = _vector(comm.rank, numel)
    sources = comm.in_neighbors()
    truths = {s: _vector(s, numel) for s in sources}
    rows = []
    cases = [(name, kwargs, make_codec(name, **kwargs)) for name, kwargs in DEMO_CODECS]
    moniqua = MoniquaCodec([Layer("x", 0, (numel,))], bits=1, rounding="nearest", theta=theta)
    cases.append(("moniqua", {"bits": 1, "theta": theta}, moniqua))  # decoded against this rank's own x
    for name, kwargs, codec in cases:
        before = comm.ledger.bytes_sent()
        got = comm.neighbor_allgather(codec.encode(x))
        decoded = [codec.decode(p, numel) for p in got]
        errors = [float((d - truths[s]).norm() / truths[s].norm()) for d, s in zip(decoded, sources)]
        sent = comm.ledger.bytes_sent() - before
        rows.append({
            "codec": name + "".join(f" {k}={v}" for k, v in kwargs.items()),
            "bytes_per_neighbour": sent // max(len(comm.out_neighbors()), 1),
            "bits_per_element": 8 * sent / max(len(comm.out_neighbors()), 1) / numel,
            "bytes_sent": sent,
            "received_from": list(sources),
            "first_values": [round(float(d[0]), 4) for d in decoded],
            "max_relative_error": max(errors, default=0.0),
        })
    _print(comm, numel, rows)
    return rows


def _print(comm: Communicator, numel: int, rows: list[dict]) -> None:
    everyone = comm.allgather_object(rows, "the demo's table")
    if comm.rank != 0:
        return
    n = len(everyone)
    print(f"ring of {n} ranks, {numel} float32 elements per rank ({4 * numel} bytes uncompressed)\n")
    print(f"{'codec':<26}{'bytes/neighbour':>16}{'bits/elem':>11}{'worst rel. error':>18}")
    for i, row in enumerate(rows):
        worst = max(r[i]["max_relative_error"] for r in everyone)
        print(f"{row['codec']:<26}{row['bytes_per_neighbour']:>16}{row['bits_per_element']:>11.3f}{worst:>18.2e}")
    print("\nwhat each rank received (first decoded value from each in-neighbour, identity codec):")
    for r, rank_rows in enumerate(everyone):
        got = ", ".join(f"rank {s}: {v}" for s, v in zip(rank_rows[0]["received_from"], rank_rows[0]["first_values"]))
        print(f"  rank {r} <- {got or 'nobody (single rank)'}; sent {sum(x['bytes_sent'] for x in rank_rows)} bytes")
