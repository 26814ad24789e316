"""Cost of one Moniqua-AD-PSGD pull on ResNet-20's layout: thread CPU time and host reads per operation.

    python bench/codecs/moniqua_pull.py [--device cpu] [--repeats 40] [--out FILE.json]

One process, one torch thread, two :class:`~mpicomm.codecs.moniqua.MoniquaPullCodec` (a publisher
and a reader) on the 59 tensors (272 k parameters) of ResNet-20 (apps/models), the reader's model
within theta/2 of the publisher's. Per configuration, the median over ``--repeats`` rounds of the
thread CPU time (``time.thread_time``; on CUDA the wall time after a synchronize as well) of the
publisher's ``encode``, the reader's ``pull`` and its ``mix``, and the number of reads of tensor values
by Python in each (``.item()``, ``float()``, ``int()``, ``.tolist()``, ``.cpu()`` of a device tensor:
the counter of ``bench/per_step/host_syncs.py``; ``--sites`` lists where). On a GPU each read of a device tensor
is a host synchronisation; on a CPU every read is counted, of host tensors too (``--sites``: reads per
round by call site).

The script imports ``mpicomm`` from ``PYTHONPATH`` first, so the same script times another checkout:
``PYTHONPATH=/path/to/other/checkout python bench/codecs/moniqua_pull.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.append(ROOT)  # after PYTHONPATH: a checkout given there is the one timed
sys.path.append(os.path.join(ROOT, "apps"))

from bench.per_step.host_syncs import SITES, TRACE, Counter  # noqa: E402

CONFIGS = {  # label: (bits, parts, rounding)
    "4 bits, 1/4 parts, nearest (default)": (4, 4, "nearest"),
    "4 bits, 1/4 parts, dither": (4, 4, "dither"),
    "4 bits, 1/4 parts, stochastic": (4, 4, "stochastic"),
    "1 bit, all parts, nearest (paper form)": (1, 1, "nearest"),
}


def resnet20_layers(device):
    """ResNet-20's flat layers and its flat model on ``device``."""
    from models.resnet import build_model

    from mpicomm.flat import FlatParameters

    flat = FlatParameters(build_model("resnet20").to(device))
    return flat.layers, flat.data.detach().clone()


def run(label, bits, parts, rounding, layers, x, repeats, device) -> dict:
    """Median thread CPU time (and wall time) and host reads of encode, pull and mix."""
    from mpicomm.codecs import MoniquaPullCodec

    publisher = MoniquaPullCodec(layers, bits, parts, rounding, seed=0, rank_seed=0, device=device)
    reader = MoniquaPullCodec(layers, bits, parts, rounding, seed=0, rank_seed=1, device=device)
    sizes = [layer.numel for layer in layers]
    theta = torch.stack([t.abs().max() * 0.05 + 1e-3 for t in x.split(sizes)]).double().cpu()
    g = torch.Generator(device=device).manual_seed(1)
    bound = (theta / 2).float().to(device).repeat_interleave(torch.tensor(sizes, device=device))
    y = x + (torch.rand(x.numel(), generator=g, device=device) * 2 - 1) * bound
    message = torch.zeros(publisher.nbytes, dtype=torch.uint8, device=device)
    times = {"encode": [], "pull": [], "mix": []}
    walls = {"encode": [], "pull": [], "mix": []}
    reads = {}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rounds = repeats + 2  # the first two build the plans and generators, untimed
    with Counter(sites=TRACE[0]) as counter:
        for i in range(rounds):
            version, z, out = i + 1, y.clone(), {}
            for name in ("encode", "pull", "mix"):
                sync()
                counter.count = 0
                w0, t0 = time.perf_counter(), time.thread_time()
                with counter.measuring():
                    if name == "encode":
                        publisher.encode(x, version, theta, message)
                    elif name == "pull":
                        out = reader.pull(message, z)
                    else:
                        reader.mix(z, version, *out, 0.5)
                sync()
                t1, w1 = time.thread_time(), time.perf_counter()
                if i >= 2:
                    times[name].append(t1 - t0)
                    walls[name].append(w1 - w0)
                    reads[name] = counter.count
            assert not bool(out[1].any()), "the bench's models should not wrap"
    sites = {site: n / rounds for site, n in SITES.items()}
    SITES.clear()
    return {"label": label, "bits": bits, "parts": parts, "rounding": rounding,
            **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()},
            **{f"{k}_wall_ms": 1e3 * statistics.median(v) for k, v in walls.items()},
            **{f"{k}_reads": v for k, v in reads.items()}, "sites": sites}


def main(argv=None) -> int:
    """Time every configuration; print a table (and the read sites with ``--sites``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sites", action="store_true", help="also print where the reads happen")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    TRACE[0] = args.sites
    device = torch.device(args.device)
    layers, x = resnet20_layers(device)
    import mpicomm

    print(f"mpicomm from {os.path.dirname(mpicomm.__file__)}; {len(layers)} tensors, {x.numel()} parameters, "
          f"{device}, {args.threads} thread(s), median of {args.repeats}")
    rows = [run(label, *config, layers, x, args.repeats, device) for label, config in CONFIGS.items()]
    print("| configuration | encode ms | pull ms | mix ms | host reads encode / pull / mix |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {r['encode_ms']:.2f} | {r['pull_ms']:.2f} | {r['mix_ms']:.2f} | "
              f"{r['encode_reads']} / {r['pull_reads']} / {r['mix_reads']} |")
    for r in rows if args.sites else []:
        print(f"reads per round, {r['label']}:")
        for site, n in r["sites"].items():
            print(f"{n:8g}  {site}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device.type, "threads": args.threads, "repeats": args.repeats, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
