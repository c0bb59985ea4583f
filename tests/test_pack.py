"""rlk_jax.pack / unpack against NumPy's ``x[mask]`` and a loop oracle."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlk_jax
from conftest import (assert_bitwise_equal, pack_implementations,
                      random_array, random_mask)


@pytest.fixture(params=pack_implementations())
def impl(request):
  """Every pack implementation available here (conftest's pair, plus the
  CUDA kernels on an SM90 GPU)."""
  return request.param

HUGE = 3.0e38  # finite in f32; a leak of it shows up at once


def numpy_pack(x, mask, capacity, fill):
  x = np.asarray(x)
  mask = np.asarray(mask)
  rows = x[mask != 0]
  out = np.full((capacity, *x.shape[mask.ndim:]), fill, dtype=x.dtype)
  n = min(len(rows), capacity)
  out[:n] = rows[:n]
  return out


def numpy_unpack(packed, mask, capacity, fill):
  packed = np.asarray(packed)
  mask = np.asarray(mask)
  out = np.full((*mask.shape, *packed.shape[1:]), fill, dtype=packed.dtype)
  where = np.flatnonzero(mask.reshape(-1) != 0)[:capacity]
  out.reshape(mask.size, *packed.shape[1:])[where] = packed[:len(where)]
  return out


def loop_info(mask, capacity):
  """PackInfo's fields written as the plain loops a reader can check by eye."""
  mask = np.asarray(mask)
  n_seq, width = mask.shape[0], math.prod(mask.shape[1:])
  flat = (mask != 0).reshape(n_seq, width)
  seq_lens, gather, segment, position = [], [], [], []
  for s in range(n_seq):
    count = 0
    for j in range(width):
      if flat[s, j]:
        gather.append(s * width + j)
        segment.append(s)
        position.append(count)
        count += 1
    seq_lens.append(count)
  total = len(gather)
  scatter = np.full(mask.size, -1, np.int64)
  for r, p in enumerate(gather[:capacity]):
    scatter[p] = r
  pad = capacity - min(total, capacity)
  return dict(
      cu_seqlens=np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int32),
      seq_lens=np.array(seq_lens, np.int32),
      total=np.int32(total),
      max_seqlen=np.int32(max(seq_lens, default=0)),
      num_dropped=np.int32(max(total - capacity, 0)),
      segment_ids=np.array(segment[:capacity] + [-1] * pad, np.int32),
      positions=np.array(position[:capacity] + [0] * pad, np.int32),
      valid=np.array([True] * min(total, capacity) + [False] * pad, bool),
      gather_map=np.array(gather[:capacity] + [-1] * pad, np.int32),
      scatter_map=scatter.reshape(mask.shape).astype(np.int32),
  )


def assert_info_matches(info, mask, capacity):
  expected = loop_info(mask, capacity)
  assert info.capacity == capacity
  assert info.mask_shape == tuple(np.shape(mask))
  for field, value in expected.items():
    assert_bitwise_equal(getattr(info, field), value, msg=field)


def capacity_for(kind, mask):
  active = int(np.count_nonzero(mask))
  return {"exact": active, "larger": active + 5, "full": mask.size}[kind]


# ---------------------------------------------------------------------------
# Exactness over dtypes, tails, mask kinds, densities and capacities.

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.int32)
TAILS = ((), (7,), (2, 3, 4))
DENSITIES = (0.0, 0.05, 0.5, 1.0)
MASK_KINDS = ("bool", "int8", "float")
CAPACITIES = ("exact", "larger", "full")


# Every dtype and every tail, not every pair: a dtype changes the bits
# moved, a tail the row's width, neither the other's code path (each case
# compiles four random shapes: the full grid cost CI minutes for no other
# path). test_pack_properties draws the rest at random.
DTYPE_TAILS = tuple(zip(DTYPES, TAILS + TAILS[:1])) + ((jnp.float32, ()),
                                                     (jnp.int32, (2, 3, 4)))


@pytest.mark.parametrize("dtype,tail", DTYPE_TAILS,
                         ids=lambda v: jnp.dtype(v).name if not isinstance(
                             v, tuple) else str(v))
