"""The fused CPU kernels (``mpicomm.codecs.kernels``) against the op-at-a-time paths they replace, bit for bit.

Every codec with a kernel encodes twice (so the generator's advance is compared too) and decodes with the
``kernels`` backend (the CPU default), the ``numpy`` backend (the previous CPU path) and the ``torch``
backend (the CUDA path, run on the CPU): payload bytes and decoded float bits must be identical, for
lengths with partial bytes, partial buckets and several chunks, and for float16/bfloat16 inputs.
"""

from __future__ import annotations

import pytest
import torch

from mpicomm.codecs import bitpack
from mpicomm.codecs import moniqua as lattice
from mpicomm.codecs._layout import CHUNK_CPU
from mpicomm.codecs.qsgd import QSGDCodec, TernGradCodec
from mpicomm.codecs.uniform import UniformCodec

CODECS = {
    "uniform 1 nearest": lambda: UniformCodec(1),
    "uniform 2 stochastic": lambda: UniformCodec(2, rounding="stochastic", seed=3),
    "uniform 4 nearest fixed range": lambda: UniformCodec(4, lo=-1.5, hi=2.0),
    "uniform 8 stochastic": lambda: UniformCodec(8, rounding="stochastic"),
    "uniform 3 (no kernel)": lambda: UniformCodec(3),
    "qsgd 2": lambda: QSGDCodec(2, seed=5),
    "qsgd 4": lambda: QSGDCodec(4),
    "qsgd 8": lambda: QSGDCodec(8),
    "qsgd 4 one bucket": lambda: QSGDCodec(4, bucket_size=None),
    "qsgd 4 bucket 100": lambda: QSGDCodec(4, bucket_size=100),
    "qsgd 4 bucket 7 (no kernel)": lambda: QSGDCodec(4, bucket_size=7),
    "terngrad": TernGradCodec,
}
LENGTHS = [0, 1, 5, 8, 13, 512, 1001, CHUNK_CPU + 777]


def run(make, backend: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codec = make()
    with bitpack.use_backend(backend):
        first, second = codec.encode(x), codec.encode(x)
        return first, second, codec.decode(first, x.numel())


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("n", LENGTHS)
def test_kernels_equal_numpy_and_torch_paths(name, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * 3
    if n > 20:
        x[7:19] = 0.0  # a zero bucket (QSGD with bucket 7) and ties at the grid
    got = run(CODECS[name], "kernels", x)
    for backend in ("numpy", "torch"):
        want = run(CODECS[name], backend, x)
        for a, b, what in zip(got, want, ("payload", "second payload", "decode")):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (backend, what)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["uniform 2 stochastic", "qsgd 4", "terngrad"])
def test_kernels_take_half_precision_inputs_as_the_reference(name, dtype):
    x = torch.randn(3 * 1000 + 3, generator=torch.Generator().manual_seed(1)).to(dtype)
    got, want = run(CODECS[name], "kernels", x), run(CODECS[name], "torch", x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_qsgd_kernel_rounds_with_given_uniforms_as_the_reference():
    x = torch.randn(4099, generator=torch.Generator().manual_seed(2))
    u = QSGDCodec(4).draw_uniforms(x.numel(), x.device)
    u[:100] = torch.rand(100, generator=torch.Generator().manual_seed(3))  # not of the draws' form
    payloads = []
    for backend in ("kernels", "torch"):
        with bitpack.use_backend(backend):
            payloads.append(QSGDCodec(4).encode(x, uniforms=u))
    assert torch.equal(*payloads)


def test_dither_kernel_equals_the_numpy_slices():
    coords = torch.cat([torch.arange(0, 3 * lattice.DITHER_CHUNK + 5), torch.tensor([2**40 + 1, 2**50])])
    key = lattice.stream_key(7, 11)
    with bitpack.use_backend("numpy"):
        want = lattice.dither(key, coords)
    assert torch.equal(lattice.dither(key, coords), want)


def test_cpu_codecs_run_the_kernels_by_default(monkeypatch):
    """The kernels are what a CPU tensor goes through unless a backend is forced (a silent fallback would fail)."""
    from mpicomm.codecs.kernels import qsgd, uniform

    def refuse(*args):
        raise RuntimeError("kernel called")

    assert bitpack.kernels_enabled(torch.device("cpu")) and not bitpack.kernels_enabled(torch.device("meta"))
    x = torch.randn(100)
    for module, name, make in ((uniform, "encode_nearest", CODECS["uniform 1 nearest"]),
                               (qsgd, "encode", CODECS["qsgd 4"])):
        with monkeypatch.context() as patch:
            patch.setattr(module, name, refuse)
            with pytest.raises(RuntimeError, match="kernel called"):
                make().encode(x)
            with bitpack.use_backend("numpy"):
                make().encode(x)


def test_qsgd_kernel_rounds_once_as_torch_addcmul():
    """u + x * inv is rounded once (a fused multiply-add) on both paths: the data below holds elements where
    rounding the product first would move floor() to another code, and the payloads still agree."""
    n, bucket, s = 1 << 22, 512, 127
    g = torch.Generator().manual_seed(4)
    x = torch.rand(n, generator=g).mul_(2).sub_(1)  # codes spread over all of -127..127
    u = torch.rand(n, generator=g)
    m = x.abs().view(-1, bucket).amax(dim=1)
    inv = (1.0 / m * s).repeat_interleave(bucket)
    product_first = torch.floor(x * inv + u)
    rounded_once = torch.floor((x.double() * inv.double() + u.double()).float())
    assert (product_first != rounded_once).sum() > 0  # the data can tell the two apart
    payloads = []
    for backend in ("kernels", "torch"):
        with bitpack.use_backend(backend):
            payloads.append(QSGDCodec(8).encode(x, uniforms=u))
    assert torch.equal(*payloads)


@pytest.mark.parametrize("options", [dict(d=16), dict(d=8, K=512), dict(d=4, mode="unbiased"), dict(d=16, K=64),
                                     dict(d=8, K=2048),
                                     dict(d=16, n_bit=4, min_compress=40)])
def test_hsq_kernels_equal_numpy_and_torch_paths(options):
    """Greedy selection (first argmax of |p|, NaN rows included) and the all-layers decode, wide indices too."""
    from mpicomm.codecs import HSQCodec

    layout = [5, 64, 3001, 17, 4096, 1]
    x = torch.randn(sum(layout), generator=torch.Generator().manual_seed(5))
    if options.get("mode") != "unbiased":  # (its sampling has no answer for NaN weights)
        x[100:116] = float("nan")  # a chunk whose products are all NaN
    x[200:216] = 0.0  # a chunk whose products tie at 0
    runs = []
    for backend in ("kernels", "numpy", "torch"):
        codec = HSQCodec(layout, **options)
        with bitpack.use_backend(backend):
            payload = codec.encode(x)
            runs.append((payload, codec.encode(x), codec.decode(payload, x.numel())))
    for other in runs[1:]:
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(runs[0], other))
