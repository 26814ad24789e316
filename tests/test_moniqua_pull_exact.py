"""PullMessage is bit for bit the tensor-by-tensor implementation it replaced.

``Reference`` below is Moniqua-AD-PSGD's message as it was before encode and pull worked chunk by chunk
over the message's code positions: every tensor's part encoded, decoded and fingerprinted on its own
(``lattice_encode`` / ``lattice_decode`` per chunk of a part, fingerprints summed on the host). It is kept
here only as the reference. The tests compare the published bytes, the increment and the wrap flags of
:class:`PullMessage` against it on bits 1/2/4/8, parts 1/3/4, the three roundings (stochastic: the same
generator stream), with forced wraps, with chunks that cut through tensors, and over a short two-rank
trajectory of encode / pull / mix.

One difference is by design: the reference never writes the code positions of a slot that its tensor's
part does not fill (the end of a slot when the part is shorter than ``ceil(n / P)``), so a reused buffer
keeps codes of an earlier, longer part there; PullMessage writes code 0 (a message is a function of the
model, version and theta alone). No reader looks at those positions: the tests check that the bytes
agree everywhere else, and that both pulls of either message agree.
"""

import pytest
import torch

from mpicomm.codecs import chunk_ranges
from mpicomm.codecs import moniqua as lattice
from mpicomm.codecs.moniqua import MoniquaPullCodec as PullMessage
from mpicomm.flat import Layer

LOW31 = 0x7FFFFFFF
SIZES = [10, 3, 40, 1, 0, 2, 129, 7, 64, 300]  # an empty tensor, tensors shorter than P, chunk-crossing ones


def layers(sizes=SIZES) -> list[Layer]:
    out, offset = [], 0
    for i, n in enumerate(sizes):
        out.append(Layer(f"m{i // 2}.{'weight' if i % 2 == 0 else 'bias'}", offset, (n,)))
        offset += n
    return out


def thetas(sizes=SIZES) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(sizes))
    return (0.02 + 0.3 * torch.rand(len(sizes), generator=g)).double()


def fingerprint(L: torch.Tensor, coords: torch.Tensor) -> int:
    """sum_c H_c (L_c mod 2^20) of one run, as a Python int."""
    return int(torch.bitwise_and(L, (1 << 20) - 1).mul_(lattice.coordinate_hashes(coords)).sum())


