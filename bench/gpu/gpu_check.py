"""The GPU check, part by part (``scripts/gpu_check.sh`` runs every part and the report).

    python bench/gpu/gpu_check.py codecs --out DIR [--cpu-only]          # one process
    mpiexec -n 2 python bench/gpu/gpu_check.py comm --out DIR            # and -n 4
    mpiexec -n 2 python bench/gpu/gpu_check.py train --out DIR
    python bench/gpu/gpu_check.py throughput --out DIR                    # GPU only
    mpiexec -n 2 python bench/gpu/gpu_check.py steptime --out DIR         # GPU only
    mpiexec -n 2 python bench/gpu/gpu_check.py precision --out DIR
    python bench/gpu/gpu_check.py report --out DIR                        # DIR/gpu_check.json + a table

The "device" side is ``cuda:{local rank % GPUs}`` (ranks share the GPU). With ``--cpu-only`` it is
the CPU driven through the code paths CUDA tensors take — the codecs' torch path and staging through
host buffers (``stage="always"``) — so CI exercises everything but the device itself.

Tolerances (stated here, reported with the measured values): deterministic codecs give equal bytes
(sign's scale, a sum taken per chunk, within 1e-6 relative) and decode to within 1e-6 of the CPU;
stochastic codecs (HSQ included: its norms are rounded stochastically) have mean squared errors within
5 % of each other and mean errors within 4 standard errors of each other on the two devices.
Training: the mean of the last 5 of 20 losses on the device within 2 % of the CPU run for
deterministic algorithms and 10 % for those drawing random numbers (their streams differ between
devices); precision runs must stay finite (and, on a GPU, lower the loss over 60 steps).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_harness import ALGORITHMS, bench_codecs, median_ms, torch_path, train  # noqa: E402

from mpicomm.codecs import make_codec  # noqa: E402
from mpicomm.comm import Communicator, node_layout  # noqa: E402
from mpicomm.topology import ring  # noqa: E402

STOCHASTIC = ("stochastic", "qsgd", "terngrad", "randomk", "hsq")  # HSQ rounds its norms stochastically


def device_for(comm, cpu_only: bool) -> torch.device:
    """The device side of the comparison."""
    if cpu_only:
        return torch.device("cpu")
    local = node_layout(comm)[0] if comm is not None else 0
    return torch.device("cuda", local % torch.cuda.device_count())


def check(name: str, ok: bool, **detail) -> dict:
    """One line of the report."""
    return {"name": name, "ok": bool(ok), **detail}


def part_codecs(args) -> dict:
    """Every codec on the device vs the CPU (numpy path) for the same input."""
    n, checks = 65_539, []
    x_cpu = torch.randn(n, generator=torch.Generator().manual_seed(0))
    dev = device_for(None, args.cpu_only)
    x_dev = x_cpu.to(dev)
    hsq = ("hsq greedy d=8", make_codec("hsq", layout=[n], d=8), None)
    cpu_list = [*bench_codecs({"x": x_cpu}), hsq]
    dev_list = [*bench_codecs({"x": x_dev}), (*hsq[:1], make_codec("hsq", layout=[n], d=8), None)]
    for (label, c_cpu, _), (_, c_dev, _) in zip(cpu_list, dev_list):
        p_cpu = c_cpu.encode(x_cpu)
        with torch_path(args.cpu_only):
            p_dev = c_dev.encode(x_dev)
            back = c_dev.decode(p_cpu.to(dev), n).cpu()
        ref = c_cpu.decode(p_cpu, n)
        if any(s in label for s in STOCHASTIC):
            err_c, err_d = ref - x_cpu, c_cpu.decode(p_dev.cpu(), n) - x_cpu
            mse_c, mse_d = float(err_c.pow(2).mean()), float(err_d.pow(2).mean())
            bound = 4 * math.sqrt(2 * mse_c / n)  # 4 standard errors of the difference of two mean errors
            ok = abs(mse_d - mse_c) <= 0.05 * mse_c and abs(float(err_d.mean() - err_c.mean())) <= bound
            checks.append(check(f"codec {label}", ok, kind="distribution", mse_cpu=mse_c, mse_device=mse_d))
            continue
        body = 4 if label.startswith("sign l") else 0
        same = torch.equal(p_dev[body:].cpu(), p_cpu[body:])
        if body:
            s = torch.cat([p_dev[:4].cpu(), p_cpu[:4]]).view(torch.float32)
            same = same and abs(float(s[0] - s[1])) <= 1e-6 * abs(float(s[1]))
        close = torch.allclose(back, ref, rtol=1e-6, atol=1e-6)
        checks.append(check(f"codec {label}", same and close, kind="bytes", bytes_equal=same, decode_close=close))
    return {"checks": checks}


def part_comm(args) -> dict:
    """Neighbour allgather, allreduce and all-to-all of device tensors, staged and (if CUDA-aware) direct."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    dev, rank, size = device_for(world, args.cpu_only), world.Get_rank(), world.Get_size()
    checks = []
    probe = Communicator(world, ring(size))
    stages = ["always"] + (["never"] if probe.router.cuda_aware and not args.cpu_only else [])
    for stage in stages:
        c = Communicator(world, ring(size), stage=stage)
        x = torch.arange(1000, dtype=torch.float32, device=dev) + 1000 * rank
        rows = c.neighbor_allgather(x)
        want = torch.stack([torch.arange(1000.0) + 1000 * j for j in c.in_neighbors(0)])
        ok_ag = torch.equal(rows.cpu(), want)
        s = c.allreduce(torch.full((4096,), float(rank + 1), device=dev))
        ok_ar = bool((s.cpu() == size * (size + 1) / 2).all())
        send = torch.tensor([[100.0 * rank + k] * 8 for k in range(size)], device=dev)
        got = c.alltoall(send)
        ok_a2a = torch.equal(got.cpu(), torch.tensor([[100.0 * j + rank] * 8 for j in range(size)]))
        ok = world.allreduce(int(ok_ag and ok_ar and ok_a2a), op=MPI.MIN) == 1
        checks.append(check(f"comm {size} ranks stage={stage}", ok, allgather=ok_ag, allreduce=ok_ar, alltoall=ok_a2a,
                            cuda_aware=probe.router.cuda_aware))
    return {"checks": checks}


