"""rlk_jax: the public JAX API of rlk.

    packed, info = rlk_jax.pack(x, mask, capacity=...)
    x2 = rlk_jax.unpack(packed, info)
    c = rlk_jax.det_gemm(a, b)        # batch-invariant a [..., K] @ b [K, N]
    o = rlk_jax.det_attention(q, k, v, cu_seqlens=cu)  # decode = prefill bits
    f = rlk_jax.batch_invariant(model_fn)  # its products and norms on rlk
    rlk_jax.batch_invariant_sampler(tunix_sampler)  # rollouts = trainer bits

Every op dispatches over an implementations table; see
:func:`implementations` and :func:`selected_implementation`.

Attributes load on first use, so ``rlk_jax.host`` (NumPy only) imports
without JAX.
"""

import importlib

_EXPORTS = {
    "PackInfo": "rlk_jax._pack",
    "check_no_overflow": "rlk_jax._pack",
    "pack": "rlk_jax._pack",
    "pack_info": "rlk_jax._pack",
    "unpack": "rlk_jax._pack",
    "pack_sharded": "rlk_jax._pack_sharded",
    "unpack_sharded": "rlk_jax._pack_sharded",
    "det_gemm": "rlk_jax._det_gemm",
    "det_gemm_tune_pending": "rlk_jax._det_gemm",
    "det_attention": "rlk_jax._attention",
    "batch_invariant": "rlk_jax._batch_invariant",
    "batch_invariant_sampler": "rlk_jax._tunix_sampler",
    "linear_logp": "rlk_jax._linear_logp",
    "next_token_targets": "rlk_jax._replay",
    "response_predict_index": "rlk_jax._replay",
    "block_causal_mask": "rlk_jax._replay",
    "implementations": "rlk_jax._dispatch",
    "selected_implementation": "rlk_jax._dispatch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'rlk_jax' has no attribute {name!r}")
  value = getattr(importlib.import_module(_EXPORTS[name]), name)
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(_EXPORTS))
