"""rlk's kernels as plain ``@triton.jit`` functions: launched from JAX through
jax-triton and from torch natively, so both share one compiled kernel and its
bits. Arithmetic only: rlk_jax owns the contracts."""
