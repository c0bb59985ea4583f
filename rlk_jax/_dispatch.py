"""The implementations table every rlk op dispatches through.

An op names its implementations once, each with an availability probe, and a
preference order per platform. ``implementation=None`` picks the first
available one in that order, deterministically; the choice is queryable
(:func:`selected_implementation`). A *named* implementation that is not
available raises: it never silently falls back, because for det_gemm a silent
switch changes bits, which defeats the op.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Mapping, Sequence

import jax

# A probe returns None when the implementation can run on `platform`,
# otherwise a sentence saying why not.
Probe = Callable[[str], "str | None"]


# An operand check returns None when the implementation takes this call's
# operands (shapes, dtypes), otherwise why not.
OperandCheck = Callable[..., "str | None"]


@dataclasses.dataclass(frozen=True)
class Implementation:
  name: str
  fn: Callable
  probe: Probe
  doc: str = ""
  operand_check: OperandCheck | None = None

  def operand_reason(self, operands) -> str | None:
    if operands is None or self.operand_check is None:
      return None
    return self.operand_check(*operands)


@dataclasses.dataclass(frozen=True)
class OpTable:
  op: str
  implementations: Mapping[str, Implementation]
  # platform ("cpu", "gpu", ...) -> names in order of preference.
  preference: Mapping[str, Sequence[str]]
  default_preference: Sequence[str] = ("xla",)

  def unavailable_reason(self, name: str, platform: str) -> str | None:
    return self.implementations[name].probe(platform)

  def select(self, implementation: str | None, platform: str | None = None,
             operands: tuple | None = None,
             passing_over: tuple = ()) -> Implementation:
    """The implementation a call runs. `operands` (the op's own description
    of this call) lets an implementation that takes only some shapes or
    dtypes decline: ``None`` then moves on to the next preference, a named
    one raises with the reason. `passing_over`: names ``None`` does not
    consider (the next choice after them)."""
    platform = platform or current_platform()
    if implementation is not None:
      if implementation not in self.implementations:
        raise ValueError(
            f"rlk_jax.{self.op}: unknown implementation {implementation!r}; "
            f"choose one of {sorted(self.implementations)} or None.")
      reason = self.unavailable_reason(implementation, platform)
      if reason is not None:
        raise RuntimeError(
            f"rlk_jax.{self.op}: implementation {implementation!r} is not "
            f"available on platform {platform!r}: {reason}")
      chosen = self.implementations[implementation]
      reason = chosen.operand_reason(operands)
      if reason is not None:
        raise ValueError(f"rlk_jax.{self.op}: implementation "
                         f"{implementation!r} cannot take these operands: "
                         f"{reason}")
      return chosen
    order = [name for name in self.preference.get(
        platform, self.default_preference) if name not in passing_over]
    for name in order:
      if (self.unavailable_reason(name, platform) is None
          and self.implementations[name].operand_reason(operands) is None):
        return self.implementations[name]
    raise RuntimeError(
        f"rlk_jax.{self.op}: no implementation is available on platform "
        f"{platform!r}: " + "; ".join(
            f"{n}: {self.unavailable_reason(n, platform)}" for n in order))


_TABLES: dict[str, OpTable] = {}
# The module that registers each op's table, imported on first query.
_OP_MODULES = {"pack": "rlk_jax._pack", "det_gemm": "rlk_jax._det_gemm",
               "linear_logp": "rlk_jax._linear_logp",
               "det_attention": "rlk_jax._attention"}


def register(table: OpTable) -> OpTable:
  _TABLES[table.op] = table
  return table


def current_platform() -> str:
  return jax.default_backend()


def register_reference_and_pallas(op: str, *, reference: Callable,
                                  reference_doc: str, pallas: Callable,
                                  pallas_doc: str,
                                  gpu_first: Sequence[Implementation] = ()
                                  ) -> OpTable:
  """The table every rlk op has: ``"xla"``, the plain-jnp reference (runs
  anywhere; the CPU default), and ``"pallas"``, a kernel through Pallas's
  Triton lowering that runs through the Pallas interpreter on CPUs; plus
  `gpu_first`, preferred over both on GPUs where available, in order (the
  SM90 kernels, then the @triton.jit kernels through jax-triton). JAX 0.11
  deprecated Pallas's Triton lowering, so on a GPU ``"pallas"`` runs only
  where nothing before it can: named, or without jax-triton.

  `pallas` takes the op's arguments plus ``interpret=``, decided here at
  trace time from the platform.
  """
  # Imported here: pallas_kernels is the kernels' package, and only the
  # table needs to know where their lowering runs.
  from pallas_kernels import triton_backend

  def run_pallas(*args):
    return pallas(*args, interpret=current_platform() == "cpu")

  return register(OpTable(
      op=op,
      implementations={
          "xla": Implementation("xla", reference, lambda platform: None,
                                reference_doc),
          "pallas": Implementation("pallas", run_pallas,
                                   triton_backend.unavailable_reason,
                                   pallas_doc),
          **{impl.name: impl for impl in gpu_first},
      },
      preference={"cpu": ("xla",),
                  "gpu": (*(impl.name for impl in gpu_first), "pallas",
                          "xla")},
  ))


def implementations(op: str, platform: str | None = None
                    ) -> dict[str, str | None]:
  """Maps each implementation of `op` to None (available) or why it is not."""
  table = _table(op)
  platform = platform or current_platform()
  return {name: table.unavailable_reason(name, platform)
          for name in table.implementations}


def selected_implementation(op: str, implementation: str | None = None,
                            platform: str | None = None) -> str:
  """The name of the implementation a call of `op` would use on `platform`
  (default: JAX's default backend), for operands every implementation takes.
  (det_gemm passes over ``cuda_ffi`` for operands it cannot take: see
  ``rlk_jax.det_gemm``'s docstring.)"""
  return _table(op).select(implementation, platform).name


def _table(op: str) -> OpTable:
  if op not in _TABLES and op in _OP_MODULES:
    importlib.import_module(_OP_MODULES[op])
  try:
    return _TABLES[op]
  except KeyError:
    raise ValueError(
        f"rlk_jax: unknown op {op!r}; known ops: {sorted(_TABLES)}") from None