def part_train(args) -> dict:
    """ResNet-20, 20 steps, every algorithm: device (or CPU through the device code paths) vs CPU."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    dev, checks = device_for(world, args.cpu_only), []
    torch.backends.cudnn.allow_tf32 = False  # TF32 convolutions (10-bit mantissa) would dominate the difference
    for key, (_, stochastic) in ALGORITHMS.items():
        tol = 0.10 if stochastic else 0.02
        cpu = train(world, key, torch.device("cpu"), args.steps, batch=args.batch)
        with torch_path(args.cpu_only):
            on_dev = train(world, key, dev, args.steps, batch=args.batch, stage="always" if args.cpu_only else "auto")
        last = min(5, args.steps)
        a, b = (sum(r["losses"][-last:]) / last for r in (on_dev, cpu))
        rel = abs(a - b) / abs(b)
        ok = world.allreduce(int(rel <= tol and on_dev["finite"]), op=MPI.MIN) == 1
        checks.append(check(f"train {key}", ok, last5_device=a, last5_cpu=b, rel_diff=rel, tolerance=tol))
    return {"checks": checks}


def part_throughput(args) -> dict:
    """Codec encode+decode time against a device-to-device copy of the same tensor (the HBM limit)."""
    dev, rows = device_for(None, False), []
    for n in args.sizes:
        x = torch.randn(n, device=dev)
        copy_ms = median_ms(x.clone, dev, 10)
        for label, codec, _ in bench_codecs({"x": x}):
            payload = codec.encode(x)
            enc = median_ms(lambda c=codec, x=x: c.encode(x), dev, 5)
            dec = median_ms(lambda c=codec, p=payload, n=n: c.decode(p, n), dev, 5)
            rows.append({"codec": label, "n": n, "copy_ms": copy_ms, "encode_ms": enc, "decode_ms": dec,
                         "ratio": (enc + dec) / copy_ms, "copy_GBps": 2 * 4 * n / copy_ms / 1e6})
    return {"checks": [], "figures": {"throughput": rows}}


def part_steptime(args) -> dict:
    """ResNet-20 step time on the GPU (batch 128 per rank): D-PSGD vs 1-bit Moniqua vs APMSqueeze."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    dev, rows = device_for(world, False), []
    for key in ("dpsgd", "moniqua_1bit", "apmsqueeze"):
        r = train(world, key, dev, 25, batch=128, timed=True)
        rows.append({"algorithm": key, "ranks": world.Get_size(), "step_ms": max(world.allgather(r["step_ms"]))})
    return {"checks": [], "figures": {"steptime": rows}}


