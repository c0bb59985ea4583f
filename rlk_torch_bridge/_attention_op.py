"""``rlk::det_attention`` and ``rlk::det_attention_backward``: rlk_jax's
det_attention on flattened rows (``q [Tq, Hq, D]``, ``k, v [Tk, Hkv, D]``,
``seqs`` int32 ``[4, B]``) as PyTorch operators.

k and v may also be ``[B, S, Hkv, D]`` views read in place (the kernels on
CUDA only): a ``[B, Hkv, S, D]`` cache transposed, as
transformers hands its keys over, would otherwise be copied into rows each
layer. Their row ``b * stride(0) / stride(1) + t`` is token t of batch row
b, and ``seqs`` counts key rows so (``triton_kernels.attention.row_strides``);
sequence b is batch row b.

On a CUDA tensor the ``triton`` implementation's @triton.jit kernels, and
``cuda_ffi``'s Hopper forward (a C entry of the cuda_ffi library, with the
Triton kernels for the rest), launch natively on torch's stream
(capturable in CUDA graphs); every other implementation runs rlk_jax's own
functions through one jitted JAX call (DLPack). Either way the bits are the
JAX op's: the same kernels with the same tile map, or the same JAX
function.
"""

from __future__ import annotations

import functools

import jax
import torch

from rlk_jax import _attention
from rlk_torch_bridge import (_attention_rows, _dlpack, _library,
                              _sm90_attention, _triton_attention)
from rlk_torch_bridge._checks import platform_of

FORWARD_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor seqs, float scale, "
                  "float? softcap, int? window, int heads_per_tile, "
                  "int split_chunks, bool zero_outside, str? implementation, "
                  "int page=0) -> (Tensor, Tensor)")
BACKWARD_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor seqs, Tensor out, "
                   "Tensor lse, Tensor g, float scale, float? softcap, "
                   "int? window, str implementation) "
                   "-> (Tensor, Tensor, Tensor)")


def settings(q, k, scale, softcap, window, heads_per_tile, split_chunks=0,
             page=0):
  hq, d = q.shape[1:]
  return _settings(hq // k.shape[-2], d, scale, softcap, window,
                   heads_per_tile, split_chunks, page)


@functools.lru_cache(maxsize=256)
def _settings(group, head_dim, scale, softcap, window, heads_per_tile,
              split_chunks, page):
  # (Every layer of a model asks with the same numbers.)
  return _attention.Settings(group, head_dim, scale, softcap, window,
                             heads_per_tile, split_chunks, page=page)


# The implementations whose kernels launch natively on torch's stream: the
# Triton kernels, and the Hopper forward (with the Triton kernels for the
# rest).
KERNEL_ROUTES = ("triton", "cuda_ffi")


@functools.lru_cache(maxsize=64)
def choose(implementation, platform) -> str:
  return _attention.TABLE.select(implementation, platform).name


@functools.partial(jax.jit, static_argnums=(0, 1))
def _jax_forward(impl, settings_, q, k, v, seqs):
  return _attention.TABLE.implementations[impl].fn[0](q, k, v, seqs, settings_)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _jax_backward(impl, settings_, q, k, v, seqs, out, lse, g):
  return _attention.TABLE.implementations[impl].fn[1](
      q, k, v, seqs, settings_, out, lse, g)


