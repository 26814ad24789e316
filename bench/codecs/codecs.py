"""Codec throughput: encode + decode of every codec against one copy of the same tensor.

    python bench/codecs/codecs.py [--sizes 1M,16M,64M] [--repeat 5] [--clock cpu] [--json bench/results/codecs.json]

For each size the baselines ``dst.copy_(x)`` (into a preallocated buffer: one read + one write pass, the
memory-bandwidth limit) and ``x.clone()`` (a fresh tensor: also pays the page faults of new memory), and
each codec's ``encode`` and ``decode(payload, n, out=buf)`` into a preallocated float32 buffer, are timed in
the same run, interleaved round by round, on one thread (what one MPI rank per core gets); the median of
``--repeat`` rounds is reported. ratio = (encode + decode) / copy; the clone ratio is kept for comparison
with earlier runs. A third baseline, one elementwise op (``mul_``) over the tensor in cache-sized chunks,
is what each pass of a codec's op-at-a-time maths costs.

Times are the thread's CPU time by default (``--clock cpu``: user + system, so page faults count, while
time spent descheduled by other processes does not, which keeps the ratios stable on a shared machine);
``--clock wall`` times elapsed time and allows ``--threads`` > 1.

Targets at 16M elements: sign and nearest uniform <= 3x copy, Moniqua <= 3.5x, stochastic
uniform and QSGD <= 6x, top-k <= 8x, HSQ d=16 <= 12x. Moniqua's codec (``MoniquaCodec``, one tensor, theta
0.01) is the algorithm's: encode = the step's dither + the packed codes + fingerprints + x_hat for the
mixing; decode = recovery against the receiver's model (the input itself) + fingerprints + x_hat into ``out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from mpicomm.codecs import (  # noqa: E402
    HSQCodec,
    IdentityCodec,
    MoniquaCodec,
    QSGDCodec,
    RandomKCodec,
    SignCodec,
    TernGradCodec,
    TopKCodec,
    UniformCodec,
    chunk_elems,
)
from mpicomm.flat import Layer  # noqa: E402

NEAREST, MONIQUA, STOCHASTIC, TOPK, HSQ = 3.0, 3.5, 6.0, 8.0, 12.0
TARGET_SIZE = 16 * 2**20


def codecs(x_ref: dict) -> list[tuple[str, object, float | None]]:
    """(label, codec, target ratio at 16M or None)."""
    out = [
        ("identity fp32", IdentityCodec(), None),
        ("identity fp16", IdentityCodec(torch.float16), None),
        ("identity bf16", IdentityCodec(torch.bfloat16), None),
        ("sign l2 (1-bit)", SignCodec("l2"), NEAREST),
        ("sign none (1-bit)", SignCodec("none"), NEAREST),
    ]
    out += [(f"uniform {b}-bit nearest", UniformCodec(b), NEAREST) for b in (1, 2, 4, 8)]
    out += [(f"uniform {b}-bit stochastic", UniformCodec(b, rounding="stochastic"), STOCHASTIC) for b in (2, 4, 8)]
    out += [
        ("qsgd 4-bit b512", QSGDCodec(4), STOCHASTIC),
        ("qsgd 8-bit b512", QSGDCodec(8), STOCHASTIC),
        ("terngrad", TernGradCodec(), STOCHASTIC),
        ("topk 1%", TopKCodec(0.01), TOPK),
        ("randomk 1%", RandomKCodec(0.01), None),
    ]
    one = [Layer("x", 0, (x_ref["x"].numel(),))]
    out += [(f"moniqua lattice {b}-bit nearest", MoniquaCodec(one, b, rounding="nearest", theta=0.01), None)
            for b in (1, 2, 4, 8)]
    out += [(f"moniqua lattice {b}-bit stochastic", MoniquaCodec(one, b, rounding="stochastic", theta=0.01), None)
            for b in (2, 8)]
    out += [(f"moniqua lattice {b}-bit dither", MoniquaCodec(one, b, theta=0.01), MONIQUA) for b in (1, 4)]
    out.append(("hsq d=16 K=256", HSQCodec([x_ref["x"].numel()], d=16), HSQ))
    return out


def parse_sizes(text: str) -> list[int]:
    """``"1M,16M,64M"`` -> element counts (K = 2**10, M = 2**20)."""
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}
    sizes = []
    for item in text.split(","):
        item = item.strip().upper()
        sizes.append(int(float(item[:-1]) * mult[item[-1]]) if item[-1] in mult else int(item))
    return sizes


CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
_clock = CLOCKS["cpu"]


def timed(fn) -> tuple[float, object]:
    """(seconds on the chosen clock, result) of ``fn()``."""
    t0 = _clock()
    result = fn()
    return _clock() - t0, result


def bench_size(n: int, repeat: int, only: str | None) -> list[dict]:
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    dst = torch.empty_like(x)
    out = torch.empty_like(x)
    ref = {"x": x}
    entries = [(label, c, t) for label, c, t in codecs(ref) if only is None or only in label]
    copy_times: list[float] = []
    clone_times: list[float] = []
    pass_times: list[float] = []
    chunk = torch.empty(min(n, chunk_elems(x.device)))

    def in_cache_pass():  # one elementwise op over n elements held in an L2-sized chunk (what codecs stream)
        for _ in range(-(-n // chunk.numel())):
            chunk.mul_(1.0)
    enc: dict[str, list[float]] = {label: [] for label, _, _ in entries}
    dec: dict[str, list[float]] = {label: [] for label, _, _ in entries}
    dst.copy_(x)
    out.zero_()  # touch both buffers once: their page faults are not part of any timing
    for _label, codec, _ in entries:  # warm-up (lazy generators, allocator, caches)
        codec.decode(codec.encode(x), n, out=out)
    for _ in range(repeat):
        copy_times.append(timed(lambda: dst.copy_(x))[0])
        pass_times.append(timed(in_cache_pass)[0])
        dt, y = timed(x.clone)
        clone_times.append(dt)
        del y
        for label, codec, _ in entries:
            dt, payload = timed(lambda c=codec: c.encode(x))
            enc[label].append(dt)
            dt, _ = timed(lambda c=codec, p=payload: c.decode(p, n, out=out))
            dec[label].append(dt)
            del payload
    copy, clone = statistics.median(copy_times), statistics.median(clone_times)
    one_pass = statistics.median(pass_times)
    rows = []
    for label, codec, target in entries:
        e, d = statistics.median(enc[label]), statistics.median(dec[label])
        rows.append(
            {
                "codec": label,
                "n": n,
                "bits_per_element": codec.bits_per_element(n),
                "copy_ms": copy * 1e3,
                "clone_ms": clone * 1e3,
                "in_cache_pass_ms": one_pass * 1e3,
                "encode_ms": e * 1e3,
                "decode_ms": d * 1e3,
                "ratio": (e + d) / copy,
                "ratio_clone": (e + d) / clone,
                "target": target if n == TARGET_SIZE else None,
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    for n in sorted({r["n"] for r in rows}):
        r = next(r for r in rows if r["n"] == n)
        print(f"n = {n}: copy_ {r['copy_ms']:.2f} ms, clone {r['clone_ms']:.2f} ms, one elementwise pass over "
              f"cache-sized chunks {r['in_cache_pass_ms']:.2f} ms = {r['in_cache_pass_ms'] / r['copy_ms']:.2f}x copy")
    head = (f"{'codec':<28} {'n':>9} {'bits/el':>7} {'copy ms':>8} {'clone ms':>9} {'enc ms':>8} {'dec ms':>8} "
            f"{'/copy':>6} {'/clone':>6}  target")
    print(head)
    print("-" * len(head))
    for r in rows:
        target = ""
        if r["target"] is not None:
            target = f"<= {r['target']:g}x {'ok' if r['ratio'] <= r['target'] else 'MISSED'}"
        print(
            f"{r['codec']:<28} {r['n']:>9} {r['bits_per_element']:>7.3f} {r['copy_ms']:>8.2f} {r['clone_ms']:>9.2f} "
            f"{r['encode_ms']:>8.2f} {r['decode_ms']:>8.2f} {r['ratio']:>6.2f} {r['ratio_clone']:>6.2f}  {target}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,16M,64M", help="comma separated element counts, K/M suffixes")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds per size (median reported)")
    parser.add_argument("--json", default=os.path.join("bench", "results", "codecs.json"), help="output JSON path")
    parser.add_argument("--only", default=None, help="run only codecs whose label contains this text")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: one MPI rank per core)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                        help="cpu: this thread's CPU time (user + system, page faults included; default, robust on "
                        "a shared machine), wall: elapsed time")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    if args.threads < 1 or (args.threads > 1 and args.clock == "cpu"):
        parser.error("--threads must be >= 1, and 1 with --clock cpu (it times this thread only)")
    torch.set_num_threads(args.threads)
    global _clock
    _clock = CLOCKS[args.clock]
    loadavg_start = os.getloadavg()
    rows = []
    for n in parse_sizes(args.sizes):
        rows += bench_size(n, args.repeat, args.only)
    print_table(rows)
    meta = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "repeat": args.repeat,
        "clock": args.clock,
        "loadavg_at_start": loadavg_start,
        "loadavg_at_end": os.getloadavg(),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"meta": meta, "results": rows}, fh, indent=2)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
