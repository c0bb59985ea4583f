"""JAX's launch of the ``@triton.jit`` kernels: ``triton_call``, jax-triton's
call with its signature, launched through rlk's XLA FFI handler where the
cuda_ffi library is loaded, else through jax-triton.

Why a second launcher: jax-triton's custom call is a legacy one (API version
2), which XLA cannot capture into a command buffer, so every call cuts the
program's CUDA graph and adds a host launch. A decode step with one
attention call per layer ran as 9 graphs where plain XLA ran 1, and the
step is host-bound (H100, 2026-11-28). rlk's handler (``cuda_ffi/csrc/
triton_launch.cc``) launches the same kind of binary from a typed FFI call
that declares itself capturable.

The kernel is compiled as jax-triton compiles it: the arrays are its first
parameters (inputs, then outputs), each pointer 16-byte aligned (XLA's
buffers are); every keyword is a compile-time constant; the same options.
Triton's own compiler makes the cubin (and keeps it in Triton's file
cache), so the program that runs is the torch route's kind of binary; the
GPU tests hold the two JAX launchers to the same bits.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect

import numpy as np

from triton_kernels.backend import jax_triton, triton

# Triton's pointer type names by the dtype a JAX array carries.
_POINTER_TYPES = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16",
                  "float64": "*fp64", "int8": "*i8", "int16": "*i16",
                  "int32": "*i32", "int64": "*i64", "uint8": "*u8",
                  "uint16": "*u16", "uint32": "*u32", "uint64": "*u64",
                  "bool": "*i1"}


@dataclasses.dataclass(frozen=True)
class Compiled:
  """What the FFI handler needs of one compiled kernel."""
  cubin: bytes
  name: str
  kernel_id: int          # a digest of the cubin: the handler's cache key
  num_warps: int
  shared_bytes: int
  trailing_pointers: int  # the scratch pointers Triton appends (null here)


def launcher_reason() -> str | None:
  """Why JAX's Triton calls cannot go through rlk's FFI handler (None: they
  do). Not waiting for a build: the two launchers run the same kernels."""
  import cuda_ffi
  return cuda_ffi.unavailable_reason("gpu", wait=False)


def _pointer_type(dtype) -> str | None:
  """Triton's pointer type of an array of `dtype` (None: none here)."""
  return _POINTER_TYPES.get(np.dtype(dtype).name)


@functools.lru_cache(maxsize=512)
def compile_kernel(kernel, pointer_types: tuple, constexprs: tuple,
                   num_warps: int, num_stages: int, capability: int,
                   enable_fp_fusion: bool = True) -> Compiled | None:
  """Compiles `kernel` for `capability` (90: sm_90a) with its first
  parameters the pointers of `pointer_types` and `constexprs` ((name,
  value) pairs) compile-time constants; None when the result needs what the handler
  does not give (scratch memory, clusters, cooperative or dependent
  launches)."""
  from triton.backends.compiler import GPUTarget
  from triton.backends.nvidia.compiler import CUDABackend
  from triton.compiler import ASTSource
  names = list(kernel.arg_names)
  pointers = names[:len(pointer_types)]
  # A parameter not given takes its default; one without a default is left
  # out of the signature, as jax-triton leaves it (Triton binds it to None:
  # the JAX routes never passed `INTERPRETED`).
  defaults = {p.name: p.default
              for p in inspect.signature(kernel.fn).parameters.values()
              if p.default is not inspect.Parameter.empty}
  constants = {n: defaults[n] for n in names[len(pointer_types):]
               if n in defaults}
  constants.update(constexprs)
  clash = [n for n in pointers if n in constants]
  if clash or len(pointers) < len(pointer_types):
    raise TypeError(
        f"triton_call: {kernel.__name__} takes its {len(pointer_types)} "
        f"arrays as its first parameters; {clash} given as keywords too")
  target = GPUTarget("cuda", capability, 32)
  backend = CUDABackend(target)
  signature = dict(zip(pointers, pointer_types))
  signature.update({n: "constexpr" for n in constants})
  attrs = {(i,): backend.parse_attr("D") for i in range(len(pointers))}
  compiled = triton.compile(
      ASTSource(kernel, signature, constexprs=constants, attrs=attrs),
      target=target,
      options=dict(num_warps=num_warps, num_stages=num_stages, num_ctas=1,
                   enable_fp_fusion=enable_fp_fusion))
  md = compiled.metadata
  if (getattr(md, "global_scratch_size", 0)
      or getattr(md, "profile_scratch_size", 0)
      or getattr(md, "launch_cooperative_grid", False)
      or getattr(md, "launch_pdl", False)
      or tuple(getattr(md, "cluster_dims", (1, 1, 1))) not in ((1, 1, 1), ())):
    return None
  trailing = (("global_scratch_size" in md._fields)
              + ("profile_scratch_size" in md._fields))
  cubin = compiled.asm["cubin"]
  digest = hashlib.sha256(cubin + md.name.encode()).digest()
  return Compiled(cubin=cubin, name=md.name,
                  kernel_id=int.from_bytes(digest[:8], "little", signed=True),
                  num_warps=md.num_warps, shared_bytes=md.shared,
                  trailing_pointers=trailing)


