"""rlk_jax.linear_logp: accuracy against float64, bitwise batch invariance,
gradients, ignore index, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlk_jax
from rlk_jax import _linear_logp, reference
from conftest import assert_bitwise_equal, random_array

V = 1000  # not a multiple of any block or chunk


def f64_logp(hidden, weight, targets, temperature):
  h = np.asarray(jnp.asarray(hidden, jnp.float32), np.float64)
  w = np.asarray(jnp.asarray(weight, jnp.float32), np.float64)
  logits = h @ w / temperature
  top = logits.max(1, keepdims=True)
  lse = np.log(np.exp(logits - top).sum(1)) + top[:, 0]
  t = np.asarray(targets)
  valid = (t >= 0) & (t < w.shape[1])
  logp = np.where(valid, logits[np.arange(len(t)), np.clip(t, 0, None)] - lse, 0)
  p = np.exp(logits - lse[:, None])
  return logp, lse - (p * logits).sum(1), logits, p


def problem(rng, n, dtype=jnp.bfloat16, h=96):
  hidden = random_array(rng, (n, h), dtype)
  weight = (random_array(rng, (h, V), jnp.float32) * 0.3).astype(dtype)
  targets = jnp.asarray(rng.integers(0, V, n), jnp.int32)
  return hidden, weight, targets


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_against_float64(impl, temperature, rng):
  hidden, weight, targets = problem(rng, 130)
  targets = targets.at[5].set(-100).at[9].set(-100)
  logp, entropy = rlk_jax.linear_logp(hidden, weight, targets,
                                      temperature=temperature,
                                      return_entropy=True, implementation=impl)
  assert logp.dtype == jnp.float32 and logp.shape == (130,)
  ref_logp, ref_ent, _, _ = f64_logp(hidden, weight, targets, temperature)
  assert (np.asarray(logp) <= 0).all()
  assert np.asarray(logp)[[5, 9]].tolist() == [0.0, 0.0]  # ignored
  np.testing.assert_allclose(np.asarray(logp), ref_logp, rtol=1e-6, atol=2e-5)
  # Absolute: entropy = lse - E[logit] cancels for peaked rows (logits ~ 30).
  np.testing.assert_allclose(np.asarray(entropy), ref_ent, rtol=1e-4, atol=1e-4)


def test_rows_do_not_depend_on_the_batch(impl, rng):
  hidden, weight, targets = problem(rng, 300)
  full = rlk_jax.linear_logp(hidden, weight, targets, implementation=impl)
  for m in (1, 3, 64):
    start = int(rng.integers(0, 300 - m + 1))
    part = rlk_jax.linear_logp(hidden[start:start + m], weight,
                               targets[start:start + m], implementation=impl)
    assert_bitwise_equal(part, full[start:start + m], f"M={m} at {start}")
  # Leading shapes: a [B, S] batch is the same rows.
  batched = rlk_jax.linear_logp(hidden.reshape(3, 100, 96), weight,
                                targets.reshape(3, 100), implementation=impl)
  assert_bitwise_equal(batched.reshape(300), full)


def test_gradients_against_float64(impl, rng):
  hidden, weight, targets = problem(rng, 40, jnp.float32, h=32)
  targets = targets.at[3].set(-100)
  g_logp = random_array(rng, (40,), jnp.float32)
  g_ent = random_array(rng, (40,), jnp.float32)
  temperature = 0.8
  _, vjp = jax.vjp(lambda h, w: rlk_jax.linear_logp(
      h, w, targets, temperature=temperature, return_entropy=True,
      chunk_size=300, implementation=impl), hidden, weight)
  dh, dw = vjp((g_logp, g_ent))
  _, _, logits, p = f64_logp(hidden, weight, targets, temperature)
  t = np.asarray(targets)
  onehot = np.zeros_like(p)
  onehot[np.arange(40), np.clip(t, 0, None)] = (t >= 0)
  mean = (p * logits).sum(1, keepdims=True)
  valid = (t >= 0)[:, None]
  dlogits = (np.asarray(g_logp)[:, None] * valid * (onehot - p)
             - np.asarray(g_ent)[:, None] * p * (logits - mean)) / temperature
  h64 = np.asarray(hidden, np.float64)
  w64 = np.asarray(weight, np.float64)
  for got, want in ((dh, dlogits @ w64.T), (dw, h64.T @ dlogits)):
    err = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
    # f32 rounding, with cancellation in (onehot - p) and (logits - mean):
    # over 400 draws the XLA route's median was 4.3e-6 and its worst 1.4e-5
    # (a seed failed CI's former 1e-5); a wrong term is O(1).
    assert err < 5e-5, err


def test_check_grads(impl, rng):
  from jax.test_util import check_grads
  hidden, weight, targets = problem(rng, 8, jnp.float32, h=16)
  # f32 central differences: at the default eps (1e-4) log-probs near -60
  # carry ~0.04 of rounding error, which failed on some seeds (658227452,
  # say; the analytic gradients matched float64 to 2e-6 there). Log-probs
  # near -log V and eps=1e-2 keep rounding and truncation error below 1e-3.
  hidden = hidden * 0.25
  f = lambda h, w: rlk_jax.linear_logp(h, w, targets, chunk_size=256,
                                       implementation=impl)
  check_grads(f, (hidden, weight), order=1, modes=("rev",), atol=2e-2,
              rtol=2e-2, eps=1e-2)


def test_backward_is_deterministic_and_row_invariant(impl, rng):
  hidden, weight, targets = problem(rng, 200)
  grad = jax.jit(jax.grad(lambda h, w, t: jnp.sum(rlk_jax.linear_logp(
      h, w, t, chunk_size=384, implementation=impl)), argnums=(0, 1)))
  dh, dw = grad(hidden, weight, targets)
  dh2, dw2 = grad(hidden, weight, targets)
  assert_bitwise_equal(dh2, dh)
  assert_bitwise_equal(dw2, dw)
  dh_part, _ = grad(hidden[10:13], weight, targets[10:13])
  assert_bitwise_equal(dh_part, dh[10:13])


def _per_row_problem(rng, n=96, h=32):
  hidden, weight, targets = problem(rng, n, jnp.float32, h=h)
  targets = targets.at[7].set(-100)
  temps = jnp.asarray(rng.uniform(0.4, 1.6, n), jnp.float32)
  return hidden, weight, targets, temps


def test_per_sample_temperature_against_float64(impl, rng):
  hidden, weight, targets, temps = _per_row_problem(rng)
  n = hidden.shape[0]
  g_logp = random_array(rng, (n,), jnp.float32)
  g_ent = random_array(rng, (n,), jnp.float32)
  (logp, ent), vjp = jax.vjp(lambda h, w: rlk_jax.linear_logp(
      h, w, targets, temperature=temps, return_entropy=True, chunk_size=384,
      implementation=impl), hidden, weight)
  dh, dw = vjp((g_logp, g_ent))
  t64 = np.asarray(temps, np.float64)[:, None]
  h64, w64 = (np.asarray(x, np.float64) for x in (hidden, weight))
  logits = h64 @ w64 / t64
  lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
  p = np.exp(logits - lse[:, None])
  tg = np.asarray(targets)
  valid = tg >= 0
  picked = logits[np.arange(n), np.clip(tg, 0, None)]
  np.testing.assert_allclose(np.asarray(logp), np.where(valid, picked - lse, 0),
                             rtol=1e-5, atol=2e-5)
  mean = (p * logits).sum(1)
  np.testing.assert_allclose(np.asarray(ent), lse - mean, rtol=1e-4, atol=1e-4)
  onehot = np.zeros_like(p)
  onehot[np.arange(n), np.clip(tg, 0, None)] = valid
  dlogits = (np.asarray(g_logp)[:, None] * valid[:, None] * (onehot - p)
             - np.asarray(g_ent)[:, None] * p * (logits - mean[:, None])) / t64
  for got, want in ((dh, dlogits @ w64.T), (dw, h64.T @ dlogits)):
    err = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
    assert err < 5e-5, err


def test_per_sample_temperature_rows_are_per_call_rows(impl, rng):
  # A row at its own temperature is bitwise that row in a call at that
  # temperature, alone or in any batch; a [B, 1] per-sequence temperature
  # broadcasts over the sequence's tokens; a constant vector is the scalar.
  hidden, weight, targets = problem(rng, 60)
  temps = jnp.asarray(rng.uniform(0.5, 1.5, 60), jnp.float32)
  f = functools.partial(rlk_jax.linear_logp, return_entropy=True,
                        implementation=impl)
  logp, ent = f(hidden, weight, targets, temperature=temps)
  for i in (0, 17, 59):
    one_logp, one_ent = f(hidden[i:i + 1], weight, targets[i:i + 1],
                          temperature=float(temps[i]))
    assert_bitwise_equal(one_logp, logp[i:i + 1], f"row {i}")
    assert_bitwise_equal(one_ent, ent[i:i + 1], f"row {i}")
  seq_temps = jnp.asarray([[0.6], [1.3], [0.9]], jnp.float32)
  by_seq = f(hidden.reshape(3, 20, 96), weight, targets.reshape(3, 20),
             temperature=seq_temps)[0]
  by_row = f(hidden, weight, targets,
             temperature=jnp.repeat(seq_temps[:, 0], 20))[0]
  assert_bitwise_equal(by_seq.reshape(60), by_row)
  constant = f(hidden, weight, targets, temperature=jnp.full((60,), 0.8))[0]
  assert_bitwise_equal(constant, f(hidden, weight, targets,
                                   temperature=0.8)[0])


def test_temperature_gets_no_gradient(rng):
  hidden, weight, targets, temps = _per_row_problem(rng, n=12, h=16)
  dt = jax.grad(lambda t: jnp.sum(rlk_jax.linear_logp(
      hidden, weight, targets, temperature=t)))(temps)
  assert_bitwise_equal(dt, jnp.zeros_like(temps))


def test_entropy_only_when_asked(impl, rng):
  # Without return_entropy the forward folds no entropy statistic (the
  # routes' entropy output is NaN, not computed) and the backward drops the
  # entropy term; log-probs are bitwise those computed with the entropy,
  # gradients those with a zero entropy cotangent (to XLA's rounding of exp,
  # which differs between fusions on the CPU; the CUDA kernels' gradients
  # are compared bitwise on the device).
  hidden, weight, targets, temps = _per_row_problem(rng)
  n = hidden.shape[0]
  fn = _linear_logp.TABLE.implementations[impl].fn
  args = (hidden, weight, jnp.where(targets < 0, -1, targets), temps, 384)
  without = fn(*args, False)
  with_ent = fn(*args, True)
  assert np.isnan(np.asarray(without[2])).all()
  assert not np.isnan(np.asarray(with_ent[2])).any()
  for a, b in zip(without[:2], with_ent[:2]):
    assert_bitwise_equal(a, b)
  g = random_array(rng, (n,), jnp.float32)

  def grads(return_entropy):
    def loss(h, w):
      out = rlk_jax.linear_logp(h, w, targets, temperature=temps,
                                chunk_size=384, return_entropy=return_entropy,
                                implementation=impl)
      return jnp.sum((out[0] if return_entropy else out) * g)
    return jax.grad(loss, argnums=(0, 1))(hidden, weight)

  for a, b in zip(grads(False), grads(True)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-5


def test_weight_gradient_in_f32_for_micro_batch_accumulation(rng):
  # linear_logp_grads' f32 weight gradient is the bf16 one before its
  # rounding: rounding it gives the bf16 gradient's bits.
  hidden, weight, targets = problem(rng, 64)
  temps = jnp.full((64,), 0.9, jnp.float32)
  t = jnp.where(targets < 0, -1, targets)
  logp, lse, ent = _linear_logp._forward("xla", 256, False, hidden, weight, t,
                                         temps)
  g = random_array(rng, (64,), jnp.float32)
  args = ("xla", 256, False, hidden, weight, t, temps, lse, ent, g,
          jnp.zeros_like(g))
  dh, dw = _linear_logp.linear_logp_grads(*args)
  dh32, dw32 = _linear_logp.linear_logp_grads(*args, dw_dtype=jnp.float32)
  assert dw32.dtype == jnp.float32 and dw.dtype == jnp.bfloat16
  assert_bitwise_equal(dh32, dh)
  assert_bitwise_equal(dw32.astype(jnp.bfloat16), dw)


def test_bad_inputs(rng):
  hidden, weight, targets = problem(rng, 4)
  with pytest.raises(ValueError, match="must end in H=96"):
    rlk_jax.linear_logp(hidden[:, :5], weight, targets)
  with pytest.raises(ValueError, match="weight must be"):
    rlk_jax.linear_logp(hidden, weight[None], targets)
  with pytest.raises(ValueError, match=r"targets shape \(3,\)"):
    rlk_jax.linear_logp(hidden, weight, targets[:3])
  with pytest.raises(TypeError, match="targets must be integers"):
    rlk_jax.linear_logp(hidden, weight, targets.astype(jnp.float32))
  with pytest.raises(TypeError, match="must share"):
    rlk_jax.linear_logp(hidden.astype(jnp.float32), weight, targets)
  with pytest.raises(ValueError, match="temperature must be > 0"):
    rlk_jax.linear_logp(hidden, weight, targets, temperature=0.0)
  with pytest.raises(ValueError, match=r"temperature must be > 0, got -0.5"):
    rlk_jax.linear_logp(hidden, weight, targets,
                        temperature=np.asarray([1.0, -0.5, 1.0, 1.0]))
  with pytest.raises(ValueError, match=r"temperature of shape \(3,\) does not "
                     r"broadcast to the targets' shape \(4,\)"):
    rlk_jax.linear_logp(hidden, weight, targets, temperature=jnp.ones(3))
  with pytest.raises(TypeError, match="temperature must be floating point"):
    rlk_jax.linear_logp(hidden, weight, targets,
                        temperature=jnp.ones(4, jnp.int32))


def test_out_of_range_targets_are_nan_under_jit_and_errors_on_host(rng):
  # A vocabulary mismatch must be loud: NaN where the targets are on the
  # device (no sync), an error naming the id where they are host data.
  hidden, weight, targets = problem(rng, 8)
  bad = targets.at[2].set(V).at[5].set(-7).at[6].set(-100)
  f = jax.jit(functools.partial(rlk_jax.linear_logp, implementation="xla"))
  got, want = f(hidden, weight, bad), f(hidden, weight, targets)
  assert np.isnan(got[2]) and np.isnan(got[5]) and got[6] == 0
  keep = np.array([0, 1, 3, 4, 7])
  assert_bitwise_equal(got[keep], want[keep])
  loss = jax.jit(lambda h, t: rlk_jax.linear_logp(h, weight, t).sum())
  assert np.isnan(loss(hidden, bad))
  on_cpu = all(d.platform == "cpu" for d in bad.devices())
  for host in (np.asarray(bad), np.asarray(bad).tolist()) + ((bad,) if on_cpu
                                                           else ()):
    with pytest.raises(ValueError, match=rf"target id {V} \(flat position 2; "
                       rf"2 such ids\) is outside the vocabulary \[0, V={V}\)"):
      rlk_jax.linear_logp(hidden, weight, host)
  if not on_cpu:  # reading a GPU array would sync: NaN there, no error
    eager = rlk_jax.linear_logp(hidden, weight, bad)
    assert np.isnan(eager[2]) and np.isnan(eager[5])
  # ignore_index is not out of range, whatever its value
  ok = rlk_jax.linear_logp(hidden, weight,
                           np.asarray(bad.at[2].set(3).at[6].set(4)),
                           ignore_index=-7)
  assert ok[5] == 0 and np.isfinite(ok).all()


@pytest.mark.parametrize("chunk", [128, 384])
def test_chunked_stats_fold_matches_the_oracle_and_is_row_invariant(chunk, rng):
  # The cuda_ffi forward's second half: precomputed logits folded chunk by
  # chunk (here from the reference K loop; the kernel runs interpreted).
  from pallas_kernels import linear_logp as logp_kernel
  n, h, v = 37, 64, 1000
  hidden = random_array(rng, (n, h), jnp.float32) / 4
  weight = random_array(rng, (h, v), jnp.float32) / 8
  targets = jnp.asarray(rng.integers(-1, v, n), jnp.int32)
  temps = jnp.asarray(rng.uniform(0.5, 1.5, n), jnp.float32)  # one a row

  def fold(hidden, targets, temps):
    logits = reference.det_matmul(hidden, weight, out_dtype=jnp.float32)
    stats = logp_kernel.initial_stats(hidden.shape[0])
    for c0 in range(0, v, chunk):
      stats = logp_kernel.update_stats(logits[:, c0:c0 + chunk], targets - c0,
                                       temps, stats, interpret=True)
    return logp_kernel.finish(stats, targets, v, log=functools.partial(
        reference.rowwise, jnp.log))

  got = fold(hidden, targets, temps)
  logits = (np.asarray(hidden, np.float64) @ np.asarray(weight, np.float64)
            / np.asarray(temps, np.float64)[:, None])
  lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
  p = np.exp(logits - lse[:, None])
  t = np.asarray(targets)
  logp = np.where(t >= 0, logits[np.arange(n), np.clip(t, 0, None)] - lse, 0.0)
  for g, w in zip(got, (logp, lse, lse - (p * logits).sum(1))):
    np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5)
  alone = fold(hidden[5:8], targets[5:8], temps[5:8])
  for g, a in zip(got, alone):
    assert_bitwise_equal(a, g[5:8])


@pytest.mark.parametrize("fn", [jnp.log, jnp.exp])
def test_rowwise_bits_do_not_depend_on_the_number_of_rows(fn, rng):
  # XLA's CPU backend rounds exp/log differently in an array's vector body
  # and its remainder (about one random 1-3 row window in a hundred differed
  # with plain jnp.log): rowwise must give every row the batch's bits.
  # Each new n compiles; windows of a compiled n are cheap: 15 lengths x 20
  # windows x 3 widths (60 x 1 x 3 before, at four times the compiles).
  f = jax.jit(functools.partial(reference.rowwise, fn))
  for _ in range(15):
    n = int(rng.integers(4, 300))
    x = jnp.asarray(rng.uniform(-20, 20, n), jnp.float32)
    if fn is jnp.log:
      x = jnp.exp(x)
    full = f(x)
    np.testing.assert_allclose(np.asarray(full), np.asarray(fn(x)), rtol=2e-6)
    for start in rng.integers(0, n - 3, 20):
      for width in (1, 2, 3):
        assert_bitwise_equal(f(x[start:start + width]),
                             full[start:start + width],
                             f"n={n} rows {start}+{width}")


def test_f32_master_weight_gives_an_unrounded_f32_gradient(impl, rng):
  # bf16 hidden beside f32 master weights: the bits of a call with the
  # weight cast to bf16, and the weight's gradient in f32 before rounding
  # (rounding it gives the bf16 call's gradient), so micro-batches sum it
  # without a bf16 rounding each.
  hidden, _, targets = problem(rng, 50)
  master = random_array(rng, (96, V), jnp.float32) * 0.3
  g = random_array(rng, (50,), jnp.float32)

  def loss(h, w):
    return jnp.sum(rlk_jax.linear_logp(h, w, targets, temperature=0.9,
                                       chunk_size=384, implementation=impl) * g)

  (value, (dh, dw)) = jax.value_and_grad(loss, argnums=(0, 1))(hidden, master)
  (want, (dh_b, dw_b)) = jax.value_and_grad(loss, argnums=(0, 1))(
      hidden, master.astype(jnp.bfloat16))
  assert dw.dtype == jnp.float32 and dw_b.dtype == jnp.bfloat16
  assert_bitwise_equal(value, want)
  assert_bitwise_equal(dh, dh_b)
  assert_bitwise_equal(dw.astype(jnp.bfloat16), dw_b)
  assert not np.array_equal(np.asarray(dw),
                            np.asarray(dw_b.astype(jnp.float32)))  # unrounded
  with pytest.raises(TypeError, match="master weights"):
    rlk_jax.linear_logp(hidden.astype(jnp.float32), master.astype(jnp.bfloat16),
                        targets)