def test_pack_unpack_match_numpy(impl, dtype, tail, rng):
  for i, density in enumerate(DENSITIES):
    b, s = rng.integers(1, 40), rng.integers(1, 90)
    mask = random_mask(rng, (b, s), density, MASK_KINDS[i % 3])
    capacity = capacity_for(CAPACITIES[(i + len(tail)) % 3], mask)
    x = random_array(rng, (b, s, *tail), dtype)
    fill = 7
    packed, info = rlk_jax.pack(x, mask, capacity=capacity, fill_value=fill,
                                implementation=impl)
    case = f"B={b} S={s} density={density} capacity={capacity}"
    assert_bitwise_equal(packed, numpy_pack(x, mask, capacity, fill), case)
    assert_info_matches(info, mask, capacity)
    dense = rlk_jax.unpack(packed, info, fill_value=-3, implementation=impl)
    assert_bitwise_equal(dense, numpy_unpack(packed, mask, capacity, -3), case)


@pytest.mark.parametrize("mask_shape,tail", [((5,), (3,)), ((4, 6, 3), (2,)),
                                             ((3, 2, 2, 5), ())])
def test_mask_of_any_rank(impl, mask_shape, tail, rng):
  mask = random_mask(rng, mask_shape, 0.4)
  x = random_array(rng, (*mask_shape, *tail), jnp.float32)
  packed, info = rlk_jax.pack(x, mask, implementation=impl)
  assert_bitwise_equal(packed, numpy_pack(x, mask, mask.size, 0))
  assert_info_matches(info, mask, mask.size)
  assert_bitwise_equal(rlk_jax.unpack(packed, info, implementation=impl),
                       np.where(mask.reshape(*mask_shape, *[1] * len(tail)),
                                np.asarray(x), 0).astype(np.float32))


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0,)])
def test_empty_masks(impl, shape):
  mask = np.ones(shape, bool)
  x = jnp.ones((*shape, 4), jnp.float32)
  packed, info = rlk_jax.pack(x, mask, capacity=3, fill_value=2.5,
                              implementation=impl)
  assert_bitwise_equal(packed, np.full((3, 4), 2.5, np.float32))
  assert int(info.total) == 0 and int(info.max_seqlen) == 0
  assert_info_matches(info, mask, 3)
  assert rlk_jax.unpack(packed, info, implementation=impl).shape == (*shape, 4)


def test_zero_capacity_and_zero_width(impl, rng):
  mask = np.zeros((3, 4), bool)
  x = random_array(rng, (3, 4, 0), jnp.float32)
  packed, info = rlk_jax.pack(x, mask, capacity=0, implementation=impl)
  assert packed.shape == (0, 0)
  assert rlk_jax.unpack(packed, info, implementation=impl).shape == (3, 4, 0)


@pytest.mark.parametrize("dtype", [jnp.bool_, jnp.int8, jnp.uint16, jnp.int64,
                                   jnp.float64])
def test_other_dtypes(impl, dtype, rng):
  with jax.enable_x64(jnp.dtype(dtype).itemsize == 8):
    mask = random_mask(rng, (6, 11), 0.5)
    x = random_array(rng, (6, 11, 3), dtype)
    packed, info = rlk_jax.pack(x, mask, implementation=impl)
    assert packed.dtype == jnp.dtype(dtype)
    assert_bitwise_equal(packed, numpy_pack(x, mask, mask.size, 0))


# ---------------------------------------------------------------------------
# Fill values never leak, inactive data never leaks.


def test_inactive_rows_never_leak(impl, rng):
  mask = random_mask(rng, (9, 33), 0.3)
  x = np.where(mask[..., None], rng.standard_normal((9, 33, 5)), HUGE)
  x = jnp.asarray(x.astype(np.float32))
  packed, info = rlk_jax.pack(x, mask, capacity=int(mask.sum()) + 17,
                              fill_value=-1, implementation=impl)
  assert np.abs(np.asarray(packed)).max() < HUGE
  assert (np.asarray(packed)[int(mask.sum()):] == -1).all()
  # Pad rows carrying a huge fill must not reach the dense side either.
  packed, info = rlk_jax.pack(x, mask, capacity=int(mask.sum()) + 17,
                              fill_value=HUGE, implementation=impl)
  dense = np.asarray(rlk_jax.unpack(packed, info, fill_value=0,
                                    implementation=impl))
  assert (dense[~mask] == 0).all()
  assert_bitwise_equal(dense[mask], np.asarray(x)[mask])


