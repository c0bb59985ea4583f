"""Argument checks shared by the ops: clear errors naming shapes and dtypes."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

# Dtypes whose rows pack/unpack move. Complex and the float8 family are not
# supported yet: they are rejected by name rather than moved by a guess.
PACKABLE_DTYPES = tuple(jnp.dtype(d) for d in (
    jnp.bool_, jnp.int8, jnp.int16, jnp.int32, jnp.int64,
    jnp.uint8, jnp.uint16, jnp.uint32, jnp.uint64,
    jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))


def check_packable_dtype(op: str, name: str, dtype) -> jnp.dtype:
  dtype = jnp.dtype(dtype)
  if dtype not in PACKABLE_DTYPES:
    raise TypeError(
        f"rlk_jax.{op}: {name} has unsupported dtype {dtype}; supported: "
        + ", ".join(str(d) for d in PACKABLE_DTYPES))
  return dtype


def check_mask_dtype(op: str, dtype) -> jnp.dtype:
  dtype = jnp.dtype(dtype)
  if not (dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.number)):
    raise TypeError(f"rlk_jax.{op}: mask has unsupported dtype {dtype}; use "
                    "bool or a numeric dtype (nonzero means active).")
  return dtype


def static_fill(op: str, name: str, fill, dtype: jnp.dtype):
  """`fill` as a Python scalar exactly representable in `dtype`.

  The fill is baked into the kernel, so it must be static; an int dtype must
  not silently round a fractional or out-of-range fill.
  """
  if isinstance(fill, jax.Array) or not isinstance(fill, (numbers.Number, np.generic)):
    raise TypeError(f"rlk_jax.{op}: {name} must be a static Python scalar, "
                    f"got {type(fill).__name__}.")
  if dtype == jnp.bool_:
    if fill not in (0, 1):
      raise ValueError(f"rlk_jax.{op}: {name}={fill!r} is not a bool value.")
    return bool(fill)
  if jnp.issubdtype(dtype, jnp.integer):
    info = jnp.iinfo(dtype)
    if (isinstance(fill, (complex, np.complexfloating))
        or not float(fill).is_integer() or not info.min <= fill <= info.max):
      raise ValueError(f"rlk_jax.{op}: {name}={fill!r} is not representable "
                       f"in {dtype} (range [{info.min}, {info.max}]).")
    return int(fill)
  if isinstance(fill, (complex, np.complexfloating)):
    raise ValueError(f"rlk_jax.{op}: {name}={fill!r} is complex; {dtype} is real.")
  return float(fill)


def static_capacity(op: str, capacity, default: int) -> int:
  if capacity is None:
    return default
  if isinstance(capacity, (bool, np.bool_)) or not isinstance(
      capacity, (numbers.Integral, np.integer)):
    raise TypeError(f"rlk_jax.{op}: capacity must be a static int, got "
                    f"{capacity!r} of type {type(capacity).__name__}.")
  capacity = int(capacity)
  if capacity < 0:
    raise ValueError(f"rlk_jax.{op}: capacity must be >= 0, got {capacity}.")
  if capacity >= 2**31:
    raise ValueError(f"rlk_jax.{op}: capacity {capacity} does not fit the "
                     "int32 index maps (must be < 2**31).")
  return capacity


def is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)
