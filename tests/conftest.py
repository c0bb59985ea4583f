"""Shared test fixtures: fresh random inputs, bitwise comparison, impl params."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ON_GPU = jax.default_backend() == "gpu"
# Without a GPU, rlk's @triton.jit kernels run in Triton's interpreter (set
# before anything imports triton_kernels: triton.jit reads it when the
# kernel is defined).
if not ON_GPU:
  os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def rng(request):
  """A fresh generator per test; the seed is printed so a failure reproduces.

  Set RLK_TEST_SEED to replay one.
  """
  seed = int(os.environ.get("RLK_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
  print(f"[{request.node.name}] RLK_TEST_SEED={seed}")
  return np.random.default_rng(seed)


# Both implementations run everywhere: on the CPU the Pallas kernel runs in
# the interpreter, on a GPU through the Triton lowering.
IMPLEMENTATIONS = ("xla", "pallas")


@pytest.fixture(params=IMPLEMENTATIONS)
def impl(request):
  return request.param


def pack_implementations() -> tuple:
  """pack's implementations that run here: on an SM90 GPU with the library
  also its CUDA kernels (the torch bridge's direct route), on a GPU with
  jax-triton the Triton row gather."""
  import rlk_jax
  available = rlk_jax.implementations("pack")
  return IMPLEMENTATIONS + tuple(name for name in ("cuda_ffi", "triton")
                                 if available[name] is None)


@pytest.fixture
def public_dlpack_forbidden(monkeypatch):
  """The torch bridge must move tensors through jaxlib's DLPack entry points
  directly (one stream handshake per call), never through the slow public
  per-tensor functions: calling those inside the test fails it."""
  import torch

  from rlk_torch_bridge import _dlpack
  assert _dlpack.FAST_PATH, "this jaxlib lacks the DLPack entry points"

  def forbidden(*args, **kwargs):
    raise AssertionError("the bridge called a public DLPack function")
  monkeypatch.setattr(jax.dlpack, "from_dlpack", forbidden)
  monkeypatch.setattr(torch, "from_dlpack", forbidden)


def bits(a) -> np.ndarray:
  """The bit pattern of an array, for atol = rtol = 0 comparison (NaN-safe)."""
  a = np.asarray(a)
  if a.dtype == np.bool_:
    return a.view(np.uint8)
  return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _float64(a) -> np.ndarray:
  if hasattr(a, "detach"):  # a torch tensor (bf16 has no numpy dtype)
    return a.detach().double().cpu().numpy()
  return np.asarray(a, np.float64)


def relative_error(actual, expected) -> float:
  """``|actual - expected| / |expected|`` (Frobenius norms, in float64) of
  NumPy, JAX or torch arrays."""
  actual, expected = _float64(actual), _float64(expected)
  return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def assert_bitwise_equal(actual, expected, msg=""):
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.shape == expected.shape, f"{msg} shape {actual.shape} != {expected.shape}"
  assert actual.dtype == expected.dtype, f"{msg} dtype {actual.dtype} != {expected.dtype}"
  diff = bits(actual) != bits(expected)
  assert not diff.any(), f"{msg} {int(diff.sum())} of {diff.size} elements differ"


def assert_row_windows_match(gemm, a, b, full, ms, rng, msg=""):
  """For each m in `ms`, a random window of m rows of `a` through `gemm`
  alone gives those rows of `full` (= gemm(a, b)) bit for bit."""
  for m in ms:
    start = int(rng.integers(0, a.shape[0] - m + 1))
    assert_bitwise_equal(gemm(a[start:start + m], b), full[start:start + m],
                         f"{msg} M={m} at row {start}")


def assert_same_gradients(rng, m, k, n, impl, other):
  """det_gemm's dA and dB at ``[m, k] @ [k, n]`` under `impl` and `other`
  (each with whatever config it picks for the three products), bitwise."""
  import functools

  import rlk_jax
  a = random_array(rng, (m, k), jnp.bfloat16)
  b = random_array(rng, (k, n), jnp.bfloat16)
  g = random_array(rng, (m, n), jnp.bfloat16)
  vjp = lambda name: jax.vjp(functools.partial(rlk_jax.det_gemm,
                                               implementation=name), a, b)[1](g)
  (da, db), (o_da, o_db) = vjp(impl), vjp(other)
  assert_bitwise_equal(da, o_da, f"dA {impl} vs {other}")
  assert_bitwise_equal(db, o_db, f"dB {impl} vs {other}")


def dense_logp_grads(logits, targets, g_logp, g_entropy, temperature):
  """float64 (lse, entropy, d loss / d logits) of rows of raw logits, for the
  loss sum(g_logp * logp + g_entropy * entropy); targets outside the row
  pick nothing (pass g_logp already 0 where a target is ignored)."""
  x = np.asarray(logits, np.float64) / temperature
  lse = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) + x.max(1)
  p = np.exp(x - lse[:, None])
  mean = (p * x).sum(1)
  onehot = np.arange(x.shape[1])[None, :] == np.asarray(targets)[:, None]
  g = np.asarray(g_logp, np.float64)[:, None]
  ge = np.asarray(g_entropy, np.float64)[:, None]
  d = g * (onehot - p) - ge * p * (x - mean[:, None])
  return lse, lse - mean, d / temperature


def random_array(rng, shape, dtype):
  """Random values in `dtype`, never all zeros; ints span a wide range."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.bool_:
    return jnp.asarray(rng.random(shape) < 0.5)
  if jnp.issubdtype(dtype, jnp.integer):
    info = jnp.iinfo(dtype)
    lo, hi = max(int(info.min), -(2**31)), min(int(info.max), 2**31 - 1)
    return jnp.asarray(rng.integers(lo, hi, size=shape, endpoint=True).astype(dtype))
  return jnp.asarray((rng.standard_normal(shape) * 3).astype(np.float32)).astype(dtype)


def random_mask(rng, shape, density, kind="bool"):
  active = rng.random(shape) < density
  if kind == "bool":
    return active
  if kind == "int8":  # nonzero values other than 1 must count as active
    return np.where(active, 2, 0).astype(np.int8)
  if kind == "float":
    return np.where(active, rng.uniform(0.1, 5.0, shape), 0.0).astype(np.float32)
  raise ValueError(kind)
