"""det_gemm's tensor-parallel-invariant mode (``reduction_chunks``) inside
sharded jit programs: the weight split along its reduction dimension over
1, 2, 4 and 8 devices gives the same bits, forward and gradients, and only
f32 partials travel (never the weight). Run by tests/test_sharding.py in a
child process: on 8 host devices, or on the GPUs of a multi-GPU machine."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import rlk_jax
from conftest import assert_bitwise_equal, random_array
from sharding_setup import DEVICES, IMPLEMENTATIONS, operand_dtype, single

# On a GPU the Triton route takes part too.
IMPLS = list(IMPLEMENTATIONS) + (
    ["triton"] if jax.default_backend() == "gpu" else [])
CHUNKS = 8
DEGREES = [t for t in (1, 2, 4, 8) if t <= DEVICES]


def tp_mesh(t, data=1):
  devices = np.array(jax.devices()[:t * data]).reshape(data, t)
  return Mesh(devices, ("data", "tp"))


def put(mesh, x, *spec):
  return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def layer(impl):
  """A linear layer in the mode (nn.Linear's [N, K] weight) and its VJP with
  a given cotangent: output, d input, d weight."""
  def forward(x, w):
    return rlk_jax.det_gemm(x, w, transpose_b=True, implementation=impl,
                            reduction_chunks=CHUNKS)

  @jax.jit
  def step(x, w, g):
    y, vjp = jax.vjp(forward, x, w)
    return (y, *vjp(g))
  return step


def gathered_shapes(hlo: str) -> list[str]:
  return re.findall(r"= (\S+) all-gather\(", hlo)


# Row-parallel (the weight split along K: its columns in the [N, K] layout)
# and column-parallel (split along N: its rows); rows of x may be split too.
LAYOUTS = {
    "row_parallel": dict(x=(None, "tp"), w=(None, "tp"), g=()),
    # The activation whole on every device: sliced locally, the weight
    # still never gathered.
    "row_parallel_whole_input": dict(x=(), w=(None, "tp"), g=()),
    "column_parallel": dict(x=(), w=("tp", None), g=(None, "tp")),
    "row_parallel_data": dict(x=("data", "tp"), w=(None, "tp"), g=("data",)),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_tp_degree_gives_the_same_bits(impl, layout, rng):
  specs = LAYOUTS[layout]
  data = 2 if "data" in layout else 1
  m, k, n = 48, 256, 64  # K/8 = 32 and N/8 = 8: 16-byte pitches in bf16
  dtype = operand_dtype(impl)
  x = random_array(rng, (m, k), dtype)
  w = random_array(rng, (n, k), dtype)
  g = random_array(rng, (m, n), dtype)
  step = layer(impl)
  want = step(single(x), single(w), single(g))
  hlo_one = step.lower(single(x), single(w), single(g)).compile().as_text()
  assert not gathered_shapes(hlo_one)
  for t in [t for t in DEGREES if t * data <= DEVICES]:
    mesh = tp_mesh(t, data)
    args = (put(mesh, x, *specs["x"]), put(mesh, w, *specs["w"]),
            put(mesh, g, *specs["g"]))
    got = step(*args)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
      assert_bitwise_equal(a, b, f"{layout}, {t} devices: {name}")
    hlo = step.lower(*args).compile().as_text()
    assert "all-reduce" not in hlo, hlo[:3000]
    # The weight never travels. With only the weight's K split, what does is
    # the f32 roots of the devices' subtrees ([t, rows, cols]); with rows
    # split too, dW's rows are gathered as in the default mode.
    gathered = gathered_shapes(hlo)
    assert not any(s.split("{")[0].endswith(f"[{n},{k}]") for s in gathered), (
        gathered)
    if data == 1:
      assert all(s.startswith(f"f32[{t},") for s in gathered), gathered


def test_a_degree_that_cannot_hold_whole_subtrees_is_gathered(rng):
  # 2 chunks over 4 devices: a device would hold half a chunk, so the
  # partitioner gathers K (the weight's memory on every device, the bits
  # unchanged).
  if DEVICES < 4:
    pytest.skip("needs 4 devices")
  x = random_array(rng, (16, 64), jnp.float32)
  w = random_array(rng, (24, 64), jnp.float32)
  f = jax.jit(functools.partial(rlk_jax.det_gemm, transpose_b=True,
                                implementation="xla", reduction_chunks=2))
  mesh = tp_mesh(4)
  args = (put(mesh, x, None, "tp"), put(mesh, w, None, "tp"))
  assert_bitwise_equal(f(*args), f(single(x), single(w)))
  gathered = gathered_shapes(f.lower(*args).compile().as_text())
  assert any(s.startswith("f32[24,64]") for s in gathered), gathered


# Inside shard_map the caller names the axis each device's weight is split
# over: K (a row-parallel layer: its input's features split alike) or N (a
# column-parallel one). rlk's kernels take no varying-axis types yet, so a
# shard_map over them is unchecked (check_vma=False); the XLA reference runs
# in a checked one, whose output is typed whole (out_specs without "tp").
SHARD_MAP_LAYOUTS = {
    "row_parallel": dict(axis="k_axis_name", x=P(None, "tp"),
                         w=P(None, "tp"), g=P(), y=P(), dx=P(None, "tp"),
                         dw=P(None, "tp")),
    "column_parallel": dict(axis="n_axis_name", x=P(), w=P("tp", None),
                            g=P(None, "tp"), y=P(None, "tp"), dx=P(),
                            dw=P("tp", None)),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", sorted(SHARD_MAP_LAYOUTS))
def test_shard_map_with_named_axes_gives_one_devices_bits(impl, layout, rng):
  spec = SHARD_MAP_LAYOUTS[layout]
  m, k, n = 24, 256, 64
  dtype = operand_dtype(impl)
  x = random_array(rng, (m, k), dtype)
  w = random_array(rng, (n, k), dtype)
  g = random_array(rng, (m, n), dtype)
  want = layer(impl)(single(x), single(w), single(g))

  def body(x, w, g):
    y, vjp = jax.vjp(lambda x, w: rlk_jax.det_gemm(
        x, w, transpose_b=True, implementation=impl, reduction_chunks=CHUNKS,
        **{spec["axis"]: "tp"}), x, w)
    return (y, *vjp(g))

  for t in DEGREES:
    mesh = tp_mesh(t)
    step = jax.jit(jax.shard_map(
        body, mesh=mesh, in_specs=(spec["x"], spec["w"], spec["g"]),
        out_specs=(spec["y"], spec["dx"], spec["dw"]),
        check_vma=impl == "xla"))
    got = step(x, w, g)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
      assert_bitwise_equal(a, b, f"shard_map {layout}, {t} devices: {name}")
    hlo = step.lower(x, w, g).compile().as_text()
    assert "all-reduce" not in hlo
    assert not any(s.split("{")[0].endswith(f"[{n},{k}]")
                   for s in gathered_shapes(hlo))


def test_named_axes_are_checked(rng):
  x = random_array(rng, (8, 64), jnp.float32)
  w = random_array(rng, (16, 64), jnp.float32)
  with pytest.raises(ValueError, match="k_axis_name='tp' names no axis"):
    rlk_jax.det_gemm(x, w, transpose_b=True, reduction_chunks=8,
                     k_axis_name="tp")
  with pytest.raises(ValueError, match="pass reduction_chunks"):
    rlk_jax.det_gemm(x, w, transpose_b=True, k_axis_name="tp")
  if DEVICES < 4:
    return
  mesh = tp_mesh(4)
  body = lambda x, w: rlk_jax.det_gemm(x, w, transpose_b=True,
                                       reduction_chunks=2, k_axis_name="tp")
  with pytest.raises(ValueError, match="4 ranks cannot each hold"):
    jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp")),
                  out_specs=P())(x, w)


# linear_logp's vocabulary-parallel mode: the weight's V split over the
# devices. Kernels only: on the CPU the XLA reference's pick of the target's
# log-prob rounds differently in some programs (found 2026-11-28: one row in
# 12, by an ulp, at 4 and 8 devices), so its cross-degree bits are not
# promised.
LOGP_IMPLS = ["pallas"] + (["triton"] if jax.default_backend() == "gpu" else [])


@pytest.mark.parametrize("impl", LOGP_IMPLS)
def test_vocab_parallel_linear_logp_same_bits_at_every_degree(impl, rng):
  n, h, v = 12, 64, 256
  hidden = random_array(rng, (n, h), jnp.float32)
  weight = random_array(rng, (h, v), jnp.float32) / 8
  targets = jnp.asarray(rng.integers(0, v, n), jnp.int32).at[3].set(-100)
  temps = jnp.asarray(rng.uniform(0.5, 1.5, n), jnp.float32)
  g_logp = random_array(rng, (n,), jnp.float32)
  g_ent = random_array(rng, (n,), jnp.float32)

  @jax.jit
  def step(hidden, weight):
    mode = lambda h, w: rlk_jax.linear_logp(
        h, w, targets, temperature=temps, return_entropy=True,
        implementation=impl, vocab_chunks=CHUNKS)
    out, vjp = jax.vjp(mode, hidden, weight)
    return (*out, *vjp((g_logp, g_ent)))

  want = step(single(hidden), single(weight))
  for t in DEGREES[1:]:
    mesh = tp_mesh(t)
    args = (put(mesh, hidden), put(mesh, weight, None, "tp"))
    got = step(*args)
    for name, a, b in zip(("logp", "entropy", "dh", "dw"), got, want):
      assert_bitwise_equal(a, b, f"{t} devices: {name}")
    assert got[3].sharding.spec == P(None, "tp")  # dW stays split over V
    hlo = step.lower(*args).compile().as_text()
    assert "all-reduce" not in hlo
    gathered = gathered_shapes(hlo)
    assert all(s.startswith(f"f32[{t},") for s in gathered), gathered
