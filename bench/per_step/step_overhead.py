"""Per-step overhead of each algorithm on ResNet-20: its own CPU work in ``algo.step`` apart from the MPI calls.

    mpiexec -n 4 python bench/per_step/step_overhead.py [--steps 10] [--rounds 3] [--warmup 3] [--cases dpsgd,hsq]

4 ranks on a ring, one torch thread per rank, ResNet-20 (apps/models, 272 k parameters), a real
forward/backward on a fixed random batch before every step (not timed). Per timed step and rank:

* ``own``: the thread CPU time of ``algo.step()`` minus the thread CPU time spent inside the
  Communicator's MPI calls (every blocking call and every ``wait()`` goes through its
  :class:`~mpicomm.net.NetClock`, which the script wraps). This is the algorithm's own work: codec,
  bookkeeping, the optimizer step. Thread CPU time does not count time the rank is descheduled, so it
  holds up on a machine shared by more ranks than cores (MPICH's busy polling is inside the MPI calls);
* ``mpi wall``: wall-clock time blocked inside those calls (waiting for neighbours included);
* ``calls``: MPI calls per step.

Cases run interleaved round by round (``--rounds`` x ``--steps`` timed steps each, after ``--warmup``);
each case's figure is the median over its steps of the mean over ranks. Ratios are against D-PSGD's own
work in the same run. The codec rows time one encode + one decode (into a preallocated ``out`` where the
codec takes one) of the codec an algorithm uses, on the whole model (272 k elements), one thread:
the reference for the targets (own work of Moniqua 1-bit <= 3x D-PSGD's + its codec;
HSQ d=16 <= 8 ms; CHOCO/APMSqueeze within 1.5x their codec). CHOCO and APMSqueeze make more codec calls
per step than one encode + decode, by their maths, so they get a second reference, the same codec calls
their step makes, timed alone: CHOCO one encode and 1 + degree decodes (its own payload and each
neighbour's); APMSqueeze's 1-bit average on n chunks (worker encode + decode per chunk, n server decodes,
one server encode, n decodes of the gathered chunks: :class:`~mpicomm.algorithms.onebit.OneBitAverage`).

Writes docs/results/step_overhead.{md,json} (rank 0).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "apps"))

from bench.common import RESULTS, machine, markdown_table, write_json  # noqa: E402

CHOCO_CALLS = "qsgd 4-bit: 1 encode + (1 + degree) decodes"
ONEBIT_CALLS = "sign l2: the 1-bit average's calls on n chunks"
CASES = {  # label: (algorithm, options, codec row it is compared with or None, row of the codec calls its step makes)
    "dpsgd": ("dpsgd", {"momentum": 0.9}, None, None),
    "moniqua (default: 4 bits, 1/4 parts)": ("moniqua", {"momentum": 0.9}, "lattice 4-bit dither, 1/4 of the model",
                                             None),
    "moniqua 1-bit (1/4 parts)": ("moniqua", {"momentum": 0.9, "bits": 1}, "lattice 1-bit dither, 1/4 of the model",
                                  None),
    "moniqua 1-bit paper form (all parts)": ("moniqua", {"momentum": 0.9, "bits": 1, "parts": 1, "gamma": 0.5,
                                                          "theta_per": "model", "rounding": "nearest"},
                                             "lattice 1-bit nearest", None),
    "hsq d=16": ("hsq", {"momentum": 0.9, "d": 16}, "hsq d=16", None),
    "choco (qsgd 4-bit)": ("choco", {"momentum": 0.9, "codec": "qsgd", "codec_options": {"bits": 4}}, "qsgd 4-bit",
                           CHOCO_CALLS),
    "apmsqueeze (compression phase)": ("apmsqueeze", {"lr": 1e-3, "warmup_steps": 2}, "sign l2 (1-bit)",
                                       ONEBIT_CALLS),
    "allreduce_sgd": ("allreduce_sgd", {"momentum": 0.9}, None, None),
}
MONIQUA_1BIT = "moniqua 1-bit (1/4 parts)"


class MPITimer:
    """Wraps a Communicator's clock: thread CPU and wall seconds spent inside its MPI calls, and their count."""

    def __init__(self, clock):
        self.cpu = self.wall = 0.0
        self.calls = 0
        for name in ("run", "complete"):
            setattr(clock, name, self._timed(getattr(clock, name)))

    def _timed(self, method):
        def timed(*args):
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                return method(*args)
            finally:
                self.cpu += time.thread_time() - c0
                self.wall += time.perf_counter() - w0
                self.calls += 1
        return timed


