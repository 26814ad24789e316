"""numba's decorators as the kernels use them (importing this imports numba)."""

from __future__ import annotations

import numba
from llvmlite import ir as llvm_ir
from numba.core import types
from numba.extending import intrinsic

__all__ = ["fma32", "inline", "kernel"]

kernel = numba.njit(cache=True, nogil=True)
"""Decorator of a kernel entry point: compiled on first call, cached on disk, runs without the GIL."""

inline = numba.njit(inline="always")
"""Decorator of a kernel's building block: inlined into its caller, so constant arguments (the bit width,
the rounding) are folded and its loops specialised and vectorised."""


@intrinsic
def fma32(typingctx, a, b, c):
    """``a * b + c`` on float32 rounded once (LLVM's ``llvm.fma.f32``), as torch's vectorised ``addcmul_``
    and ``add_(..., alpha=)`` compute it on CPUs with fused multiply-add."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f32 = llvm_ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f32], llvm_ir.FunctionType(f32, [f32, f32, f32]))
        return builder.call(fn, args)

    return sig, codegen
