"""rlk_jax: the public JAX API of rlk.

    packed, info = rlk_jax.pack(x, mask, capacity=...)
    x2 = rlk_jax.unpack(packed, info)
    c = rlk_jax.det_gemm(a, b)        # batch-invariant a [..., K] @ b [K, N]

Every op dispatches over an implementations table; see
:func:`implementations` and :func:`selected_implementation`.
"""

from rlk_jax._dispatch import implementations, selected_implementation
from rlk_jax.det_gemm import det_gemm
from rlk_jax.pack import PackInfo, check_no_overflow, pack, pack_info, unpack

__all__ = [
    "PackInfo",
    "check_no_overflow",
    "det_gemm",
    "implementations",
    "pack",
    "pack_info",
    "selected_implementation",
    "unpack",
]