def readable_in_place(k, v, implementation) -> bool:
  """Whether the kernels can read these [B, S, Hkv, D] keys and values
  where they lie (the in-place form): a transposed [B, Hkv, S, D] cache,
  such as transformers hands over, is then not copied into rows. Eager
  CUDA calls on the Triton kernels; traced calls keep the rows (Inductor
  lays out what it produces itself)."""
  if (not k.is_cuda or torch.compiler.is_compiling()
      or choose(implementation, "gpu") not in KERNEL_ROUTES):
    return False
  ks, vs = k.stride(), v.stride()
  # Batch rows a whole number of token strides apart, the same for k and v
  # (one sequence table numbers both), and not overlapping (a broadcast
  # batch would have the backward write one row's dk for every sequence).
  return (ks[-1] == 1 and vs[-1] == 1 and ks[1] > 0 and vs[1] > 0
          and ks[0] % ks[1] == 0 and vs[0] % vs[1] == 0
          and ks[0] // ks[1] == vs[0] // vs[1] >= k.shape[1])


def _refuse_in_place(impl, k):
  if _attention_rows.in_place(k):
    raise ValueError(
        "rlk::det_attention: k and v of shape [B, S, Hkv, D] = "
        f"{tuple(k.shape)} are read in place by the Triton kernels on CUDA "
        f"only, not by implementation {impl!r} on {k.device.type}; pass "
        "[Tk, Hkv, D] rows")


def _forward_kernel(q, k, v, seqs, scale, softcap, window, heads_per_tile,
                    split_chunks, zero_outside, implementation, page=0):
  impl = choose(implementation, platform_of(q))
  out, lse = _forward_rows(q, k, v, seqs, scale, softcap, window,
                           heads_per_tile, split_chunks, impl, page)
  if zero_outside:
    # Rows outside every sequence (a pack's spare capacity, padding): 0,
    # lse -inf. The kernels' outputs are fresh: filled in place.
    if q.is_cuda and impl in KERNEL_ROUTES:
      _attention_rows.fill_outside(out, seqs[0], seqs[1], q.shape[0], 0.0)
      _attention_rows.fill_outside(lse, seqs[0], seqs[1], q.shape[0],
                                   float("-inf"))
    else:
      covered = _attention_rows.covered(seqs[0], seqs[1], q.shape[0])
      out = torch.where(covered[:, None, None], out, 0)
      lse = torch.where(covered[:, None], lse, float("-inf"))
  return out, lse


def _forward_rows(q, k, v, seqs, scale, softcap, window, heads_per_tile,
                  split_chunks, impl, page=0):
  """(out, lse) of implementation `impl` (already chosen)."""
  s = settings(q, k, scale, softcap, window, heads_per_tile, split_chunks,
               page)
  if impl == "cuda_ffi" and q.is_cuda and _sm90_attention.takes(q, k, v, s):
    return _sm90_attention.forward(q, k, v, seqs, s)
  if impl in KERNEL_ROUTES and q.is_cuda:
    return _triton_attention.forward(q, k, v, seqs, s, heads_per_tile,
                                     split_chunks, page)
  _refuse_in_place(impl, k)
  return _dlpack.through_jax("det_attention", impl,
                             functools.partial(_jax_forward, impl, s),
                             q, k, v, seqs)


def _forward_fake(q, k, v, seqs, scale, softcap, window, heads_per_tile,
                  split_chunks, zero_outside, implementation, page=0):
  return (torch.empty_like(q),
          q.new_empty(q.shape[:2], dtype=torch.float32))


def _backward_kernel(q, k, v, seqs, out, lse, g, scale, softcap, window,
                     implementation):
  s = settings(q, k, scale, softcap, window, 1)
  if implementation in KERNEL_ROUTES and q.is_cuda:
    hopper = (implementation == "cuda_ffi"
              and _sm90_attention.takes(q, k, v, s))
    return _triton_attention.backward(
        q, k, v, seqs, out, lse, g, s,
        hopper_dkdv=_sm90_attention.dkdv if hopper else None)
  _refuse_in_place(implementation, k)
  return _dlpack.through_jax("det_attention", implementation,
                             functools.partial(_jax_backward, implementation,
                                               s),
                             q, k, v, seqs, out, lse, g)


def _backward_fake(q, k, v, seqs, out, lse, g, scale, softcap, window,
                   implementation):
  return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class DetAttention(torch.autograd.Function):

  @staticmethod
  def forward(ctx, q, k, v, seqs, scale, softcap, window, heads_per_tile,
              split_chunks, zero_outside, implementation, page=0):
    impl = choose(implementation, platform_of(q))
    out, lse = _library.below_autograd(
        FORWARD, q, k, v, seqs, scale, softcap, window, heads_per_tile,
        split_chunks, zero_outside, impl, page)
    ctx.page = page
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, seqs, out, lse)
    ctx.static = (scale, softcap, window, impl)
    return out, lse

  @staticmethod
  @torch.autograd.function.once_differentiable
  def backward(ctx, g, _):
    if ctx.page:
      raise NotImplementedError(_attention.PAGED_NO_GRADIENT)
    q, k, v, seqs, out, lse = ctx.saved_tensors
    g = torch.zeros_like(out) if g is None else g.to(q.dtype).contiguous()
    dq, dk, dv = _library.below_autograd(BACKWARD, q, k, v, seqs, out, lse, g,
                                         *ctx.static)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


FORWARD = _library.define("det_attention", FORWARD_SCHEMA, _forward_kernel,
                          _forward_fake, DetAttention,
                          _library.first_args_need_grad(3))
BACKWARD = _library.define("det_attention_backward", BACKWARD_SCHEMA,
                           _backward_kernel, _backward_fake)