class Case:
    """One algorithm on its own Communicator and model, with per-step samples."""

    def __init__(self, comm, label: str, name: str, options: dict, batch: int):
        from models.resnet import build_model

        from mpicomm import topology
        from mpicomm.algorithms import make_algorithm
        from mpicomm.comm import Communicator

        self.label = label
        c = Communicator(comm, topology.ring(comm.Get_size()))
        self.algo = make_algorithm(name, build_model("resnet20"), c, **{"lr": 0.05, **options})
        self.timer = MPITimer(c.clock)
        g = torch.Generator().manual_seed(comm.Get_rank())
        self.x = torch.randn(batch, 3, 32, 32, generator=g)
        self.y = torch.randint(0, 10, (batch,), generator=g)
        self.samples: list[tuple[float, float, int]] = []  # (own s, mpi wall s, calls) per timed step

    def step(self, timed: bool) -> None:
        """One forward/backward (untimed) and one ``algo.step()`` (timed if ``timed``)."""
        self.algo.zero_grad()
        torch.nn.functional.cross_entropy(self.algo.model(self.x), self.y).backward()
        t = self.timer
        cpu0, mpi_cpu0, mpi_wall0, calls0 = time.thread_time(), t.cpu, t.wall, t.calls
        self.algo.step()
        if timed:
            own = time.thread_time() - cpu0 - (t.cpu - mpi_cpu0)
            self.samples.append((own, t.wall - mpi_wall0, t.calls - calls0))


def _lattice(bits: int, rounding: str, fraction: int, numel: int):
    """Moniqua's codec (``MoniquaCodec``, one tensor, theta 0.01): encode + decode of 1/``fraction`` of the model."""
    from mpicomm.codecs import MoniquaCodec
    from mpicomm.flat import Layer

    n = numel // fraction
    codec = MoniquaCodec([Layer("x", 0, (n,))], bits, rounding=rounding, theta=0.01)

    def run(x: torch.Tensor, ref: torch.Tensor, payload: torch.Tensor) -> None:
        codec.decode(codec.encode(x[:n]), n, out=ref[:n].clone())
    return run


def _choco_calls(codec, degree: int, out: torch.Tensor):
    """CHOCO's codec calls in one step: encode its own difference, decode it and each neighbour's payload."""
    def run(x: torch.Tensor, ref: torch.Tensor, payload: torch.Tensor) -> None:
        sent = codec.encode(x)
        for _ in range(1 + degree):
            codec.decode(sent, x.numel(), out=out)
    return run


def _onebit_calls(codec, ranks: int, padded: torch.Tensor, out: torch.Tensor):
    """The codec calls of :meth:`OneBitAverage.average` on ``ranks`` chunks of the zero-padded vector ``padded``."""
    L = padded.numel() // ranks
    chunks = [padded[k * L:(k + 1) * L] for k in range(ranks)]

    def run(x: torch.Tensor, ref: torch.Tensor, payload: torch.Tensor) -> None:
        sent = [codec.encode(c) for c in chunks]        # worker, chunk by chunk
        for k in range(ranks):
            codec.decode(sent[k], L, out=out[:L])       # the worker's error feedback
        for k in range(ranks):
            codec.decode(sent[k], L, out=out[:L])       # the server's n decodes (one chunk from every rank)
        server = codec.encode(chunks[0])
        for _ in range(ranks):
            codec.decode(server, L, out=out[:L])        # the gathered server chunks
    return run


