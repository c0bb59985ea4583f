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
from rlk_torch_bridge import _library
from rlk_torch_bridge._checks import platform_of
from rlk_torch_bridge._dlpack import to_jax_all, to_torch_all

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
  return _attention.Settings(hq // k.shape[-2], d, scale, softcap, window,
                             heads_per_tile, split_chunks, page=page)


# The implementations whose kernels launch natively on torch's stream: the
# Triton kernels, and the Hopper forward (with the Triton kernels for the
# rest).
KERNEL_ROUTES = ("triton", "cuda_ffi")


@functools.lru_cache(maxsize=64)
def choose(implementation, platform) -> str:
  return _attention.TABLE.select(implementation, platform).name


def _tile_map(lengths, rows_per_tile, n_tiles):
  """rlk_jax._attention._tile_map in torch (the same ints): on CUDA one
  Triton kernel, elsewhere (and for very many sequences) torch's ops."""
  from triton_kernels import attention as kernels
  from triton_kernels import backend
  if (lengths.is_cuda and backend.triton is not None
      and lengths.shape[0] <= kernels.TILE_MAP_MAX_SEQS):
    return kernels.tile_map_torch(lengths.contiguous(), rows_per_tile, n_tiles)
  return _tile_map_ops(lengths, rows_per_tile, n_tiles)


def _tile_map_ops(lengths, rows_per_tile, n_tiles):
  per_seq = (lengths + rows_per_tile - 1) // rows_per_tile
  ends = torch.cumsum(per_seq, 0, dtype=torch.int32)
  t = torch.arange(n_tiles, dtype=torch.int32, device=lengths.device)
  seq = torch.searchsorted(ends, t, right=True).to(torch.int32)
  valid = seq < lengths.shape[0]
  seq_c = seq.clamp(max=lengths.shape[0] - 1).long()
  first = (t - (ends[seq_c] - per_seq[seq_c])) * rows_per_tile
  return torch.stack([torch.where(valid, seq, -1),
                      torch.where(valid, first, 0)]).to(torch.int32)


_STATIC: dict = {}


