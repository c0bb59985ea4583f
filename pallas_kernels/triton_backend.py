"""The Pallas Triton lowering: its import, probed once, and where it runs.

JAX deprecated this backend in 0.11 (it warns, and still works on 0.11.2), so
its presence is probed rather than assumed.
"""

from __future__ import annotations

try:
  from jax.experimental.pallas import triton as pltriton
  IMPORT_ERROR: str | None = None
except ImportError as e:  # pragma: no cover - depends on the installed jax
  pltriton = None
  IMPORT_ERROR = f"jax.experimental.pallas.triton cannot be imported ({e})"


def unavailable_reason(platform: str) -> str | None:
  """None if kernels of this backend run on `platform` ("cpu": through the
  Pallas interpreter), else why not."""
  if IMPORT_ERROR:
    return IMPORT_ERROR
  if platform in ("gpu", "cuda", "rocm", "cpu"):
    return None
  return f"the Triton lowering does not target {platform!r}"
