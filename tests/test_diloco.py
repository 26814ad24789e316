"""SparseLoCo's chunked top-k codec and the DiLoCo family's option checks (serial)."""

import math

import pytest
import torch

from mpicomm.algorithms.local.decentralized_diloco import DecentralizedDiLoCoConfig
from mpicomm.algorithms.local.diloco import DiLoCoConfig
from mpicomm.algorithms.local.sparseloco import SparseLoCoConfig
from mpicomm.codecs import bitpack
from mpicomm.codecs.chunked_topk import ChunkedTopKCodec
from mpicomm.training.param_groups import app_optimizer


@pytest.mark.parametrize("n,chunk,density,bits", [
    (0, 4096, 0.02, 2), (1, 4096, 0.02, 2), (83, 32, 0.25, 2), (10_000, 4096, 0.02, 2), (5000, 1000, 0.01, 3),
    (70_000, 65_536, 0.001, 2), (300, 300, 1.0, 8),
])
def test_payload_size_formula_and_kept_set(n, chunk, density, bits):
    """8 bytes per chunk + packed value codes + index bits in byte-wide pieces; each chunk keeps its k largest."""
    codec = ChunkedTopKCodec(density, chunk, bits)
    c = min(chunk, n)
    m = -(-n // c) if n else 0
    k = min(c, max(1, math.ceil(density * c - 1e-6))) if n else 0
    b = max(1, (c - 1).bit_length()) if n else 1
    index_bytes = sum(bitpack.packed_bytes(m * k, min(8, b - s)) for s in range(0, b, 8))
    assert codec.payload_bytes(n) == 8 * m + bitpack.packed_bytes(m * k, bits) + index_bytes
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    payload = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.numel() == codec.payload_bytes(n)
    y = codec.decode(payload, n)
    for start in range(0, n, max(c, 1)):
        xs, ys = x[start:start + c], y[start:start + c]
        kept = torch.topk(xs.abs(), min(k, xs.numel())).indices
        assert set(torch.nonzero(ys).flatten().tolist()) <= set(kept.tolist())
        lo, hi = xs[kept].min(), xs[kept].max()
        step = float(hi - lo) / ((1 << bits) - 1)
        assert float((ys[kept] - xs[kept]).abs().max()) <= step / 2 + 1e-6


def test_lossless_at_full_density_and_eight_bits_on_the_grid():
    """Values already on a chunk's 8-bit grid come back exactly; the torch packing path gives the same bytes."""
    x = torch.arange(256, dtype=torch.float32).sub_(128).mul_(0.5)[torch.randperm(256, generator=torch.Generator()
                                                                                   .manual_seed(0))]
    codec = ChunkedTopKCodec(1.0, 256, 8)
    assert torch.equal(codec.roundtrip(x), x)
    with bitpack.use_backend("torch"):
        torch_bytes = codec.encode(x)
        assert torch.equal(codec.decode(torch_bytes, 256), x)
    assert torch.equal(torch_bytes, codec.encode(x))


@pytest.mark.parametrize("kwargs,message", [
    ({"density": 0.0}, "density must be"), ({"density": 1.5}, "density must be"), ({"chunk": 0}, "chunk must be"),
    ({"bits": 9}, "bits must be"), ({"chunk": 2.0}, "chunk must be"),
])
def test_codec_refuses_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ChunkedTopKCodec(**kwargs)


@pytest.mark.parametrize("config,kwargs,message", [
    (DiLoCoConfig, {"period": 0}, "period must be an int >= 1"),
    (DiLoCoConfig, {"outer_lr": -1.0}, "outer_lr must be in"),
    (DiLoCoConfig, {"outer_momentum": 1.0}, "outer_momentum must be in"),
    (DiLoCoConfig, {"codec": "topk"}, "do not fit codec 'topk'"),
    (DiLoCoConfig, {"codec": "uniform", "codec_options": {"bits": 4, "seed": 1}}, "must not contain 'seed'"),
    (SparseLoCoConfig, {"density": 2.0}, "density must be in"),
    (SparseLoCoConfig, {"bits": True}, "bits must be an int in"),
    (SparseLoCoConfig, {"ef_decay": -0.1}, "ef_decay must be in"),
    (DecentralizedDiLoCoConfig, {"gossip_rounds": 1.5}, "gossip_rounds must be an int >= 1"),
    (DecentralizedDiLoCoConfig, {"outer_nesterov": "yes"}, "outer_nesterov must be a bool"),
    (DiLoCoConfig, {"inner_optimizer": "adam"}, "inner_optimizer must be one of"),
    (DiLoCoConfig, {"inner_optimizer": "adamw", "momentum": 0.9}, "momentum must be 0 with inner_optimizer"),
    (SparseLoCoConfig, {"beta2": 0.95}, "beta2 set the AdamW inner step"),
    (DiLoCoConfig, {"inner_optimizer": "adamw", "beta1": 1.0}, "beta1 must be in"),
])
def test_configs_refuse_bad_options(config, kwargs, message):
    with pytest.raises(ValueError, match=message):
        config(**kwargs)


def test_defaults_are_the_papers():
    d = DiLoCoConfig()
    assert (d.period, d.outer_lr, d.outer_momentum, d.outer_nesterov, d.codec) == (10, 0.7, 0.9, True, None)
    s = SparseLoCoConfig()
    assert (s.outer_lr, s.density, s.chunk, s.bits) == (1.0, 0.02, 4096, 2)
    assert DecentralizedDiLoCoConfig().gossip_rounds == 1
    assert (d.inner_optimizer, d.beta1, d.beta2, d.eps) == ("sgd", 0.9, 0.999, 1e-8)


def test_app_optimizer_gives_the_local_methods_adamw_with_their_betas():
    """--no-decay-bias-norm with inner_optimizer adamw: AdamW over the two groups, the fields taken from the options."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    options = {"inner_optimizer": "adamw", "lr": 4e-4, "weight_decay": 0.1, "beta2": 0.95, "period": 5}
    opt = app_optimizer("diloco", model, options)
    assert isinstance(opt, torch.optim.AdamW) and options == {"period": 5}
    assert [(g["lr"], g["betas"], g["weight_decay"]) for g in opt.param_groups] == [
        (4e-4, (0.9, 0.95), 0.1), (4e-4, (0.9, 0.95), 0.0)]
    assert isinstance(app_optimizer("diloco", model, {"momentum": 0.9}), torch.optim.SGD)
