"""Codec throughput: encode and decode time of every codec against ``x.clone()`` of the same tensor.

    python bench/codecs.py [--sizes 1M,16M,64M] [--repeat 5] [--json bench/results/codecs.json]

For each size the baseline ``x.clone()`` and each codec's ``encode`` / ``decode`` (fresh output, as
``clone`` allocates one) are timed in the same run, interleaved round by round; the median of
``--repeat`` rounds is reported. ratio = (encode + decode) / clone. Targets (at 16M elements, 2-core
CPU): 1-bit sign and nearest uniform <= 3x clone; stochastic uniform, QSGD and TernGrad <= 6x.
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mpicomm.codecs import (  # noqa: E402
    IdentityCodec,
    ModuloCodec,
    QSGDCodec,
    RandomKCodec,
    SignCodec,
    TernGradCodec,
    TopKCodec,
    UniformCodec,
)

NEAREST, STOCHASTIC = 3.0, 6.0
TARGET_SIZE = 16 * 2**20


class _Moniqua:
    """Adapter giving ModuloCodec the encode(x)/decode(payload, n) shape (reference = the input)."""

    def __init__(self, codec: ModuloCodec, x_ref: dict):
        self.codec, self.ref = codec, x_ref
        self.B = codec.b_theta(0.01)

    def encode(self, x):
        return self.codec.encode(x, self.B)

    def decode(self, payload, n):
        return self.codec.decode(payload, self.ref["x"], self.B)

    def bits_per_element(self, n):
        return self.codec.bits_per_element(n)


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
        ("topk 1%", TopKCodec(0.01), None),
        ("randomk 1%", RandomKCodec(0.01), None),
    ]
    # Moniqua has no target: its decode also reads the receiver's model (one more model-sized stream)
    out += [(f"moniqua {b}-bit nearest", _Moniqua(ModuloCodec(b), x_ref), None) for b in (1, 2, 4, 8)]
    out += [(f"moniqua {b}-bit stochastic", _Moniqua(ModuloCodec(b, "stochastic"), x_ref), None) for b in (2, 8)]
    return out


def parse_sizes(text: str) -> list[int]:
    """``"1M,16M,64M"`` -> element counts (K = 2**10, M = 2**20)."""
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}
    sizes = []
    for item in text.split(","):
        item = item.strip().upper()
        sizes.append(int(float(item[:-1]) * mult[item[-1]]) if item[-1] in mult else int(item))
    return sizes


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def bench_size(n: int, repeat: int, only: str | None) -> list[dict]:
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    ref = {"x": x}
    entries = [(label, c, t) for label, c, t in codecs(ref) if only is None or only in label]
    clone_times: list[float] = []
    enc: dict[str, list[float]] = {label: [] for label, _, _ in entries}
    dec: dict[str, list[float]] = {label: [] for label, _, _ in entries}
    for _label, codec, _ in entries:  # warm-up (lazy generators, allocator)
        codec.decode(codec.encode(x), n)
    for _ in range(repeat):
        dt, y = timed(x.clone)
        clone_times.append(dt)
        del y
        for label, codec, _ in entries:
            dt, payload = timed(lambda c=codec: c.encode(x))
            enc[label].append(dt)
            dt, y = timed(lambda c=codec, p=payload: c.decode(p, n))
            dec[label].append(dt)
            del y, payload
    clone = statistics.median(clone_times)
    rows = []
    for label, codec, target in entries:
        e, d = statistics.median(enc[label]), statistics.median(dec[label])
        rows.append(
            {
                "codec": label,
                "n": n,
                "bits_per_element": codec.bits_per_element(n),
                "clone_ms": clone * 1e3,
                "encode_ms": e * 1e3,
                "decode_ms": d * 1e3,
                "ratio": (e + d) / clone,
                "target": target if n == TARGET_SIZE else None,
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    head = f"{'codec':<26} {'n':>9} {'bits/el':>7} {'clone ms':>9} {'enc ms':>8} {'dec ms':>8} {'ratio':>6}  target"
    print(head)
    print("-" * len(head))
    for r in rows:
        target = ""
        if r["target"] is not None:
            target = f"<= {r['target']:.0f}x {'ok' if r['ratio'] <= r['target'] else 'MISSED'}"
        print(
            f"{r['codec']:<26} {r['n']:>9} {r['bits_per_element']:>7.3f} {r['clone_ms']:>9.2f} "
            f"{r['encode_ms']:>8.2f} {r['decode_ms']:>8.2f} {r['ratio']:>6.2f}  {target}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,16M,64M", help="comma separated element counts, K/M suffixes")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds per size (median reported)")
    parser.add_argument("--json", default=os.path.join("bench", "results", "codecs.json"), help="output JSON path")
    parser.add_argument("--only", default=None, help="run only codecs whose label contains this text")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
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
        "loadavg_at_end": os.getloadavg(),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"meta": meta, "results": rows}, fh, indent=2)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
