"""The implementations table: deterministic choice, no silent fallback."""

import pytest

import rlk_jax
from rlk_jax import _dispatch
from rlk_jax._pack import TABLE


def test_default_choice_is_queryable_and_deterministic():
  assert rlk_jax.selected_implementation("pack", platform="cpu") == "xla"
  # On GPUs: the CUDA kernels where the SM90 library runs, else the
  # jax-triton kernel, else Pallas's (deprecated Triton lowering).
  on_gpu = rlk_jax.implementations("pack", platform="gpu")
  assert rlk_jax.selected_implementation("pack", platform="gpu") == next(
      name for name in ("cuda_ffi", "triton", "pallas") if on_gpu[name] is None)
  assert rlk_jax.selected_implementation("pack", "pallas", platform="cpu") == "pallas"
  on_cpu = rlk_jax.implementations("pack", platform="cpu")
  assert on_cpu["xla"] is None and on_cpu["pallas"] is None
  assert "needs a CUDA GPU" in on_cpu["cuda_ffi"]


def test_named_unavailable_implementation_raises():
  reason = rlk_jax.implementations("pack", platform="tpu")["pallas"]
  assert reason and "tpu" in reason
  with pytest.raises(RuntimeError, match="'pallas' is not available on platform 'tpu'"):
    TABLE.select("pallas", platform="tpu")
  # With no name, the next available one is chosen, and the choice is visible.
  assert TABLE.select(None, platform="tpu").name == "xla"


def test_no_available_implementation_raises():
  table = _dispatch.OpTable(
      op="nothing",
      implementations={"a": _dispatch.Implementation("a", None, lambda p: "never")},
      preference={}, default_preference=("a",))
  with pytest.raises(RuntimeError, match="no implementation is available.*a: never"):
    table.select(None, platform="cpu")


def test_unknown_op():
  with pytest.raises(ValueError, match="unknown op 'nope'"):
    rlk_jax.selected_implementation("nope")
