"""Codecs cut at their ``split_alignment``: pieces decode, bit for bit, to the pieces of the whole (serial)."""

import pytest
import torch

from mpicomm.codecs import IdentityCodec, QSGDCodec, SignCodec, TernGradCodec


def _pieces(numel, align, generator):
    """Random cut points on multiples of ``align``, as [lo, hi) pairs covering range(numel)."""
    cuts = sorted({int(c) // align * align for c in torch.randint(1, numel, (5,), generator=generator)} - {0})
    edges = [0, *cuts, numel]
    return [(lo, hi) for lo, hi in zip(edges, edges[1:]) if lo < hi]


@pytest.mark.parametrize("make", [
    lambda: QSGDCodec(4, 16, seed=5),
    lambda: QSGDCodec(2, 7, seed=5),
    lambda: QSGDCodec(8, 512, seed=5),
    lambda: SignCodec("none"),
    lambda: IdentityCodec(),
], ids=["qsgd4-16", "qsgd2-7", "qsgd8-512", "sign-none", "identity"])
@pytest.mark.parametrize("numel", [1000, 300_001])
def test_pieces_in_reverse_order_decode_to_the_whole(make, numel):
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g)
    x[100:140] = 0.0  # a zero bucket
    whole_codec, piece_codec = make(), make()
    whole = whole_codec.decode(whole_codec.encode(x), numel)
    align = piece_codec.split_alignment()
    draw = getattr(piece_codec, "draw_uniforms", None)
    u = draw(numel, x.device) if draw else None
    got = torch.full((numel,), float("nan"))
    for lo, hi in reversed(_pieces(numel, align, g)):  # backward's order: the last elements first
        payload = piece_codec.encode(x[lo:hi]) if u is None else piece_codec.encode(x[lo:hi], uniforms=u[lo:hi])
        piece_codec.decode(payload, hi - lo, out=got[lo:hi])
    assert torch.equal(got, whole)
    if u is not None:  # the stream advanced as one whole encode's: the next step matches too
        assert torch.equal(piece_codec.encode(x), whole_codec.encode(x))


@pytest.mark.parametrize("codec", [TernGradCodec(), QSGDCodec(4, None), SignCodec("l1"), SignCodec("l2")],
                         ids=repr)
def test_global_scales_cannot_be_cut(codec):
    assert codec.split_alignment() is None


def test_uniforms_must_match_the_input():
    codec = QSGDCodec(4, 16)
    with pytest.raises(ValueError, match="uniforms must have shape"):
        codec.encode(torch.ones(10), uniforms=torch.ones(9))