def _grid3(grid) -> tuple[int, int, int]:
  grid = tuple(int(g) for g in (grid if isinstance(grid, tuple) else
                                (grid,)))
  if not 1 <= len(grid) <= 3:
    raise ValueError(f"triton_call: a grid has 1 to 3 dims, got {grid}")
  return grid + (1,) * (3 - len(grid))


def _device_capability() -> int:
  import jax
  major, minor = jax.devices("gpu")[0].compute_capability.split(".")
  return int(major) * 10 + int(minor)


def ffi_triton_call(*arrays, kernel, out_shape, grid, name: str = "",
                    num_warps: int = 4, num_stages: int = 3,
                    input_output_aliases=None, capability: int | None = None,
                    **constexprs):
  """The call through rlk's FFI handler (`capability`: the device's, by
  default), or None where the compiled kernel needs what the handler does
  not give or an array's dtype has no pointer type here."""
  import jax
  import cuda_ffi
  single = not isinstance(out_shape, (tuple, list))
  outs = (out_shape,) if single else tuple(out_shape)
  pointer_types = tuple(_pointer_type(a.dtype) for a in (*arrays, *outs))
  if None in pointer_types:  # a dtype this launcher does not map
    return None
  compiled = compile_kernel(
      kernel, pointer_types, tuple(sorted(constexprs.items())), num_warps,
      num_stages, capability or _device_capability())
  if compiled is None:
    return None
  del name  # jax-triton's label; the compiled kernel carries its own name
  call = jax.ffi.ffi_call(
      cuda_ffi.TRITON_LAUNCH_TARGET, outs,
      input_output_aliases=dict(input_output_aliases or {}))
  results = call(*arrays, cubin=np.frombuffer(compiled.cubin, np.uint8),
                 name=compiled.name, kernel_id=np.int64(compiled.kernel_id),
                 grid=np.asarray(_grid3(grid), np.int64),
                 num_warps=np.int64(compiled.num_warps),
                 shared_bytes=np.int64(compiled.shared_bytes),
                 trailing_pointers=np.int64(compiled.trailing_pointers))
  return results[0] if single else tuple(results)


def triton_call(*arrays, kernel, out_shape, grid, name: str = "",
                num_warps: int = 4, num_stages: int = 3,
                input_output_aliases=None, **constexprs):
  """jax-triton's ``triton_call`` for rlk's kernels (arrays positional,
  every other parameter a keyword constant), through rlk's FFI handler
  where it is loaded."""
  if launcher_reason() is None:
    out = ffi_triton_call(*arrays, kernel=kernel, out_shape=out_shape,
                          grid=grid, name=name, num_warps=num_warps,
                          num_stages=num_stages,
                          input_output_aliases=input_output_aliases,
                          **constexprs)
    if out is not None:
      return out
  return jax_triton().triton_call(
      *arrays, kernel=kernel, out_shape=out_shape, grid=grid, name=name,
      num_warps=num_warps, num_stages=num_stages,
      input_output_aliases=input_output_aliases or {}, **constexprs)
