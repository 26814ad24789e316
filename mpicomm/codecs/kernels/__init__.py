"""Fused single-pass CPU kernels for the codecs, compiled by numba.

A codec written as torch/numpy ops makes one pass over memory per op: uniform nearest encoding is six
(subtract, scale, + 1/2, clamp, float -> int, pack), and each costs 0.2-0.4x a copy of the tensor. A kernel
here reads every element once and writes its code once, so an encode costs about one copy
(``bench/codecs/codecs.py``). The kernels compute the very float32 operations of the op-at-a-time paths they
replace, in the same order: numba does not contract a multiply and an add unless asked, and where torch's
vectorised ops do round ``a * b + c`` once (``addcmul_``, ``add_(alpha=)``) the kernel calls ``llvm.fma``
too (:func:`._jit.fma32`). Their bytes and values are therefore bit for bit those paths', which stay as
the reference (``bitpack.use_backend("numpy")`` runs them on a CPU) and as the CUDA path
(``tests/test_codec_kernels.py``).

One module per codec family: :mod:`.uniform`, :mod:`.qsgd` (and TernGrad), :mod:`.moniqua` (Moniqua's
dither and frames), :mod:`.hsq`, and :mod:`.packing` (``bitpack``'s pack and unpack).

The kernels are compiled on first use and cached on disk next to this package (or under
``NUMBA_CACHE_DIR`` if it is read-only), so later processes load them in milliseconds;
:mod:`.warmup` compiles them all ahead (about 20 s once). They run in the calling
thread (``nogil``, no threading layer), which is what one MPI rank per core wants. Codecs import a kernel
module at their first CPU call, so a process that never quantizes on a CPU never imports numba.
"""

from __future__ import annotations

__all__ = ["WIDTHS"]

WIDTHS = (1, 2, 4, 8)
"""Code widths the kernels pack and unpack (a whole number of codes per byte); the codecs use their
op-at-a-time path for the others."""
