"""Pallas kernel bodies, one module per op and lowering.

Kernels own only the arithmetic; argument checks, gradients and the choice of
implementation live in ``rlk_jax``.
"""

from pallas_kernels import (det_matmul, det_matmul_mgpu, linear_logp, row_gather,
                            triton_backend)

__all__ = ["det_matmul", "det_matmul_mgpu", "linear_logp", "row_gather",
           "triton_backend"]