def _padded(x: torch.Tensor, ranks: int) -> torch.Tensor:
    """``x`` zero-padded to n L elements, L = 8 ceil(d / (8 n)) (:class:`OneBitAverage`'s layout)."""
    L = 8 * -(-x.numel() // (8 * ranks))
    return torch.cat([x, x.new_zeros(ranks * L - x.numel())])


def codec_rows(layers, numel: int, repeat: int, ranks: int) -> dict[str, float]:
    """Median thread-CPU seconds per codec row (one encode + decode, or an algorithm's calls) on ``numel`` elements."""
    from mpicomm.codecs import HSQCodec, QSGDCodec, SignCodec

    g = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=g) * 0.01
    ref = x + torch.randn(numel, generator=g) * 1e-4
    payload = torch.empty(numel, dtype=torch.uint8)
    out = torch.empty_like(x)
    hsq, qsgd, sign = HSQCodec(layers, d=16), QSGDCodec(bits=4), SignCodec(scale="l2")
    rows = {
        "lattice 1-bit nearest": _lattice(1, "nearest", 1, numel),
        "lattice 1-bit dither, 1/4 of the model": _lattice(1, "dither", 4, numel),
        "lattice 4-bit dither, 1/4 of the model": _lattice(4, "dither", 4, numel),
        "hsq d=16": lambda x, r, p: hsq.decode(hsq.encode(x), numel, out=out),
        "qsgd 4-bit": lambda x, r, p: qsgd.decode(qsgd.encode(x), numel, out=out),
        "sign l2 (1-bit)": lambda x, r, p: sign.decode(sign.encode(x), numel, out=out),
        CHOCO_CALLS: _choco_calls(qsgd, min(2, ranks - 1), out),
        ONEBIT_CALLS: _onebit_calls(sign, ranks, _padded(x, ranks), out),
    }
    times: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(repeat + 1):  # the first round warms up
        for key, run in rows.items():
            t0 = time.thread_time()
            run(x, ref, payload)
            times[key].append(time.thread_time() - t0)
    return {k: statistics.median(v[1:]) for k, v in times.items()}