class Reference:
    """The tensor-by-tensor encode / pull / mix (the implementation PullMessage replaced), on ``m``'s layout."""

    def __init__(self, m: PullMessage):
        self.m = m

    def _coords(self, key, lo, hi):
        coords = torch.arange(lo, hi)
        return coords, None if key is None else lattice.dither(key, coords)

    def _noise(self, n):
        if self.m.noise is None:
            return None
        return self.m.noise.uniform_(torch.empty(n, dtype=torch.float32))

    def encode(self, x, version, theta, message):
        m = self.m
        scales = m.scales(theta)
        message[:8].copy_(torch.tensor([version], dtype=torch.int64).view(torch.uint8))
        message[8:m.prefix].copy_(scales.view(torch.uint8))
        body, key = message[m.prefix:], m._key(version)
        own = torch.zeros(m.count, dtype=torch.int64)
        for tensor, (start, stop) in enumerate(m.layout.parts_at(version)):
            s, slot = float(scales[tensor]), m.layout.slots[tensor]
            for lo, hi in chunk_ranges(stop - start, m.chunk):
                coords, u = self._coords(key, start + lo, start + hi)
                packed, L = lattice.lattice_encode(x[start + lo:start + hi], s, m.bits, u, self._noise(hi - lo))
                at = slot + lo * m.bits // 8
                body[at:at + packed.numel()].copy_(packed)
                own[tensor] += fingerprint(L, coords)
        m.layout.header(body).copy_(own.bitwise_and_(LOW31))

    def pull(self, message, x):
        m = self.m
        version, scales = m.version(message), message[8:m.prefix].clone().view(torch.float32)
        body, key = message[m.prefix:], m._key(version)
        sent = m.layout.header(body).tolist()
        parts = m.layout.parts_at(version)
        increment = torch.empty(sum(b - a for a, b in parts), dtype=torch.float32)
        wrapped = torch.zeros(m.count, dtype=torch.bool)
        at = 0
        for tensor, (start, stop) in enumerate(parts):
            s, slot, got = float(scales[tensor]), m.layout.slots[tensor], 0
            for lo, hi in chunk_ranges(stop - start, m.chunk):
                coords, u = self._coords(key, start + lo, start + hi)
                mine = x[start + lo:start + hi]
                packed = body[slot + lo * m.bits // 8:slot + (hi * m.bits + 7) // 8]
                theirs = lattice.lattice_decode(packed, mine, s, m.bits, u)
                got += fingerprint(theirs, coords)
                _, own = lattice.lattice_encode(mine, s, m.bits, u, self._noise(hi - lo))
                torch.mul(theirs.sub_(own), 1.0 / s, out=increment[at + lo:at + hi])
            wrapped[tensor] = (got & LOW31) != sent[tensor]
            at += stop - start
        return increment, wrapped

    def mix(self, x, version, increment, wrapped, alpha):
        at = 0
        for flag, (start, stop) in zip(wrapped.tolist(), self.m.layout.parts_at(version)):
            if not flag:
                x[start:stop].add_(increment[at:at + stop - start], alpha=alpha)
            at += stop - start


def pair(bits, parts, rounding, chunk=None, rank_seed=5, frame=None):
    """A new PullMessage and a Reference on an identical one (its own generator, same seed).

    ``chunk``: the pieces of a part that stochastic rounding draws (and the reference encodes) at a time;
    ``frame``: code positions per frame of the new one (default: as ``chunk``, if given).
    """
    new = PullMessage(layers(), bits, parts, rounding, seed=17, rank_seed=rank_seed, device="cpu")
    old = PullMessage(layers(), bits, parts, rounding, seed=17, rank_seed=rank_seed, device="cpu")
    if chunk is not None:
        new.chunk = old.chunk = new.frame = chunk
    if frame is not None:
        new.frame = frame
    return new, Reference(old)


def unused(m: PullMessage, version: int) -> torch.Tensor:
    """Bool per message byte: True on the bytes that hold only code positions no part fills at ``version``."""
    used = torch.zeros(m.nbytes, dtype=torch.bool)
    used[:m.prefix + m.layout.header_bytes] = True
    for tensor, (start, stop) in enumerate(m.layout.parts_at(version)):
        at = m.prefix + m.layout.slots[tensor]
        used[at:at + (((stop - start) * m.bits + 7) // 8)] = True
    return ~used


def models(seed, closeness=0.9, sizes=SIZES):
    """x_j and an x_i within ``closeness`` theta_l of it on every coordinate of tensor l."""
    g = torch.Generator().manual_seed(seed)
    d = sum(sizes)
    xj = torch.randn(d, generator=g)
    bound = thetas(sizes).repeat_interleave(torch.tensor(sizes)).float() * closeness
    return xj, xj + (torch.rand(d, generator=g) * 2 - 1) * bound


CONFIGS = [(bits, parts, rounding) for bits in (1, 2, 4, 8) for parts in (1, 3, 4)
           for rounding in ("dither", "nearest", "stochastic") if not (bits == 1 and rounding == "stochastic")]


@pytest.mark.parametrize("bits,parts,rounding", CONFIGS)
@pytest.mark.parametrize("chunk,frame", [(None, None), (64, 64), (None, 64), (24, 128)])
def test_encode_and_pull_are_the_tensor_by_tensor_results_bit_for_bit(bits, parts, rounding, chunk, frame):
    new, old = pair(bits, parts, rounding, chunk, frame=frame)
    theta = thetas()
    for version in (0, 1, 2, 7):
        xj, xi = models(100 * bits + 10 * parts + version)
        mine, theirs = torch.zeros(new.nbytes, dtype=torch.uint8), torch.zeros(new.nbytes, dtype=torch.uint8)
        new.encode(xj, version, theta, mine)
        old.encode(xj, version, theta, theirs)
        assert torch.equal(mine, theirs)
        far = xi.clone()
        a, b = new.layout.parts_at(version)[6]  # one coordinate of tensor 6 beyond the range: a forced wrap
        far[(a + b) // 2] += 3.0 * float(theta[6]) / (1 - 2 * new.delta)
        for x, expect in ((xi, False), (far, True)):
            increment, wrapped = new.pull(mine, x)
            ref_increment, ref_wrapped = old.pull(theirs, x)
            assert increment.dtype == torch.float32 and wrapped.dtype == torch.bool and wrapped.device.type == "cpu"
            assert torch.equal(increment.view(torch.int32), ref_increment.view(torch.int32))
            assert torch.equal(wrapped, ref_wrapped)
            assert bool(wrapped[6]) == expect and not wrapped[:6].any() and not wrapped[7:].any()
            y, ref_y = x.clone(), x.clone()
            new.mix(y, version, increment, wrapped, 0.5)
            old.mix(ref_y, version, ref_increment, ref_wrapped, 0.5)
            assert torch.equal(y.view(torch.int32), ref_y.view(torch.int32))
    if rounding == "stochastic":  # the generators drew the same stream, as much of it
        assert torch.equal(new.noise.state_dict()["rng_state"], old.m.noise.state_dict()["rng_state"])


@pytest.mark.parametrize("bits,parts,rounding", [(4, 4, "nearest"), (2, 3, "dither"), (8, 4, "stochastic"),
                                                 (1, 3, "nearest")])
def test_a_reused_buffer_differs_only_on_unfilled_code_positions(bits, parts, rounding):
    """Encoding round after round into one buffer: the reference leaves stale codes where a part is shorter than
    its slot, PullMessage writes 0 there; the bytes agree elsewhere, and both pulls read either message alike."""
    new, old = pair(bits, parts, rounding, chunk=64)
    theta = thetas()
    mine, theirs = torch.zeros(new.nbytes, dtype=torch.uint8), torch.zeros(new.nbytes, dtype=torch.uint8)
    stale = 0
    for version in range(2 * parts + 1):
        xj, xi = models(version)
        new.encode(xj, version, theta, mine)
        old.encode(xj, version, theta, theirs)
        gaps = unused(new, version)
        assert torch.equal(mine[~gaps], theirs[~gaps])
        assert not mine[gaps].any()
        stale += int(theirs[gaps].ne(0).sum())
        for x in (xi, xj):
            state = None if new.noise is None else new.noise.state_dict()
            a, b = new.pull(mine, x)
            if state is not None:
                new.noise.load_state_dict(state)
            c, d = new.pull(theirs, x)
            e, f = old.pull(theirs, x)
            assert torch.equal(a.view(torch.int32), c.view(torch.int32)) and torch.equal(b, d)
            assert torch.equal(a.view(torch.int32), e.view(torch.int32)) and torch.equal(b, f)
    assert parts == 1 or stale > 0  # the case is exercised (a part shorter than its slot after a longer one)


@pytest.mark.parametrize("bits,parts,rounding", [(4, 4, "nearest"), (4, 4, "dither"), (2, 3, "stochastic"),
                                                 (1, 1, "nearest")])
def test_a_two_rank_trajectory_is_bit_for_bit(bits, parts, rounding):
    """Two ranks alternating pull / mix / local step / publish for 3 P + 2 steps (one rank with a tiny theta on one
    tensor, so that some pulls wrap): the models, messages and generator states follow the reference's exactly."""
    sizes = SIZES
    theta = [thetas(), thetas() * 0.5]
    theta[1][2] = 1e-4  # rank 1 publishes tensor 2 on a grid its peer cannot decode
    ranks = [pair(bits, parts, rounding, chunk=64, rank_seed=r) for r in (0, 1)]
    x0, x1 = models(3, sizes=sizes)
    new_x, old_x = [x0.clone(), x1.clone()], [x0.clone(), x1.clone()]
    new_msg = [torch.zeros(ranks[0][0].nbytes, dtype=torch.uint8) for _ in range(2)]
    old_msg = [torch.zeros(ranks[0][0].nbytes, dtype=torch.uint8) for _ in range(2)]
    for r in (0, 1):
        ranks[r][0].encode(new_x[r], 0, theta[r], new_msg[r])
        ranks[r][1].encode(old_x[r], 0, theta[r], old_msg[r])
    g = torch.Generator().manual_seed(0)
    wraps = 0
    for step in range(3 * parts + 2):
        for r in (0, 1):
            new, old = ranks[r]
            peer = 1 - r
            version = new.version(new_msg[peer])
            inc, w = new.pull(new_msg[peer], new_x[r])
            ref_inc, ref_w = old.pull(old_msg[peer], old_x[r])
            assert torch.equal(w, ref_w)
            wraps += int(w.sum())
            new.mix(new_x[r], version, inc, w, 0.5)
            old.mix(old_x[r], version, ref_inc, ref_w, 0.5)
            grad = torch.randn(new_x[r].numel(), generator=g) * 0.01
            new_x[r].sub_(grad)
            old_x[r].sub_(grad)
            assert torch.equal(new_x[r].view(torch.int32), old_x[r].view(torch.int32))
            new.encode(new_x[r], step + 1, theta[r], new_msg[r])
            old.encode(old_x[r], step + 1, theta[r], old_msg[r])
            gaps = unused(new, step + 1)
            assert torch.equal(new_msg[r][~gaps], old_msg[r][~gaps])
    assert wraps > 0
    if rounding == "stochastic":
        for new, old in ranks:
            assert torch.equal(new.noise.state_dict()["rng_state"], old.m.noise.state_dict()["rng_state"])


def test_the_reference_can_tell_a_difference():
    """The comparisons above are sensitive: a grid one ulp off changes the bytes, a changed code the increment."""
    new, old = pair(4, 4, "nearest")
    xj, xi = models(1)
    a, b = torch.zeros(new.nbytes, dtype=torch.uint8), torch.zeros(new.nbytes, dtype=torch.uint8)
    theta = thetas()
    new.encode(xj, 3, theta, a)
    old.encode(xj, 3, theta * (1 + 1e-6), b)
    assert not torch.equal(a, b)
    old.encode(xj, 3, theta, b)
    c = b.clone()
    c[new.prefix + new.layout.header_bytes] ^= 1
    assert not torch.equal(new.pull(a, xi)[0], old.pull(c, xi)[0])
