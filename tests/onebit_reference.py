"""The two-sided error-compensated 1-bit average for all ranks in one process (plain torch), flat or in two levels.

Independent of ``mpicomm.codecs.SignCodec`` and ``mpicomm.algorithms.onebit``: the references of APMSqueeze's
two levels, 0/1 Adam and 1-bit LAMB use it.
"""

import math

import torch


def sign_compress(x):
    """||x||_2 / sqrt(len x) * sign(x), sign(0) = +1."""
    s = x.pow(2).sum().sqrt() / math.sqrt(x.numel())
    return torch.where(x >= 0, s, -s)


def onebit_average(vecs, e, e_srv, per_chunk=False):
    """Two-sided 1-bit average of the rows of ``vecs`` (n, d); updates e (n, D) and e_srv (n, L) in place.

    Each row (zero-padded to D = n L, plus its error) is compressed with one scale (``per_chunk``: a scale per
    chunk of L); server k averages chunk k of the n compressed rows, adds its error and compresses that chunk;
    padding never counts.
    """
    n, d = vecs.shape
    L = e_srv.shape[1]
    u = torch.zeros(n, n * L)
    u[:, :d] = vecs
    u += e
    if per_chunk:
        sent = torch.stack([torch.cat([sign_compress(part) for part in row.split(L)]) for row in u])
    else:
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


class FlatAverage:
    """The 1-bit average over n ranks with its error buffers: ``average(rows)`` for rows (n, d)."""

    def __init__(self, n, d, per_chunk=False):
        L = 8 * math.ceil(d / (8 * n))
        self.e, self.e_srv, self.per_chunk = torch.zeros(n, n * L), torch.zeros(n, L), per_chunk

    def __call__(self, rows):
        return onebit_average(rows, self.e, self.e_srv, self.per_chunk)

    def reset(self):
        """Both error buffers to zero."""
        self.e.zero_()
        self.e_srv.zero_()


class NodeAverage:
    """The two-level 1-bit average: n ranks as nodes of k, node means of each of the k shards (the first
    d mod k shards one element longer), a :class:`FlatAverage` over the n / k nodes per shard."""

    def __init__(self, n, k, d, per_chunk=False):
        base, extra = divmod(d, k)
        counts = [base + (j < extra) for j in range(k)]
        self.k, self.bounds = k, [(sum(counts[:j]), sum(counts[:j + 1])) for j in range(k)]
        self.shards = [FlatAverage(n // k, c, per_chunk) for c in counts]

    def __call__(self, rows):
        n, d = rows.shape
        means = rows.view(n // self.k, self.k, d).mean(1)  # (nodes, d): each node's exact mean
        return torch.cat([avg(means[:, lo:hi]) for avg, (lo, hi) in zip(self.shards, self.bounds)])

    def reset(self):
        """Every shard's error buffers to zero."""
        for avg in self.shards:
            avg.reset()
