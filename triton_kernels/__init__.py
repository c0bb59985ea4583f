"""rlk's kernels as plain ``@triton.jit`` functions, launched from JAX through
jax-triton and from torch natively: one kernel source with one
specialization for both, so they share bits. Arithmetic only: rlk_jax owns
the contracts."""
