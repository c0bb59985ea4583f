"""CUDA C++ (CUTLASS SM90) kernels behind XLA FFI custom calls.

Nothing is built yet: the det_gemm SM90 path fills this package. Importing it
is always safe, with or without CUDA.
"""

AVAILABLE = False
UNAVAILABLE_REASON = "no cuda_ffi kernels are built in this version of rlk"
