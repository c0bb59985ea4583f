"""rlk for PyTorch: the same ops, kernels and bits as ``rlk_jax``, as
``torch.autograd.Function``s over DLPack (zero-copy for contiguous tensors).

    c = rlk_torch_bridge.det_gemm(a, b)          # == rlk_jax.det_gemm, bitwise
    packed, info = rlk_torch_bridge.pack(x, mask)
    model = rlk_torch_bridge.replace_linear(model)  # nn.Linear -> DetLinear
    logp = rlk_torch_bridge.linear_logp(hidden, lm_head.weight, targets)

JAX would take 75% of the GPU's memory at start-up and starve torch in the
same process; importing this package sets ``XLA_PYTHON_CLIENT_PREALLOCATE``
to ``false`` unless you set it yourself (it only has an effect if JAX has not
started its GPU backend yet).
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from rlk_torch_bridge.functions import PackInfo, det_gemm, pack, unpack  # noqa: E402
from rlk_torch_bridge.logp import linear_logp  # noqa: E402
from rlk_torch_bridge.nn import DetLinear, replace_linear  # noqa: E402

__all__ = ["DetLinear", "PackInfo", "det_gemm", "linear_logp", "pack",
           "replace_linear", "unpack"]
