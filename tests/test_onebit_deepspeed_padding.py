"""DeepSpeed's 1-bit exchange against ours, where they pad: the statements of docs/algorithms/apmsqueeze.md.

``deepspeed_call`` transcribes DeepSpeed's ``NcclBackend.compressed_allreduce`` (deepspeed/runtime/comm/nccl.py)
for all n ranks in one process, with the padded length its 1-bit optimizers give the error buffers (a multiple
of n lcm(n, 8)). Ours is the one-worker-scale average of ``tests/onebit_reference.py`` (the reference the
0/1 Adam and 1-bit LAMB tests hold mpicomm to), padded to a multiple of 8 n.
"""

import math

import pytest
import torch

from .onebit_reference import onebit_average


def _sign(x):
    """DeepSpeed's x.sign().add_(1).bool().float().add_(-0.5).mul_(2.0): +1 where x >= 0, -1 below."""
    return x.sign().add(1).bool().float().add(-0.5).mul(2.0)


def deepspeed_padded(d, n):
    """The error buffers' length in DeepSpeed's OnebitAdam / ZeroOneAdam / OnebitLamb: d up to a multiple of
    n * divider, divider = n * 8 / gcd(n, 8)."""
    unit = n * (n * 8 // math.gcd(n, 8))
    return d if d % unit == 0 else d + unit - d % unit


def deepspeed_call(rows, worker_error, server_error):
    """compressed_allreduce on every rank: rows (n, d); worker_error (n, D) and server_error (n, D / n) in place."""
    n, d = rows.shape
    padded = worker_error.shape[1]
    chunk = padded // n
    u = torch.cat([rows, torch.zeros(n, padded - d)], 1) + worker_error
    scale = u.norm(dim=1) / math.sqrt(padded)
    worker_error.copy_(u - scale[:, None] * _sign(u))
    out = torch.empty(padded)
    for k in range(n):
        s = (_sign(u[:, k * chunk:(k + 1) * chunk]) * scale[:, None] / n).sum(0) + server_error[k]
        server_scale = s.norm() / math.sqrt(chunk)
        server_error[k] = s - server_scale * _sign(s)
        out[k * chunk:(k + 1) * chunk] = server_scale * _sign(s)
    return out[:d]


def _calls(n, d, calls, seed, padded=None):
    """Both exchanges on the same ``calls`` random inputs; ``padded``: DeepSpeed's length (default its own)."""
    g = torch.Generator().manual_seed(seed)
    chunk = 8 * math.ceil(d / (8 * n))
    ours = (torch.zeros(n, n * chunk), torch.zeros(n, chunk))
    padded = deepspeed_padded(d, n) if padded is None else padded
    theirs = (torch.zeros(n, padded), torch.zeros(n, padded // n))
    for _ in range(calls):
        rows = torch.randn(n, d, generator=g) + 0.3 * torch.randn(1, d, generator=g)
        yield onebit_average(rows.clone(), *ours, per_chunk=False), deepspeed_call(rows.clone(), *theirs), chunk


@pytest.mark.parametrize("n, d", [(3, 1080), (5, 1000), (7, 5488), (2, 1008), (4, 1024)])
def test_no_padding_on_either_side_is_the_same_exchange(n, d):
    assert deepspeed_padded(d, n) == d == n * 8 * math.ceil(d / (8 * n))
    for ours, theirs, _ in _calls(n, d, calls=4, seed=0):
        assert torch.equal(torch.sign(ours), torch.sign(theirs))
        assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("n, d", [(2, 1000), (4, 1003), (3, 1000)])
def test_the_same_padded_length_differs_in_the_padded_chunk_first_then_everywhere(n, d):
    """Call 1: the chunks without padding agree, the padded one differs in magnitude only (its server scale
    counts DeepSpeed's +scale_j at the padding). Call 2: every chunk's magnitude differs (the worker error's
    padding is in the worker scale) and signs may flip in the padded chunk; call 3: anywhere."""
    assert deepspeed_padded(d, n) == n * 8 * math.ceil(d / (8 * n)) > d
    calls = list(_calls(n, d, calls=3, seed=1))
    ours, theirs, chunk = calls[0]
    last = (n - 1) * chunk
    assert torch.allclose(ours[:last], theirs[:last], rtol=1e-6, atol=1e-7)
    assert torch.equal(torch.sign(ours), torch.sign(theirs))
    assert float((ours[last:] - theirs[last:]).abs().max()) > 1e-3
    ours, theirs, _ = calls[1]
    for k in range(n):
        part = slice(k * chunk, min((k + 1) * chunk, d))
        assert float((ours[part] - theirs[part]).abs().max()) > 1e-4, k
    flips = [int((torch.sign(a) != torch.sign(b)).sum()) for a, b, _ in calls]
    assert flips[0] == 0 and flips[1] + flips[2] > 0, flips


def test_n_not_dividing_8_pads_further_and_moves_the_chunk_boundaries():
    """d = 100: DeepSpeed's (D, L) against ours, n = 3, 5, 6, 7 (the table in docs/algorithms/apmsqueeze.md)."""
    ours = {n: (n * 8 * math.ceil(100 / (8 * n)), 8 * math.ceil(100 / (8 * n))) for n in (3, 5, 6, 7)}
    theirs = {n: (deepspeed_padded(100, n), deepspeed_padded(100, n) // n) for n in (3, 5, 6, 7)}
    assert ours == {3: (120, 40), 5: (120, 24), 6: (144, 24), 7: (112, 16)}
    assert theirs == {3: (144, 48), 5: (200, 40), 6: (144, 24), 7: (392, 56)}
    assert all(deepspeed_padded(d, n) == n * 8 * math.ceil(d / (8 * n)) for n in (1, 2, 4, 8) for d in range(1, 300))
