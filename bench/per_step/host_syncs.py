"""Count the host reads each algorithm step and each codec call makes (what becomes a GPU host sync).

    mpiexec -n 4 python bench/per_step/host_syncs.py                    # CPU: reads of tensor values by Python
    mpiexec -n 4 python bench/per_step/host_syncs.py --device cuda      # GPU: also torch's own sync detector

On any device the script counts the calls that pull a tensor's value into Python — ``.item()``,
``float()``, ``int()``, ``bool()``, ``.tolist()``, ``.numpy()``, ``.cpu()`` — during steady-state
steps (after ``--warmup`` steps), per step. On a GPU each such read of a device tensor waits for the
device: an upper bound on the host synchronisations a step makes (reads of host tensors, e.g. the
step counters torch.optim keeps on the host, are counted too). With ``--device cuda`` the script also
counts the synchronising operations torch itself reports (``torch.cuda.set_sync_debug_mode("warn")``),
which include the hidden ones (boolean-mask indexing, ``nonzero``) and not host tensors. Staging
copies through the Communicator when MPI is not CUDA-aware are synchronisations by design and are
counted separately (``staged``: transfers through host buffers per step). Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
import warnings

import torch

READERS = ("item", "tolist", "cpu", "__float__", "__int__", "__bool__", "__index__")
SITES: dict[str, int] = {}  # call site -> reads, with --sites
TRACE = [False]

ALGORITHMS = {
    "dpsgd": {"momentum": 0.9},
    "moniqua": {"bits": 1},
    "moniqua_d2": {"bits": 8},
    "moniqua_adpsgd": {"bits": 4},
    "d2": {},
    "choco": {"codec": "qsgd", "codec_options": {"bits": 4}},
    "dcd": {"codec": "sign"},
    "pdsgdm": {"period": 2},
    "cpdsgdm": {"period": 2, "codec": "sign"},
    "allreduce_sgd": {"momentum": 0.9},
    "qsgd": {"bits": 4},
    "terngrad": {},
    "signsgd": {},
    "ef_signsgd": {},
    "compressed_sgd": {"codec": "topk", "codec_options": {"ratio": 0.01}, "error_feedback": True},
    "hsq": {"d": 8},
    "allreduce_adam": {"lr": 1e-3},
    "apmsqueeze": {"lr": 1e-3, "warmup_steps": 2},
}
CODECS = {
    "identity": {}, "fp16": {}, "uniform-1": {"bits": 1}, "uniform-4-stochastic": {"bits": 4, "rounding": "stochastic"},
    "sign": {}, "qsgd": {"bits": 4}, "terngrad": {}, "topk": {"ratio": 0.01}, "randomk": {"ratio": 0.01},
    "hsq": {"layout": [65536], "d": 8},
}


class Counter:
    """Counts calls of the tensor readers while active (patched onto ``torch.Tensor``)."""

    def __init__(self, sites: bool = False):
        self.count, self.active, self._saved, self.sites = 0, False, {}, sites

    def __enter__(self):
        for name in READERS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def wrapper(t, *a, _original=original, _name=name, **k):
                if self.active and not (_name == "cpu" and t.device.type == "cpu"):
                    self.count += 1
                    if self.sites:
                        frame = next(f for f in traceback.extract_stack()[-2::-1] if "mpicomm/" in f.filename)
                        site = f"{frame.filename.split('mpicomm/')[-1]}:{frame.lineno} {_name}"
                        SITES[site] = SITES.get(site, 0) + 1
                return _original(t, *a, **k)

            setattr(torch.Tensor, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)

    @contextlib.contextmanager
    def measuring(self):
        """Count only inside this block (nested reads inside a counted reader count once each)."""
        self.active = True
        try:
            yield
        finally:
            self.active = False


@contextlib.contextmanager
def cuda_syncs(device: torch.device):
    """Yield a list that collects torch's synchronisation warnings on CUDA (empty elsewhere)."""
    caught: list = []
    if device.type != "cuda":
        yield caught
        return
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")
            caught.extend(r for r in records if "synchroniz" in str(r.message))