def main(argv=None) -> int:
    """Time every case, then the codecs; rank 0 writes the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps per case and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--cases", default="", help="comma list of algorithm names (default: all; dpsgd always runs)")
    p.add_argument("--out", default=os.path.join(RESULTS, "step_overhead"), help="path prefix of the .md/.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    wanted = set(args.cases.split(",")) | {"dpsgd"} if args.cases else None
    cases = [Case(comm, label, name, options, args.batch) for label, (name, options, *_) in CASES.items()
             if wanted is None or name in wanted]
    for case in cases:
        for _ in range(args.warmup):
            case.step(timed=False)
    for _ in range(args.rounds):
        for case in cases:
            for _ in range(args.steps):
                case.step(timed=True)
    per_step = {c.label: [[float(v) for v in s] for s in c.samples] for c in cases}
    gathered = comm.gather(per_step, root=0)
    flat = cases[0].algo.flat
    codecs = codec_rows(flat.layers, flat.numel, 2 * args.rounds + 1, comm.Get_size()) if comm.Get_rank() == 0 else {}
    for case in cases:
        case.algo.close()
    if comm.Get_rank() != 0:
        return 0
    result = summarise(gathered, codecs, args, flat.numel, comm.Get_size())
    print(result["markdown"])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(result["markdown"] + "\n")
    write_json(args.out + ".json", result)
    return 0


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def _ratio(own_s: float, ms: float | None) -> str:
    return "–" if ms is None else f"{1e3 * own_s / ms:.2f}x"


def _median_over_steps(ranks: list[list[list[float]]], field: int) -> float:
    """Median over steps of the mean over ranks of ``field``."""
    return statistics.median(statistics.fmean(r[k][field] for r in ranks) for k in range(len(ranks[0])))


def summarise(gathered, codecs: dict[str, float], args, numel: int, ranks: int) -> dict:
    """The table (ms, ratios to D-PSGD's own work) and the targets, as markdown and JSON."""
    labels = list(gathered[0])
    own = {k: _median_over_steps([g[k] for g in gathered], 0) for k in labels}
    wall = {k: _median_over_steps([g[k] for g in gathered], 1) for k in labels}
    calls = {k: _median_over_steps([g[k] for g in gathered], 2) for k in labels}
    base = own["dpsgd"]
    rows, cases = [], {}
    for k in labels:
        ref, work = CASES[k][2], CASES[k][3]
        codec_ms = 1e3 * codecs[ref] if ref else None
        work_ms = 1e3 * codecs[work] if work else None
        rows.append([k, f"{1e3 * own[k]:.2f}", f"{own[k] / base:.1f}x", f"{1e3 * wall[k]:.2f}", f"{calls[k]:g}",
                     ref or "–", _ms(codec_ms), _ratio(own[k], codec_ms), work or "–", _ms(work_ms),
                     _ratio(own[k], work_ms)])
        cases[k] = {"own_ms": 1e3 * own[k], "own_vs_dpsgd": own[k] / base, "mpi_wall_ms": 1e3 * wall[k],
                    "mpi_calls": calls[k], "codec": ref, "codec_ms": codec_ms, "codec_calls": work,
                    "codec_calls_ms": work_ms}
    targets = {}
    if MONIQUA_1BIT in own:
        bound = 3 * own["dpsgd"] + codecs[CASES[MONIQUA_1BIT][2]]
        targets["moniqua 1-bit own <= 3x dpsgd own + codec"] = {"ms": 1e3 * own[MONIQUA_1BIT], "bound_ms": 1e3 * bound,
                                                               "met": own[MONIQUA_1BIT] <= bound}
    if "hsq d=16" in own:
        targets["hsq d=16 own <= 8 ms"] = {"ms": 1e3 * own["hsq d=16"], "bound_ms": 8.0, "met": own["hsq d=16"] <= 8e-3}
    for k in ("choco (qsgd 4-bit)", "apmsqueeze (compression phase)"):
        if k in own:
            for what, row in (("one encode + decode", CASES[k][2]), ("the codec calls its step makes", CASES[k][3])):
                bound = 1.5 * codecs[row]
                targets[f"{k} own <= 1.5x codec ({what})"] = {"ms": 1e3 * own[k], "bound_ms": 1e3 * bound,
                                                              "met": own[k] <= bound}
    header = ["case", "own work ms/step", "vs D-PSGD", "blocked in MPI ms/step", "MPI calls/step", "codec",
              "codec enc+dec ms", "own / codec", "codec calls of its step", "their ms", "own / their ms"]
    title = (f"Per-step overhead on ResNet-20 ({numel} parameters), {ranks} ranks on a ring, one thread per rank, "
             f"median of {args.rounds} x {args.steps} steps")
    lines = [title, "", markdown_table(header, rows), "", "| target | measured ms | bound ms | met |",
             "|---|---|---|---|"]
    lines += [f"| {k} | {t['ms']:.2f} | {t['bound_ms']:.2f} | {'yes' if t['met'] else 'no'} |"
              for k, t in targets.items()]
    return {"title": title, "machine": machine(), "cases": cases, "codecs_ms": {k: 1e3 * v for k, v in codecs.items()},
            "targets": targets, "markdown": "\n".join(lines),
            "command": f"mpiexec -n {ranks} python bench/per_step/step_overhead.py --steps {args.steps} "
                       f"--rounds {args.rounds}"}


if __name__ == "__main__":
    sys.exit(main())
