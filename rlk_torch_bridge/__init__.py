"""PyTorch bridge: rlk's ops as torch.autograd.Functions over DLPack.

Filled by the bridge work; torch is an optional extra, and nothing in
``rlk_jax``, ``pallas_kernels`` or ``cuda_ffi`` imports this package.
"""