def model(device: torch.device) -> torch.nn.Module:
    """A 64-256-256-10 MLP (85 k parameters), seeded."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10)).to(device)


def algorithm_reads(comm, device: torch.device, warmup: int, steps: int) -> dict:
    """Per algorithm: reads and (CUDA) torch-reported syncs per steady-state step, on rank 0."""
    from mpicomm import topology
    from mpicomm.algorithms import make_algorithm
    from mpicomm.comm import Communicator

    out = {}
    x = torch.randn(32, 64, device=device)
    y = torch.randint(0, 10, (32,), device=device)
    for name, options in ALGORITHMS.items():
        c = Communicator(comm, topology.ring(comm.Get_size()))
        algo = make_algorithm(name, model(device), c, **{"lr": 0.05, **options})
        with Counter(sites=TRACE[0]) as counter:
            for i in range(warmup + steps):
                algo.zero_grad()
                torch.nn.functional.cross_entropy(algo.model(x), y).backward()
                if i < warmup:
                    algo.step()
                    continue
                with counter.measuring(), cuda_syncs(device) as syncs:
                    algo.step()
                out.setdefault(name, {"reads": 0, "cuda_syncs": 0})
                out[name]["reads"] += counter.count
                out[name]["cuda_syncs"] += len(syncs)
                counter.count = 0
        out[name] = {k: v / steps for k, v in out[name].items()}
        algo.close()
    return out


def codec_reads(device: torch.device, numel: int = 65536) -> dict:
    """Per codec: reads in one encode and one decode of ``numel`` elements."""
    from mpicomm.codecs import make_codec

    out = {}
    x = torch.randn(numel, device=device)
    for key, options in CODECS.items():
        name = key.split("-")[0]
        codec = make_codec(name, **options)
        codec.decode(codec.encode(x), numel)  # first use builds tables and generators
        with Counter(sites=TRACE[0]) as counter:
            with counter.measuring(), cuda_syncs(device) as enc_syncs:
                payload = codec.encode(x)
            encode = counter.count
            counter.count = 0
            with counter.measuring(), cuda_syncs(device) as dec_syncs:
                codec.decode(payload, numel)
            out[key] = {"encode_reads": encode, "decode_reads": counter.count,
                        "encode_cuda_syncs": len(enc_syncs), "decode_cuda_syncs": len(dec_syncs)}
    return out


def table(result: dict) -> str:
    """Markdown tables of the counts."""
    lines = ["| algorithm | host reads / step | CUDA syncs / step |", "|---|---|---|"]
    for name, r in result["algorithms"].items():
        lines.append(f"| {name} | {r['reads']:g} | {r['cuda_syncs']:g} |" if result["device"] != "cpu"
                     else f"| {name} | {r['reads']:g} | – |")
    lines += ["", "| codec | reads encode / decode | CUDA syncs encode / decode |", "|---|---|---|"]
    for name, r in result["codecs"].items():
        syncs = f"{r['encode_cuda_syncs']} / {r['decode_cuda_syncs']}" if result["device"] != "cpu" else "–"
        lines.append(f"| {name} | {r['encode_reads']} / {r['decode_reads']} | {syncs} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Count on every rank, report rank 0's counts."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default="")
    p.add_argument("--backend", default="torch", choices=["torch", "auto"],
                   help="codec backend: torch (the code path CUDA tensors take; default) or auto (numpy on a CPU)")
    p.add_argument("--sites", action="store_true", help="also print where the reads happen (rank 0)")
    args = p.parse_args(argv)
    TRACE[0] = args.sites
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", comm.Get_rank() % torch.cuda.device_count())
    from mpicomm.codecs import bitpack

    with bitpack.use_backend(args.backend):
        result = {"device": device.type, "ranks": comm.Get_size(), "backend": args.backend,
                  "algorithms": algorithm_reads(comm, device, args.warmup, args.steps), "codecs": codec_reads(device)}
    if comm.Get_rank() == 0:
        print(table(result))
        for site, n in sorted(SITES.items(), key=lambda kv: -kv[1]):
            print(f"{n:6d}  {site}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
