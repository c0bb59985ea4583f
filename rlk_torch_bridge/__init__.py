"""rlk for PyTorch: the same ops, kernels and bits as ``rlk_jax``, as PyTorch
operators (``torch.ops.rlk.*``: schema, fake kernel, autograd), so eager
code, torch.compile, torch.export and CUDA graphs run them.

    c = rlk_torch_bridge.det_gemm(a, b)          # == rlk_jax.det_gemm, bitwise
    packed, info = rlk_torch_bridge.pack(x, mask)
    model = rlk_torch_bridge.replace_linear(model)  # nn.Linear -> DetLinear
    logp = rlk_torch_bridge.linear_logp(hidden, lm_head.weight, targets)
    with rlk_torch_bridge.batch_invariant_mode():   # any model, unmodified
      out = model(x)

On an SM90 GPU det_gemm and pack run the CUDA kernels on torch's stream;
elsewhere (and for other implementations) one jitted JAX call through
DLPack (zero-copy for contiguous tensors).

JAX would take 75% of the GPU's memory at start-up and starve torch in the
same process; importing this package sets ``XLA_PYTHON_CLIENT_PREALLOCATE``
to ``false`` unless you set it yourself (it only has an effect if JAX has not
started its GPU backend yet).
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from rlk_torch_bridge.batch_invariant import (  # noqa: E402
    BatchInvariantFallthrough, batch_invariant_mode, disable, enable,
    fallthroughs, is_enabled)
from rlk_torch_bridge.attention import det_attention  # noqa: E402
from rlk_torch_bridge.functions import PackInfo, det_gemm, pack, unpack  # noqa: E402
from rlk_torch_bridge.logp import (  # noqa: E402
    linear_logp, vocab_parallel_linear_logp)
from rlk_torch_bridge.nn import DetLinear, replace_linear  # noqa: E402
from rlk_torch_bridge.tensor_parallel import (  # noqa: E402
    ColumnParallelDetLinear, RowParallelDetLinear, parallelize)

__all__ = ["BatchInvariantFallthrough", "ColumnParallelDetLinear", "DetLinear",
           "PackInfo", "RowParallelDetLinear",
           "batch_invariant_mode", "det_attention", "det_gemm", "disable", "enable",
           "fallthroughs", "is_enabled", "linear_logp", "pack", "parallelize",
           "replace_linear", "unpack", "vocab_parallel_linear_logp"]