@pytest.mark.parametrize("fill", [float("nan"), float("-inf"), -0.0])
def test_special_float_fills(impl, fill, rng):
  mask = random_mask(rng, (4, 10), 0.5)
  x = random_array(rng, (4, 10, 3), jnp.float32)
  packed, info = rlk_jax.pack(x, mask, fill_value=fill, implementation=impl)
  assert_bitwise_equal(packed, numpy_pack(x, mask, mask.size, fill))


def test_round_trip(impl, rng):
  mask = random_mask(rng, (17, 45), 0.6)
  x = random_array(rng, (17, 45, 8), jnp.bfloat16)
  packed, info = rlk_jax.pack(x, mask, implementation=impl)
  dense = rlk_jax.unpack(packed, info, fill_value=0, implementation=impl)
  expected = np.where(mask[..., None], np.asarray(x), np.zeros((), x.dtype))
  assert_bitwise_equal(dense, expected)
  # pack(unpack(packed)) restores packed exactly.
  again, _ = rlk_jax.pack(dense, info, implementation=impl)
  assert_bitwise_equal(again, packed)


# ---------------------------------------------------------------------------
# Reuse of the metadata.


def test_reuse_info_for_other_tensors(impl, rng):
  mask = random_mask(rng, (8, 50), 0.4)
  hidden = random_array(rng, (8, 50, 16), jnp.bfloat16)
  ids = random_array(rng, (8, 50), jnp.int32)
  capacity = int(mask.sum()) + 3
  packed_h, info = rlk_jax.pack(hidden, mask, capacity=capacity, implementation=impl)
  packed_ids, info2 = rlk_jax.pack(ids, info, implementation=impl)
  assert info2 is info
  assert_bitwise_equal(packed_ids, numpy_pack(ids, mask, capacity, 0))
  info3 = rlk_jax.pack_info(mask, capacity=capacity)
  packed_h3, _ = rlk_jax.pack(hidden, info3, implementation=impl)
  assert_bitwise_equal(packed_h3, packed_h)


def test_reused_info_does_no_scan(impl):
  """Packing with a given PackInfo must not recompute the metadata."""
  mask = np.ones((4, 8), bool)
  info = rlk_jax.pack_info(mask)
  x = jnp.ones((4, 8, 2))
  from_info = str(jax.make_jaxpr(
      lambda y, i: rlk_jax.pack(y, i, implementation=impl)[0])(x, info))
  from_mask = str(jax.make_jaxpr(
      lambda y, m: rlk_jax.pack(y, m, implementation=impl)[0])(x, mask))
  # The metadata's mark: XLA's prefix sum, or the CUDA pack kernels.
  scan = "rlk_pack_rows" if impl == "cuda_ffi" else "cumsum"
  assert scan in from_mask  # so the check below can fail
  assert scan not in from_info


# ---------------------------------------------------------------------------
# Transformations: jit, vmap, scan, grad.


def test_under_jit(impl, rng):
  mask = random_mask(rng, (6, 20), 0.5)
  x = random_array(rng, (6, 20, 4), jnp.float32)
  capacity = int(mask.sum())

  @jax.jit
  def f(x, mask):
    packed, info = rlk_jax.pack(x, mask, capacity=capacity, implementation=impl)
    return packed, info, rlk_jax.unpack(packed * 2, info, implementation=impl)

  packed, info, dense = f(x, jnp.asarray(mask))
  assert_bitwise_equal(packed, numpy_pack(x, mask, capacity, 0))
  assert_info_matches(info, mask, capacity)
  assert_bitwise_equal(dense, np.where(mask[..., None], np.asarray(x) * 2, 0)
                       .astype(np.float32))