def static_rows(device, specs):
  """int32 tensors that depend on shapes alone (("arange", n, step): 0,
  step, 2 step...; ("full", n, value); ("tiles", b, per_seq, rows): a
  uniform tile map), made once per device: a decode step's bookkeeping
  then launches no kernels of its own. Not kept while a CUDA graph is
  being captured (its memory would belong to the graph)."""
  out = []
  capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
  for spec in specs:
    key = (str(device), spec)
    t = _STATIC.get(key)
    if t is None:
      kind, *args = spec
      if kind == "arange":
        t = torch.arange(args[0], dtype=torch.int32, device=device) * args[1]
      elif kind == "full":
        t = torch.full((args[0],), args[1], dtype=torch.int32, device=device)
      else:  # tiles: sequence b's tiles in order, `rows` query rows each
        b, per_seq, rows = args
        t = torch.arange(b * per_seq, dtype=torch.int32, device=device)
        t = torch.stack([t // per_seq, (t % per_seq) * rows]).to(torch.int32)
      if not capturing and len(_STATIC) < 4096:
        _STATIC[key] = t
    out.append(t)
  return out


def decode_tiles(device, b: int, n: int, tokens: int):
  """A KV-cache call's tile map (`tokens` query rows a tile): every
  sequence has the same `n` q rows, so it is a function of shapes (the same
  ints as _tile_map's), made once."""
  tiles, = static_rows(device, (("tiles", b, -(-n // tokens), tokens),))
  return tiles


def _covered(starts, lengths, n):
  """rlk_jax._attention.covered_rows in torch."""
  edges = torch.zeros((n + 1,), dtype=torch.int32, device=starts.device)
  edges.index_add_(0, starts.clamp(0, n).long(), torch.ones_like(starts))
  edges.index_add_(0, (starts + lengths).clamp(0, n).long(),
                   -torch.ones_like(starts))
  return torch.cumsum(edges, 0)[:n] > 0


@functools.partial(jax.jit, static_argnums=(0, 1))
def _jax_forward(impl, settings_, q, k, v, seqs):
  return _attention.TABLE.implementations[impl].fn[0](q, k, v, seqs, settings_)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _jax_backward(impl, settings_, q, k, v, seqs, out, lse, g):
  return _attention.TABLE.implementations[impl].fn[1](
      q, k, v, seqs, settings_, out, lse, g)


def in_place(k) -> bool:
  """Whether k (or v) is the ``[B, S, Hkv, D]`` form read in place."""
  return k.ndim == 4


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
  if in_place(k):
    raise ValueError(
        "rlk::det_attention: k and v of shape [B, S, Hkv, D] = "
        f"{tuple(k.shape)} are read in place by the Triton kernels on CUDA "
        f"only, not by implementation {impl!r} on {k.device.type}; pass "
        "[Tk, Hkv, D] rows")


def _fill_outside(x, starts, lengths, n_rows, value):
  """x's rows in no sequence ([starts, starts + lengths)) set to `value`,
  in place; x is rows ([T, H, D] or [T, H]) or [B, S, H, D] read in place
  (`n_rows` rows as the kernels number them). On CUDA one Triton kernel
  writes only those rows (rather than a pass over all of x); elsewhere
  torch's ops."""
  from triton_kernels import attention as kernels
  if x.is_cuda and starts.shape[0] <= kernels.TILE_MAP_MAX_SEQS:
    return kernels.fill_outside_torch(x, starts, lengths, n_rows, value)
  if not in_place(x):
    covered = _covered(starts, lengths, n_rows)
    return x.masked_fill_(~covered.view((-1,) + (1,) * (x.ndim - 1)), value)
  b, s = x.shape[:2]
  first = starts - torch.arange(b, dtype=torch.int32, device=x.device) * (
      x.stride(0) // x.stride(1))
  t = torch.arange(s, device=x.device)[None]
  covered = (t >= first[:, None]) & (t < (first + lengths)[:, None])
  return x.masked_fill_(~covered[:, :, None, None], value)


def _forward_kernel(q, k, v, seqs, scale, softcap, window, heads_per_tile,
                    split_chunks, zero_outside, implementation, page=0):
  impl = choose(implementation, platform_of(q))
  out, lse = _forward_rows(q, k, v, seqs, scale, softcap, window,
                           heads_per_tile, split_chunks, impl, page)
  if zero_outside:
    # Rows outside every sequence (a pack's spare capacity, padding): 0,
    # lse -inf. The kernels' outputs are fresh: filled in place.
    if q.is_cuda and impl in KERNEL_ROUTES:
      _fill_outside(out, seqs[0], seqs[1], q.shape[0], 0.0)
      _fill_outside(lse, seqs[0], seqs[1], q.shape[0], float("-inf"))
    else:
      covered = _covered(seqs[0], seqs[1], q.shape[0])
      out = torch.where(covered[:, None, None], out, 0)
      lse = torch.where(covered[:, None], lse, float("-inf"))
  return out, lse


def _forward_rows(q, k, v, seqs, scale, softcap, window, heads_per_tile,
                  split_chunks, impl, page=0):
  """(out, lse) of implementation `impl` (already chosen)."""
  s = settings(q, k, scale, softcap, window, heads_per_tile, split_chunks,
               page)
  if (impl == "cuda_ffi" and q.is_cuda
      and _attention.sm90_takes(s, _jax_dtype(q.dtype))
      and _tma_aligned(q, k, v)):
    return _sm90_forward(q, k, v, seqs, s)
  if impl in KERNEL_ROUTES and q.is_cuda:
    from triton_kernels import attention as kernels
    config = kernels.config_for(s.head_dim)
    tokens = config.tile_rows(bool(split_chunks)) // heads_per_tile
    if split_chunks:
      b = seqs.shape[1]
      tiles = decode_tiles(q.device, b, q.shape[0] // b, tokens)
    else:
      tiles = _tile_map(seqs[1], tokens, kernels.tile_bound(
          q.shape[0], seqs.shape[1], tokens))
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    kernels.forward_torch(q, k, v, seqs, tiles, out, lse,
                          _attention._statics(s), config, heads_per_tile,
                          split_chunks, page)
    return out, lse
  _refuse_in_place(impl, k)
  _library.refuse_capture("det_attention", impl, q.device)
  out, lse = _jax_forward(impl, s, *to_jax_all(q, k, v, seqs,
                                               one_computation=True))
  return to_torch_all(out, lse)


def _jax_dtype(dtype):
  return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(
      dtype, "float32")


def _tma_aligned(*tensors) -> bool:
  """Whether the Hopper forward's TMA can read these rows: 16-byte aligned
  addresses and token and head strides (a view that is not runs the Triton
  kernels: the same bits)."""
  return all(t.data_ptr() % 16 == 0 and t.stride(-3) % 8 == 0
             and t.stride(-2) % 8 == 0 for t in tensors)


def _key_rows(k) -> int:
  """How many rows the kernels may address in k: [Tk, Hkv, D] rows, or a
  [B, S, Hkv, D] view read in place (batch row b's token t is row b *
  stride(0) / stride(1) + t)."""
  if not in_place(k):
    return k.shape[0]
  return (k.shape[0] - 1) * (k.stride(0) // k.stride(1)) + k.shape[1]


def _key_tokens(k) -> int:
  """How many key tokens k holds ([Tk, Hkv, D] or [B, S, Hkv, D]): what
  bounds the key tiles its sequences need."""
  return k.numel() // k.shape[-1] // k.shape[-2]


def _sm90_forward(q, k, v, seqs, s):
  import cuda_ffi
  from triton_kernels import attention as kernels
  rows = cuda_ffi.ATTENTION_TILE_ROWS
  tiles = _tile_map(seqs[1], rows, kernels.tile_bound(q.shape[0],
                                                      seqs.shape[1], rows))
  out = torch.empty_like(q)
  lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
  cuda_ffi.launch_attention_forward(
      torch.cuda.current_stream(q.device).cuda_stream, q, k, v, seqs, tiles,
      out, lse, k_rows=_key_rows(k),
      scale2=_attention._statics(s).constants()["scale2"], window=s.window,
      half=q.dtype == torch.float16)
  return out, lse


def _forward_fake(q, k, v, seqs, scale, softcap, window, heads_per_tile,
                  split_chunks, zero_outside, implementation, page=0):
  return (torch.empty_like(q),
          q.new_empty(q.shape[:2], dtype=torch.float32))


def _backward_kernel(q, k, v, seqs, out, lse, g, scale, softcap, window,
                     implementation):
  s = settings(q, k, scale, softcap, window, 1)
  if implementation in KERNEL_ROUTES and q.is_cuda:
    from triton_kernels import attention as kernels
    config = kernels.config_for(s.head_dim)
    statics = _attention._statics(s)
    g = g.contiguous()
    dq_rows = config.dq_tiles()[0]
    q_tiles = _tile_map(seqs[1], dq_rows, kernels.tile_bound(
        q.shape[0], seqs.shape[1], dq_rows))
    # dk and dv number their rows as k and v do (seqs counts them so).
    like = lambda x: torch.empty_strided(x.shape, x.stride(), dtype=x.dtype,
                                         device=x.device)
    dq, dk, dv = torch.empty_like(q), like(k), like(v)
    if (implementation == "cuda_ffi"
        and _attention.sm90_takes(s, _jax_dtype(q.dtype))
        and _tma_aligned(q, k, v)):
      delta = kernels.delta_torch(out, g)
      _sm90_dkdv(q, k, v, seqs, lse, g, delta, dk, dv, s)
      kernels.dq_torch(q, k, v, g, lse, delta, seqs, q_tiles, dq, statics,
                       config)
    else:
      k_tiles = _tile_map(seqs[3], config.bwd_block_n, kernels.tile_bound(
          _key_tokens(k), seqs.shape[1], config.bwd_block_n))
      kernels.backward_torch(q, k, v, out, lse, g, seqs, q_tiles, k_tiles,
                             dq, dk, dv, statics, config)
    # Rows outside every sequence are left unwritten by the kernels.
    k_rows = _key_rows(k)
    return (_fill_outside(dq, seqs[0], seqs[1], q.shape[0], 0.0),
            _fill_outside(dk, seqs[2], seqs[3], k_rows, 0.0),
            _fill_outside(dv, seqs[2], seqs[3], k_rows, 0.0))
  _refuse_in_place(implementation, k)
  _library.refuse_capture("det_attention", implementation, q.device)
  grads = _jax_backward(implementation, s, *to_jax_all(
      q, k, v, seqs, out, lse, g, one_computation=True))
  return to_torch_all(*grads)


def _sm90_dkdv(q, k, v, seqs, lse, g, delta, dk, dv, s):
  """The Hopper dK/dV kernel (the Triton dK/dV kernel's bits) into dk, dv."""
  import cuda_ffi
  from triton_kernels import attention as kernels
  keys = cuda_ffi.ATTENTION_DKDV_TILE_KEYS
  tiles = _tile_map(seqs[3], keys, kernels.tile_bound(
      _key_tokens(k), seqs.shape[1], keys))
  cuda_ffi.launch_attention_dkdv(
      torch.cuda.current_stream(q.device).cuda_stream, q, k, v, g, lse,
      delta, seqs, tiles, dk, dv, k_rows=_key_rows(k), scale=s.scale,
      scale2=_attention._statics(s).constants()["scale2"], window=s.window,
      half=q.dtype == torch.float16)


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


def _differentiable(q, k, v, *_):
  return _library.needs_grad(q, k, v)


FORWARD = _library.define("det_attention", FORWARD_SCHEMA, _forward_kernel,
                          _forward_fake, DetAttention, _differentiable)
BACKWARD = _library.define("det_attention_backward", BACKWARD_SCHEMA,
                           _backward_kernel, _backward_fake)
