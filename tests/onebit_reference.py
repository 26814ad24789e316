"""The two-sided error-compensated 1-bit average with one worker scale, for all ranks in one process (plain torch).

Independent of ``mpicomm.codecs.SignCodec`` and ``mpicomm.algorithms.onebit``: the references of 0/1 Adam
and 1-bit LAMB use it.
"""

import math

import torch


def sign_compress(x):
    """||x||_2 / sqrt(len x) * sign(x), sign(0) = +1."""
    s = x.pow(2).sum().sqrt() / math.sqrt(x.numel())
    return torch.where(x >= 0, s, -s)


def onebit_average(vecs, e, e_srv):
    """Two-sided 1-bit average of the rows of ``vecs`` (n, d); updates e (n, D) and e_srv (n, L) in place.

    Each row (zero-padded to D = n L, plus its error) is compressed with one scale; server k averages
    chunk k of the n compressed rows, adds its error and compresses that chunk; padding never counts.
    """
    n, d = vecs.shape
    L = e_srv.shape[1]
    u = torch.zeros(n, n * L)
    u[:, :d] = vecs
    u += e
    sent = torch.stack([sign_compress(row) for row in u])
    e.copy_(u - sent)
    e[:, d:] = 0
    out = torch.zeros(n * L)
    for k in range(n):
        real = min(max(d - k * L, 0), L)
        s = sent[:, k * L:(k + 1) * L].mean(0)
        s[real:] = 0
        s = s + e_srv[k]
        c = sign_compress(s)
        e_srv[k] = s - c
        e_srv[k, real:] = 0
        out[k * L:(k + 1) * L] = c
    return out[:d]