def test_under_vmap(impl, rng):
  masks = np.stack([random_mask(rng, (5, 12), d) for d in (0.1, 0.5, 0.9)])
  x = random_array(rng, (3, 5, 12, 4), jnp.float32)
  capacity = 40

  def one(x, mask):
    packed, info = rlk_jax.pack(x, mask, capacity=capacity, fill_value=-1,
                                implementation=impl)
    return packed, info

  packed, info = jax.jit(jax.vmap(one))(x, jnp.asarray(masks))
  for i in range(3):
    assert_bitwise_equal(packed[i], numpy_pack(x[i], masks[i], capacity, -1))
    assert_info_matches(jax.tree.map(lambda a: a[i], info), masks[i], capacity)
  dense = jax.vmap(lambda p, inf: rlk_jax.unpack(p, inf, implementation=impl))(
      packed, info)
  for i in range(3):
    assert_bitwise_equal(dense[i], numpy_unpack(packed[i], masks[i], capacity, 0))


def test_under_scan(impl, rng):
  masks = jnp.asarray(np.stack([random_mask(rng, (4, 9), 0.5) for _ in range(5)]))
  xs = random_array(rng, (5, 4, 9, 3), jnp.float32)

  def step(carry, inputs):
    x, mask = inputs
    packed, info = rlk_jax.pack(x, mask, capacity=36, implementation=impl)
    return carry + packed.sum() + info.total, packed

  total, packed = jax.lax.scan(step, jnp.float32(0), (xs, masks))
  for i in range(5):
    assert_bitwise_equal(packed[i], numpy_pack(xs[i], masks[i], 36, 0))
  assert np.isfinite(float(total))


def test_gradients_are_scatter_and_gather(impl, rng):
  mask = random_mask(rng, (7, 19), 0.4)
  capacity = int(mask.sum()) + 4
  x = random_array(rng, (7, 19, 3), jnp.float32)
  w_packed = random_array(rng, (capacity, 3), jnp.float32)
  w_dense = random_array(rng, (7, 19, 3), jnp.float32)

  grad_pack = jax.grad(lambda x: jnp.sum(
      rlk_jax.pack(x, mask, capacity=capacity, implementation=impl)[0] * w_packed))(x)
  # d pack = scatter to the dense layout, zeros where inactive.
  assert_bitwise_equal(grad_pack, numpy_unpack(w_packed, mask, capacity, 0))

  _, info = rlk_jax.pack(x, mask, capacity=capacity)
  packed = random_array(rng, (capacity, 3), jnp.float32)
  grad_unpack = jax.grad(lambda p: jnp.sum(
      rlk_jax.unpack(p, info, fill_value=5, implementation=impl) * w_dense))(packed)
  # d unpack = gather; pad rows get zero gradient.
  assert_bitwise_equal(grad_unpack, numpy_pack(w_dense, mask, capacity, 0))


