"""The torch tensor-parallel layers (rlk_torch_bridge.tensor_parallel):
rlk_jax's bits in one process, and the same bits at 1, 2 and 4 ranks (gloo
processes on the CPU; NCCL on the GPUs of a multi-GPU machine)."""

import functools
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import rlk_jax
import rlk_torch_bridge
from conftest import assert_bitwise_equal
from tensor_parallel_worker import mlp_case

HERE = os.path.dirname(os.path.abspath(__file__))


def as_jax(t):
  # On the CPU device, as the torch tensors are: the "xla" route's bits are
  # the CPU's (XLA on a GPU may fuse its multiply-adds).
  x = jnp.asarray(t.detach().float().cpu().numpy()).astype(
      {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16}[t.dtype])
  return jax.device_put(x, jax.devices("cpu")[0])


def test_torch_mode_has_rlk_jax_bits(rng):
  a = torch.tensor(rng.standard_normal((21, 128)), dtype=torch.float32,
                   requires_grad=True)
  w = torch.tensor(rng.standard_normal((32, 128)), dtype=torch.float32,
                   requires_grad=True)
  g = torch.tensor(rng.standard_normal((21, 32)), dtype=torch.float32)
  y = rlk_torch_bridge.det_gemm(a, w, transpose_b=True, reduction_chunks=4,
                                implementation="xla")
  y.backward(g)
  mode = functools.partial(rlk_jax.det_gemm, transpose_b=True,
                           implementation="xla", reduction_chunks=4)
  want, vjp = jax.vjp(mode, as_jax(a), as_jax(w))
  want_da, want_dw = vjp(as_jax(g))
  for got, expected in ((y, want), (a.grad, want_da), (w.grad, want_dw)):
    assert_bitwise_equal(got.detach().numpy(), np.asarray(expected))