def part_precision(args) -> dict:
    """bf16 and fp16 ResNet-20 runs that train (finite; on a GPU the loss falls over the run)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    dev, checks = device_for(world, args.cpu_only), []
    steps = 2 if args.cpu_only else 60
    for mode in ("bf16", "fp16"):
        r = train(world, "dpsgd", dev, steps, batch=args.batch, precision=mode)
        first, last = sum(r["losses"][:3]) / 3, sum(r["losses"][-3:]) / 3
        ok = r["finite"] and (args.cpu_only or last < first)
        ok = world.allreduce(int(ok), op=MPI.MIN) == 1
        extra = {k: r[k] for k in ("loss_scale", "skipped") if k in r}
        checks.append(check(f"precision {mode}", ok, first_loss=first, last_loss=last, steps=steps, **extra))
    return {"checks": checks}


def report(args) -> int:
    """Merge the parts into gpu_check.json and print a short table; exit 1 if any check failed."""
    merged = {"device": "cpu-only" if args.cpu_only else torch.cuda.get_device_name(0), "checks": [], "figures": {}}
    for path in sorted(glob.glob(os.path.join(args.out, "part-*.json"))):
        part = json.load(open(path))
        merged["checks"] += part.get("checks", [])
        merged["figures"].update(part.get("figures", {}))
    syncs = os.path.join(args.out, "host_syncs.json")  # bench/per_step/host_syncs.py --device cuda
    if os.path.exists(syncs):
        merged["figures"]["host_syncs"] = json.load(open(syncs))
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(merged, f, indent=1)
    print(f"GPU check on {merged['device']}: {sum(c['ok'] for c in merged['checks'])}/{len(merged['checks'])} passed")
    for c in merged["checks"]:
        keys = [k for k in ("rel_diff", "mse_device", "loss_scale", "last_loss") if k in c]
        print(f"  {'ok  ' if c['ok'] else 'FAIL'} {c['name']:<40} " + " ".join(f"{k}={c[k]:.4g}" for k in keys))
    for row in merged["figures"].get("throughput", []):
        print(f"  {row['codec']:<28} {row['n'] >> 20:>3}M  enc+dec / copy = {row['ratio']:.2f}  "
              f"(copy {row['copy_ms']:.3f} ms, {row['copy_GBps']:.0f} GB/s)")
    for row in merged["figures"].get("steptime", []):
        print(f"  ResNet-20 step {row['algorithm']:<14} {row['step_ms']:.1f} ms ({row['ranks']} ranks on one GPU)")
    return 0 if all(c["ok"] for c in merged["checks"]) and merged["checks"] else 1


PARTS = {"codecs": part_codecs, "comm": part_comm, "train": part_train, "throughput": part_throughput,
         "steptime": part_steptime, "precision": part_precision}


def main(argv=None) -> int:
    """Run one part (writing DIR/part-NAME-RANKS.json from rank 0), or the report."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=[*PARTS, "report"])
    p.add_argument("--out", default="gpu_check")
    p.add_argument("--cpu-only", action="store_true")
    p.add_argument("--steps", type=int, default=20, help="training steps per run (train part)")
    p.add_argument("--batch", type=int, default=32, help="images per rank per step (train and precision parts)")
    p.add_argument("--sizes", type=lambda t: [int(v) << 20 for v in t.split(",")], default=[16 << 20, 64 << 20],
                   help="throughput part: tensor sizes in Mi elements, e.g. 16,64")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.part == "report":
        return report(args)
    result = PARTS[args.part](args)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.Get_rank() == 0:
        name = f"part-{args.part}-{world.Get_size()}.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