@pytest.mark.parametrize("x64", [False, True])
def test_check_grads(impl, x64, rng):
  from jax.test_util import check_grads
  with jax.enable_x64(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    mask = random_mask(rng, (3, 8), 0.5)
    x = random_array(rng, (3, 8, 2), dtype)
    capacity = int(mask.sum()) + 2

    def f(x):
      packed, info = rlk_jax.pack(x, mask, capacity=capacity, implementation=impl)
      return rlk_jax.unpack(jnp.sin(packed), info, implementation=impl)

    tol = 1e-6 if x64 else 2e-2
    # Reverse mode, to second order: a custom_vjp has no forward mode.
    check_grads(f, (x,), order=2, modes=("rev",), atol=tol, rtol=tol)


def test_integer_data_is_not_differentiated(impl, rng):
  mask = random_mask(rng, (3, 8), 0.5)
  ids = random_array(rng, (3, 8), jnp.int32)
  x = random_array(rng, (3, 8, 2), jnp.float32)

  def loss(x):
    packed, info = rlk_jax.pack(x, mask, implementation=impl)
    packed_ids, _ = rlk_jax.pack(ids, info, implementation=impl)
    return jnp.sum(packed * packed_ids[:, None].astype(jnp.float32))

  g = jax.grad(loss)(x)
  assert_bitwise_equal(g, np.where(mask[..., None], np.asarray(ids)[..., None]
                                   .astype(np.float32), 0).astype(np.float32)
                       * np.ones((1, 1, 2), np.float32))


# ---------------------------------------------------------------------------
# Capacity overflow is never silent.


def test_overflow_raises_eagerly(rng):
  mask = random_mask(rng, (4, 10), 0.8)
  active = int(mask.sum())
  x = random_array(rng, (4, 10), jnp.float32)
  with pytest.raises(ValueError, match=f"{active} active rows but capacity is {active - 1}"):
    rlk_jax.pack(x, mask, capacity=active - 1)
  with pytest.raises(ValueError, match="capacity"):
    rlk_jax.pack_info(jnp.asarray(mask), capacity=active - 1)


def test_overflow_under_jit_is_reported_and_checked(impl, rng):
  mask = random_mask(rng, (4, 10), 0.8)
  active = int(mask.sum())
  capacity = active - 3
  x = random_array(rng, (4, 10, 2), jnp.float32)
  f = jax.jit(lambda x, m: rlk_jax.pack(x, m, capacity=capacity, implementation=impl))
  packed, info = f(x, jnp.asarray(mask))
  assert int(info.num_dropped) == 3 and int(info.total) == active
  # The first `capacity` active rows, in order; the dropped ones nowhere.
  assert_bitwise_equal(packed, numpy_pack(x, mask, capacity, 0))
  assert int((np.asarray(info.scatter_map) >= 0).sum()) == capacity

  checked = jax.jit(lambda x, m: rlk_jax.pack(x, m, capacity=capacity,
                                              implementation=impl, checked=True))
  with pytest.raises(Exception, match="do not fit capacity"):
    jax.block_until_ready(checked(x, jnp.asarray(mask)))
  # Checked mode passes quietly when everything fits.
  ok = jax.jit(lambda x, m: rlk_jax.pack(x, m, capacity=active, checked=True))
  jax.block_until_ready(ok(x, jnp.asarray(mask)))


# ---------------------------------------------------------------------------
# Bad input.


def test_bad_inputs():
  x = jnp.ones((4, 5, 3))
  mask = np.ones((4, 5), bool)
  with pytest.raises(ValueError, match=r"rank >= 1.*shape \(\)"):
    rlk_jax.pack(x, np.array(True))
  with pytest.raises(ValueError, match=r"\(4, 6\) must be a prefix of x's shape \(4, 5, 3\)"):
    rlk_jax.pack(x, np.ones((4, 6), bool))
  with pytest.raises(ValueError, match=r"\(5, 4\) must be a prefix"):
    rlk_jax.pack(x, np.ones((5, 4), bool))
  with pytest.raises(ValueError, match="capacity must be >= 0, got -1"):
    rlk_jax.pack(x, mask, capacity=-1)
  with pytest.raises(TypeError, match="capacity must be a static int"):
    rlk_jax.pack(x, mask, capacity=3.0)
  with pytest.raises(TypeError, match="capacity must be a static int"):
    rlk_jax.pack(x, mask, capacity=True)
  with pytest.raises(TypeError, match="unsupported dtype complex64"):
    rlk_jax.pack(x.astype(jnp.complex64), mask)
  with pytest.raises(TypeError, match="mask has unsupported dtype"):
    rlk_jax.pack(x, np.array([["a"] * 5] * 4))
  with pytest.raises(ValueError, match="not representable in int8"):
    rlk_jax.pack(x.astype(jnp.int8), mask, fill_value=300)
  with pytest.raises(ValueError, match="not representable in int32"):
    rlk_jax.pack(x.astype(jnp.int32), mask, fill_value=0.5)
  with pytest.raises(TypeError, match="static Python scalar"):
    rlk_jax.pack(x, mask, fill_value=jnp.float32(1))
  sparse = np.zeros((4, 5), bool)
  sparse[0, :3] = True
  packed, info = rlk_jax.pack(x, sparse, capacity=7)
  with pytest.raises(ValueError, match="capacity=8 disagrees"):
    rlk_jax.pack(x, info, capacity=8)
  with pytest.raises(ValueError, match=r"shape \(6, 3\); its first axis must be the capacity 7"):
    rlk_jax.unpack(jnp.ones((6, 3)), info)
  with pytest.raises(TypeError, match="must be the PackInfo"):
    rlk_jax.unpack(packed, mask)
  with pytest.raises(ValueError, match="unknown implementation 'cublas'"):
    rlk_jax.pack(x, mask, implementation="cublas")