def test_bad_splits_raise():
  with pytest.raises(ValueError, match="must divide K=100"):
    rlk_torch_bridge.det_gemm(torch.ones(2, 100), torch.ones(8, 100),
                              transpose_b=True, reduction_chunks=8)
  with pytest.raises(ValueError, match="power of two"):
    rlk_torch_bridge.det_gemm(torch.ones(2, 96), torch.ones(8, 96),
                              transpose_b=True, reduction_chunks=6)
  with pytest.raises(TypeError, match="float32 and torch.bfloat16"):
    rlk_torch_bridge.det_gemm(torch.ones(2, 96),
                              torch.ones(8, 96, dtype=torch.bfloat16),
                              transpose_b=True, reduction_chunks=2)


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_ranks(tmp_path, world, seed, device, impl, case=None):
  port = free_port()
  procs = []
  for rank in range(world):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
               PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE),
                                           os.environ.get("PYTHONPATH", "")]))
    procs.append(subprocess.Popen(
        [sys.executable, os.path.join(HERE, "tensor_parallel_worker.py"),
         str(tmp_path), str(seed), device, impl, *([case] if case else [])],
        env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  logs = [p.communicate(timeout=600)[0] for p in procs]
  assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
  return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def whole(ranks, name, dim):
  return torch.cat([r[name] for r in ranks], dim=dim)


def check_degrees(tmp_path, rng, device, impl, degrees):
  seed = int(rng.integers(2**31))
  results = {}
  for world in degrees:
    out = tmp_path / f"tp{world}"
    out.mkdir()
    ranks = run_ranks(out, world, seed, device, impl)
    for r in ranks[1:]:  # the row-parallel output and dx: whole on every rank
      assert torch.equal(r["y"], ranks[0]["y"]) and torch.equal(r["dx"],
                                                                  ranks[0]["dx"])
    results[world] = dict(
        y=ranks[0]["y"], dx=ranks[0]["dx"], d_up=whole(ranks, "d_up", 0),
        d_down=whole(ranks, "d_down", 1),
        d_up_bias=whole(ranks, "d_up_bias", 0),
        d_down_bias=ranks[0]["d_down_bias"])
  first = results[degrees[0]]
  for world in degrees[1:]:
    for name, value in results[world].items():
      assert_bitwise_equal(value.float().numpy(), first[name].float().numpy(),
                           f"{name}: {world} ranks vs {degrees[0]}")
  return first, seed


def test_tp_degrees_1_2_4_give_one_process_bits_on_cpu(tmp_path, rng):
  got, seed = check_degrees(tmp_path, rng, "cpu", "xla", [1, 2, 4])
  # ... and the one-process chain of det_gemm in the mode with whole weights.
  up, down, x, g = mlp_case(seed, "cpu", torch.float32, 24, 256, 128, 64)
  x.requires_grad_(True)
  mode = functools.partial(rlk_torch_bridge.det_gemm, transpose_b=True,
                           reduction_chunks=8, implementation="xla")
  y = mode(torch.relu(mode(x, up.weight) + up.bias), down.weight) + down.bias
  y.backward(g)
  for name, want in (("y", y), ("dx", x.grad), ("d_up", up.weight.grad),
                     ("d_down", down.weight.grad)):
    assert_bitwise_equal(got[name].numpy(), want.detach().numpy(), name)


@pytest.mark.gpu
def test_tp_degrees_give_the_same_bits_on_gpus(tmp_path, rng):
  gpus = torch.cuda.device_count()
  if gpus < 2:
    pytest.skip(f"needs 2 or more GPUs; this machine has {gpus}")
  degrees = [t for t in (1, 2, 4, 8) if t <= gpus]
  check_degrees(tmp_path, rng, "cuda", "triton", degrees)


def test_llama_logits_same_at_tp_1_2_4(tmp_path, rng):
  # A real transformers model, its projections split by `parallelize`
  # (heads and MLP units over the ranks), the rest under the batch-invariant
  # mode: the logits have the same bits at 1, 2 and 4 ranks (gloo, CPU).
  seed = int(rng.integers(2**31))
  logits = {}
  for world in (1, 2, 4):
    out = tmp_path / f"llama{world}"
    out.mkdir()
    ranks = run_ranks(out, world, seed, "cpu", "xla", case="llama")
    for r in ranks[1:]:
      assert torch.equal(r["logits"], ranks[0]["logits"])
    logits[world] = ranks[0]["logits"]
  assert logits[1].abs().sum() > 0
  for world in (2, 4):
    assert_bitwise_equal(logits[world].numpy(), logits[1].numpy(),
                         f"{world} ranks vs 1")


def vocab_degrees(tmp_path, seed, device, impl, degrees):
  """The vocab-parallel results at each degree (rank 0's log-probs, entropy
  and d hidden, the same on every rank; d weight's shards joined)."""
  results = {}
  for world in degrees:
    out = tmp_path / f"vocab{world}"
    out.mkdir()
    ranks = run_ranks(out, world, seed, device, impl, case="vocab")
    for r in ranks[1:]:
      for name in ("logp", "entropy", "d_hidden"):
        assert torch.equal(r[name], ranks[0][name]), name
    results[world] = dict(ranks[0], d_weight=whole(ranks, "d_weight", 0))
  for world in degrees[1:]:
    for name, value in results[world].items():
      assert_bitwise_equal(value.float().numpy(),
                           results[degrees[0]][name].float().numpy(),
                           f"{name}: {world} ranks vs {degrees[0]}")
  return results[degrees[0]]


def test_vocab_parallel_logp_has_jitted_jax_bits_at_1_2_4_ranks(tmp_path, rng):
  # Megatron's vocab-parallel lm_head: each rank its rows of the weight, the
  # same hidden states; log-probs, entropy and both gradients equal at 1, 2
  # and 4 ranks (gloo) and to rlk_jax.linear_logp(vocab_chunks=8) jitted
  # with the whole weight. (JAX's un-jitted call runs op by op: XLA rounds
  # the entropy's exp/log glue otherwise there.) Pallas's kernels: each
  # degree is another program, and the XLA reference's cross-program bits
  # are not promised (docs/design.md).
  impl = "pallas"
  from tensor_parallel_worker import vocab_case
  seed = int(rng.integers(2**31))
  got = vocab_degrees(tmp_path, seed, "cpu", impl, [1, 2, 4])
  hidden, weight, targets, g_logp, g_ent = vocab_case(seed, "cpu",
                                                      torch.float32)
  mode = functools.partial(rlk_jax.linear_logp, vocab_chunks=8,
                           return_entropy=True, implementation=impl)

  @jax.jit
  def forward_and_grads(h, w, t, gl, ge):
    out, vjp = jax.vjp(lambda h, w: mode(h, w, t), h, w)
    return out, vjp((gl, ge))

  (logp, entropy), (dh, dw) = forward_and_grads(
      as_jax(hidden), as_jax(weight).T, jnp.asarray(targets.numpy()),
      as_jax(g_logp), as_jax(g_ent))
  for name, want in (("logp", logp), ("entropy", entropy), ("d_hidden", dh),
                     ("d_weight", dw.T)):
    assert_bitwise_equal(got[name].numpy(), np.asarray(want), name)
  assert np.isfinite(got["logp"].numpy()).all()


@pytest.mark.gpu
def test_vocab_parallel_logp_on_a_gpu_has_jitted_jax_bits(rng):
  # One process, the whole weight (group None), bf16, on each of linear_logp's
  # GPU implementations this device has.
  from rlk_jax import _linear_logp
  from tensor_parallel_worker import vocab_parallel_logp, vocab_case
  seed = int(rng.integers(2**31))
  hidden, weight, targets, g_logp, g_ent = vocab_case(seed, "cuda",
                                                      torch.bfloat16)
  to_jax = lambda t: jnp.asarray(t.detach().float().cpu().numpy()).astype(
      jnp.bfloat16 if t.dtype == torch.bfloat16 else jnp.float32)
  checked = []
  for impl in ("cuda_ffi", "triton", "pallas"):
    if _linear_logp.TABLE.unavailable_reason(impl, "gpu") is not None:
      continue
    got = vocab_parallel_logp(seed, "cuda", torch.bfloat16, impl, None)

    @jax.jit
    def forward_and_grads(h, w, t, gl, ge, impl=impl):
      mode = lambda h, w: rlk_jax.linear_logp(
          h, w, t, vocab_chunks=8, return_entropy=True, implementation=impl)
      out, vjp = jax.vjp(mode, h, w)
      return out, vjp((gl, ge))

    (logp, entropy), (dh, dw) = forward_and_grads(
        to_jax(hidden), to_jax(weight).T,
        jnp.asarray(targets.cpu().numpy()).astype(jnp.int32),
        to_jax(g_logp), to_jax(g_ent))
    for name, want in (("logp", logp), ("entropy", entropy),
                       ("d_hidden", dh), ("d_weight", dw.T)):
      assert_bitwise_equal(got[name].float().numpy(),
                           np.asarray(want.astype(jnp.float32)),
                           f"{impl}: {name}")
    checked.append(impl)
  assert checked


@pytest.mark.gpu
def test_vocab_parallel_logp_same_bits_at_every_tp_degree_on_gpus(tmp_path,
                                                                   rng):
  gpus = torch.cuda.device_count()
  if gpus < 2:
    pytest.skip(f"needs 2 or more GPUs; this machine has {gpus}")
  vocab_degrees(tmp_path, int(rng.integers(2**31)), "cuda", "pallas",
                [t for t in (1, 2, 4, 8) if t <= gpus])


def test_vocab_parallel_logp_names_a_split_it_cannot_take():
  hidden, weight = torch.ones(2, 8), torch.ones(12, 8)
  targets = torch.zeros(2, dtype=torch.int64)
  with pytest.raises(ValueError, match="vocab_chunks must be a power of two"):
    rlk_torch_bridge.vocab_parallel_linear_logp(hidden, weight, targets,
                                                vocab_chunks=3)
  with pytest.raises(ValueError, match="12 vocabulary rows.*vocab_chunks=8"):
    rlk_torch_bridge.vocab_parallel_linear_logp(hidden, weight, targets,
                                                vocab_chunks=8)


def test_from_linear_keeps_flags_and_draws_nothing():
  linear = torch.nn.Linear(16, 8)
  linear.weight.requires_grad_(False)
  state = torch.get_rng_state()
  row = rlk_torch_bridge.RowParallelDetLinear.from_linear(linear)
  col = rlk_torch_bridge.ColumnParallelDetLinear.from_linear(
      linear, gather_output=True)
  assert torch.equal(torch.get_rng_state(), state)
  assert not row.weight.requires_grad and row.bias.requires_grad
  assert col.gather_output and torch.equal(col.weight, linear.weight)
  with pytest.raises(ValueError, match="slice of the 32 input features is 32"):
    rlk_torch_bridge.RowParallelDetLinear(32, 8)(torch.ones(2, 16))


def test_parallelize_refuses_a_plan_it_cannot_apply():
  model = torch.nn.Sequential(torch.nn.Linear(8, 8))
  with pytest.raises(ValueError, match="no nn.Linear named"):
    rlk_torch_bridge.parallelize(model, None, {"q_proj": "column"})
  with pytest.raises(ValueError, match="unknown styles"):
    rlk_torch_bridge.parallelize(model, None, {"0": "diagonal"})



@pytest.mark.gpu
def test_llama_logits_same_at_every_tp_degree_on_gpus(tmp_path, rng):
  gpus = torch.cuda.device_count()
  if gpus < 2:
    pytest.skip(f"needs 2 or more GPUs; this machine has {gpus}")
  seed = int(rng.integers(2**31))
  logits = {}
  # Whole heads per rank: the model has 4 KV heads.
  for world in [t for t in (1, 2, 4) if t <= gpus]:
    out = tmp_path / f"llama{world}"
    out.mkdir()
    logits[world] = run_ranks(out, world, seed, "cuda", "triton",
                              case="llama")[0]["logits"]
    assert_bitwise_equal(logits[world].numpy(), logits[1].numpy(),
                         f"{world} ranks vs 1")
