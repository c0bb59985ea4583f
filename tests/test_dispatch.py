"""The implementations table: deterministic choice, no silent fallback."""

import pytest

import rlk_jax
from rlk_jax import _dispatch
from rlk_jax._pack import TABLE


def test_default_choice_is_queryable_and_deterministic():
  assert rlk_jax.selected_implementation("pack", platform="cpu") == "xla"
  assert rlk_jax.selected_implementation("pack", platform="gpu") == "pallas"
  assert rlk_jax.selected_implementation("pack", "pallas", platform="cpu") == "pallas"
  assert rlk_jax.implementations("pack", platform="cpu") == {"xla": None, "pallas": None}


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
