"""rlk_torch_bridge as PyTorch operators: opcheck, gradcheck, torch.compile
(fullgraph, the bits of eager), torch.export, and the batch-invariant mode."""

import numpy as np
import pytest
import torch

import rlk_torch_bridge as rtb
from conftest import relative_error
from rlk_torch_bridge import _gemm_op, _logp_op, _pack_op


def randn(rng, shape, dtype=torch.float32, requires_grad=False):
  t = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(dtype)
  return t.requires_grad_(requires_grad)


def same_bits(x, y):
  assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape)
  width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
  x, y = x.detach(), y.detach()
  return torch.equal(x.view(width[x.element_size()]), y.view(width[y.element_size()]))


class Ops:
  """A backend that records the ops of the graphs torch.compile hands it."""

  def __init__(self):
    self.targets = []

  def __call__(self, gm, example_inputs):
    self.targets += [str(n.target) for n in gm.graph.nodes
                     if n.op == "call_function"]
    return gm.forward


# ---------------------------------------------------------------------------
# opcheck: schema, fake kernel, autograd registration, AOT dispatch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_det_mm(rng, dtype):
  a = randn(rng, (2, 13, 40), dtype, requires_grad=True)
  b = randn(rng, (40, 24), dtype, requires_grad=True)
  torch.library.opcheck(_gemm_op.OP, (a, b, False, False, dtype, None))
  w = randn(rng, (24, 40), dtype, requires_grad=True)
  torch.library.opcheck(_gemm_op.OP, (a, w, False, True, torch.float32, "xla"))
  at = randn(rng, (40, 13), dtype, requires_grad=True)  # a stored transposed
  torch.library.opcheck(_gemm_op.OP, (at, b, True, False, dtype, None))


def test_opcheck_pack_and_move_rows(rng):
  x = randn(rng, (3, 11, 5), requires_grad=True)
  mask = torch.from_numpy(rng.random((3, 11)) < 0.5)
  capacity = int(mask.sum()) + 2
  torch.library.opcheck(_pack_op.PACK, (x, mask, capacity, -1.0, True, None))
  packed, info = rtb.pack(x.detach(), mask, capacity=capacity)
  packed.requires_grad_()
  for to_packed, src in ((True, x), (False, packed)):
    torch.library.opcheck(_pack_op.MOVE, (src, info.buffer, [3, 11], capacity,
                                          to_packed, 0.5, None))


def test_opcheck_det_grouped_mm(rng):
  from rlk_torch_bridge import _grouped_mm_op
  a = randn(rng, (11, 16), torch.bfloat16, requires_grad=True)
  b = randn(rng, (3, 16, 8), torch.bfloat16, requires_grad=True)
  offs = torch.tensor([4, 4, 9], dtype=torch.int32)
  torch.library.opcheck(_grouped_mm_op.FORWARD,
                        (a, b, offs, torch.bfloat16, None))
  torch.library.opcheck(_grouped_mm_op.BACKWARD,
                        (a.detach(), b.detach(), offs,
                         randn(rng, (11, 8), torch.bfloat16), True, True,
                         None))


def test_opcheck_linear_logp(rng):
  hidden = randn(rng, (9, 16), requires_grad=True)
  weight = randn(rng, (30, 16), requires_grad=True)
  targets = torch.from_numpy(rng.integers(-1, 30, (9,)).astype(np.int32))
  temps = torch.from_numpy(rng.uniform(0.5, 1.5, 9).astype(np.float32))
  for with_entropy in (True, False):
    torch.library.opcheck(_logp_op.FORWARD, (hidden, weight, targets, temps,
                                             8, with_entropy, None))
    logp, entropy, lse = _logp_op.FORWARD(hidden.detach(), weight.detach(),
                                          targets, temps, 8, with_entropy,
                                          "xla")
    args = (hidden.detach(), weight.detach(), targets, temps, lse, entropy,
            randn(rng, (9,)), randn(rng, (9,)), 8, with_entropy, "xla")
    torch.library.opcheck(_logp_op.BACKWARD, args)
    torch.library.opcheck(_logp_op.ACCUMULATE,
                          (*args, torch.zeros(30, 16, dtype=torch.float32)))


# ---------------------------------------------------------------------------
# gradcheck: torch's own gradient check, float64 where the op takes it


def test_gradcheck_pack_and_unpack_float64(rng):
  mask = torch.from_numpy(rng.random((3, 7)) < 0.6)
  x = randn(rng, (3, 7, 2), torch.float64, requires_grad=True)
  capacity = int(mask.sum()) + 3
  assert torch.autograd.gradcheck(
      lambda x: rtb.pack(x, mask, capacity=capacity, fill_value=0.25)[0], (x,))
  _, info = rtb.pack(x.detach(), mask, capacity=capacity)
  packed = randn(rng, (capacity, 2), torch.float64, requires_grad=True)
  assert torch.autograd.gradcheck(
      lambda p: rtb.unpack(p, info, fill_value=-2.0), (packed,))
  assert torch.autograd.gradcheck(lambda x: rtb.pack(x, info)[0], (x,))


def test_float64_rows_keep_their_bits_with_a_fill(rng):
  mask = torch.from_numpy(rng.random((4, 9)) < 0.5)
  x = randn(rng, (4, 9, 3), torch.float64) * 1e300  # no float32 could hold these
  packed, info = rtb.pack(x, mask, capacity=int(mask.sum()) + 4, fill_value=7.5)
  n = int(mask.sum())
  assert torch.equal(packed[:n], x[mask]) and (packed[n:] == 7.5).all()
  assert torch.equal(rtb.unpack(packed, info, fill_value=-1.0),
                     torch.where(mask[..., None], x, -1.0))


@pytest.mark.filterwarnings("ignore:Input #")  # float32: det_gemm has no f64
def test_gradcheck_det_gemm_and_linear_logp_float32(rng):
  a = randn(rng, (5, 12), requires_grad=True)
  w = randn(rng, (7, 12), requires_grad=True)
  assert torch.autograd.gradcheck(
      lambda a, w: rtb.det_gemm(a, w, transpose_b=True), (a, w),
      eps=1e-2, atol=5e-3, rtol=1e-3)
  targets = torch.from_numpy(rng.integers(0, 7, (5,)))
  assert torch.autograd.gradcheck(
      lambda h, w: rtb.linear_logp(h, w, targets, return_entropy=True),
      (a, w), eps=1e-2, atol=5e-3, rtol=1e-2)


# ---------------------------------------------------------------------------
# torch.compile: one graph, rlk's operators in it, eager's bits


def _train_step(x, mask, model, lm_head, targets, capacity):
  packed, info = rtb.pack(x, mask, capacity=capacity)
  hidden = model(packed)
  logp = rtb.linear_logp(hidden, lm_head, rtb.pack(targets, info)[0])
  return rtb.unpack(logp, info), info.cu_seqlens


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_packed_train_step_has_eager_bits(rng, backend):
  torch.manual_seed(int(rng.integers(2**31)))
  # No biases: a bias's gradient is torch's own row sum, which torch.compile
  # may order differently from eager; this test is about rlk's operators.
  model = rtb.replace_linear(torch.nn.Sequential(
      torch.nn.Linear(24, 32, bias=False), torch.nn.ReLU(),
      torch.nn.Linear(32, 24, bias=False)))
  lm_head = randn(rng, (40, 24), requires_grad=True)
  x = randn(rng, (3, 10, 24), requires_grad=True)
  mask = torch.from_numpy(rng.random((3, 10)) < 0.6)
  targets = torch.from_numpy(rng.integers(0, 40, (3, 10)))
  g = randn(rng, (3, 10))
  capacity = 30

  def run(fn):
    for p in (x, lm_head, *model.parameters()):
      p.grad = None
    logp, cu = fn(x, mask, model, lm_head, targets, capacity)
    logp.backward(g)
    return [logp, cu, x.grad, lm_head.grad] + [p.grad for p in model.parameters()]

  recorder = Ops()
  compiled = torch.compile(_train_step, fullgraph=True,
                           backend=recorder if backend == "aot_eager" else backend)
  got, want = run(compiled), run(_train_step)
  for i, (u, v) in enumerate(zip(got, want)):
    assert same_bits(u, v), f"output {i} differs from eager"
  if backend == "aot_eager":  # Dynamo's graph holds the operators themselves
    assert {"rlk.pack.default", "rlk.move_rows.default", "rlk.det_mm.default",
            "rlk.linear_logp.default"} <= set(recorder.targets)


def test_compile_with_dynamic_row_counts(rng):
  w = randn(rng, (16, 8), requires_grad=True)
  f = torch.compile(lambda a: rtb.det_gemm(a, w), fullgraph=True,
                    dynamic=True, backend="aot_eager")
  for m in (3, 7, 12):
    a = randn(rng, (m, 16))
    assert same_bits(f(a), rtb.det_gemm(a, w))


def test_export_a_det_linear_model(rng):
  model = rtb.replace_linear(torch.nn.Sequential(
      torch.nn.Linear(12, 20), torch.nn.Tanh(), torch.nn.Linear(20, 4)))
  x = randn(rng, (6, 12))
  exported = torch.export.export(model, (x,))
  targets = {str(n.target) for n in exported.graph.nodes}
  assert "rlk.det_mm.default" in targets
  assert same_bits(exported.module()(x), model(x))


def test_errors_are_the_eager_ones_under_compile(rng):
  f = torch.compile(rtb.det_gemm, fullgraph=True, backend="aot_eager")
  with pytest.raises(Exception, match="inner dimensions differ"):
    f(randn(rng, (4, 8)), randn(rng, (9, 3)))


# ---------------------------------------------------------------------------
# batch_invariant_mode


def _mlp(rng, dtype):
  torch.manual_seed(int(rng.integers(2**31)))
  return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.SiLU(),
                             torch.nn.Linear(64, 16, bias=False)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mode_rows_alone_match_the_batch_and_follow_det_gemm(rng, dtype):
  model = _mlp(rng, dtype)
  x = randn(rng, (9, 32), dtype)
  with rtb.batch_invariant_mode():
    batch = model(x)
    for i in (0, 4, 8):
      assert same_bits(model(x[i:i + 1]), batch[i:i + 1])
  w0, b0 = model[0].weight, model[0].bias
  h = (rtb.det_gemm(x, w0, transpose_b=True, out_dtype=torch.float32)
       + b0.float()).to(dtype)
  want = rtb.det_gemm(torch.nn.functional.silu(h), model[2].weight,
                      transpose_b=True)
  assert same_bits(batch, want)


def test_mode_covers_every_product_form(rng):
  a3, b3 = randn(rng, (3, 5, 8)), randn(rng, (3, 8, 4))
  a, b, v = randn(rng, (5, 8)), randn(rng, (8, 4)), randn(rng, (8,))
  bias, bias3 = randn(rng, (4,)), randn(rng, (3, 5, 4))
  calls = {
      "matmul": lambda: torch.matmul(a, b), "@": lambda: a @ b,
      "Tensor.mm": lambda: a.mm(b), "mm": lambda: torch.mm(a, b),
      "matmul nd": lambda: torch.matmul(a3, b), "matvec": lambda: a @ v,
      "vecmat": lambda: v @ b, "bmm": lambda: torch.bmm(a3, b3),
      "matmul batched": lambda: a3 @ b3,
      "addmm": lambda: torch.addmm(bias, a, b),
      "addmm scaled": lambda: torch.addmm(bias, a, b, beta=0.5, alpha=2.0),
      "baddbmm": lambda: torch.baddbmm(bias3, a3, b3),
      "linear": lambda: torch.nn.functional.linear(a, b.T.contiguous(), bias),
  }
  for name, call in calls.items():
    plain = call()
    recorder = Ops()
    with rtb.batch_invariant_mode():
      compiled = torch.compile(call, fullgraph=True, backend=recorder)
      eager, traced = call(), compiled()
    assert torch.allclose(eager, plain, rtol=1e-5, atol=1e-4), name
    assert same_bits(eager, traced), name
    assert "rlk.det_mm.default" in recorder.targets, name
    assert not {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"
                } & set(recorder.targets), name


def test_mode_takes_mean_over_the_last_dim_and_says_what_it_leaves(rng):
  x = randn(rng, (7, 5, 48), requires_grad=True)
  recorder = Ops()
  with rtb.batch_invariant_mode():
    kept = x.mean(-1, keepdim=True)
    mean = torch.mean(x, dim=[-1])
    alone = torch.mean(x[2:3], 2)
    over_batch = x.mean(0)  # not a row's reduction: torch's, nothing said
    traced = torch.compile(lambda: x.mean(-1), fullgraph=True,
                           backend=recorder)()
  assert same_bits(kept.squeeze(-1), mean) and same_bits(alone, mean[2:3])
  assert same_bits(traced, mean) and "rlk.det_row_mean.default" in recorder.targets
  want = x.detach().double().mean(-1)
  assert relative_error(mean, want) < 1e-6
  assert same_bits(over_batch, x.mean(0))
  mean.sum().backward()
  assert torch.equal(x.grad, torch.full_like(x, 1 / 48))
  f64 = torch.from_numpy(rng.standard_normal((3, 4)))
  with pytest.warns(rtb.BatchInvariantFallthrough,
                    match=r"mean \(torch.float64 on cpu\) to torch"):
    with rtb.batch_invariant_mode():
      f64.mean(-1)
  assert any(name.endswith("mean") and reason == "torch.float64 on cpu"
             for name, reason in rtb.fallthroughs())


def test_mode_makes_an_hf_style_decoder_batch_invariant(rng):
  # RMSNorm (a mean over the last dim), rotary embedding, attention written
  # out (q @ kᵀ, softmax, @ v) and a gated MLP: a sequence's logits alone
  # and in batches of 2 to 64 are the same bits.
  from hf_decoder import decoder, logits
  model = decoder(96, int(rng.integers(2**31)), hidden=32, n_heads=2,
                  n_layers=2, ffn=64)
  ids = torch.from_numpy(rng.integers(0, 96, (64, 12)))
  with torch.no_grad():
    with rtb.batch_invariant_mode():
      full = logits(model, ids)
      for b in (2, 5, 17):
        assert same_bits(logits(model, ids[:b]), full[:b]), f"batch {b}"
      for i in (0, 31, 63):
        assert same_bits(logits(model, ids[i:i + 1]), full[i:i + 1]), f"row {i}"
    plain = logits(model, ids)
  err = relative_error(full, plain)
  assert err < 1e-5, err


def test_mode_gradients_and_out_argument(rng):
  a = randn(rng, (6, 10), requires_grad=True)
  w = randn(rng, (4, 10), requires_grad=True)
  g = randn(rng, (6, 4))
  with rtb.batch_invariant_mode():
    torch.nn.functional.linear(a, w).backward(g)
    out = torch.empty(6, 4)
    torch.mm(a.detach(), w.detach().T, out=out)
  da, dw = a.grad.clone(), w.grad.clone()
  a.grad = w.grad = None
  rtb.det_gemm(a, w, transpose_b=True).backward(g)
  assert same_bits(da, a.grad) and same_bits(dw, w.grad)
  assert same_bits(out, rtb.det_gemm(a.detach(), w.detach(), transpose_b=True))


def test_mode_leaves_other_dtypes_to_torch_and_nests(rng):
  ints = torch.from_numpy(rng.integers(-5, 5, (3, 4)))
  x = randn(rng, (4, 6))
  recorder = Ops()
  with rtb.batch_invariant_mode():
    assert torch.equal(ints @ ints.T,
                       torch.from_numpy(ints.numpy() @ ints.numpy().T))
    with rtb.batch_invariant_mode():
      inner = x.T @ x
    after_inner = torch.compile(lambda: x.T @ x, fullgraph=True, backend=recorder)()
  assert same_bits(inner, after_inner)
  assert "rlk.det_mm.default" in recorder.targets


def test_mode_is_exception_safe_and_switchable(rng):
  x = randn(rng, (4, 6))
  with pytest.raises(RuntimeError, match="boom"):
    with rtb.batch_invariant_mode():
      raise RuntimeError("boom")
  recorder = Ops()
  torch.compile(lambda: x.T @ x, fullgraph=True, backend=recorder)()
  assert "rlk.det_mm.default" not in recorder.targets  # the mode is off again
  assert not rtb.is_enabled()
  rtb.enable()
  try:
    assert rtb.is_enabled()
    assert same_bits(x @ x.T, rtb.det_gemm(x, x.T.contiguous()))
  finally:
    rtb.disable()
  assert not rtb.is_enabled()
  recorder = Ops()
  torch.compile(lambda: x.T @ x, fullgraph=True, backend=recorder)()
  assert "rlk.det_mm.default" not in recorder.targets


def test_mode_takes_operands_named_by_keyword(rng):
  # Bloom's alibi.baddbmm(batch1=..., batch2=...) and the like: the same
  # products as positional calls.
  a3, b3, bias3 = randn(rng, (3, 5, 8)), randn(rng, (3, 8, 4)), randn(rng, (3, 5, 4))
  a, b, w = randn(rng, (5, 8)), randn(rng, (8, 4)), randn(rng, (6, 8))
  pairs = {
      "Tensor.baddbmm": (lambda: bias3.baddbmm(batch1=a3, batch2=b3, beta=0.5),
                         lambda: bias3.baddbmm(a3, b3, beta=0.5)),
      "baddbmm": (lambda: torch.baddbmm(input=bias3, batch1=a3, batch2=b3),
                  lambda: torch.baddbmm(bias3, a3, b3)),
      "addmm": (lambda: torch.addmm(b[0], mat1=a, mat2=b),
                lambda: torch.addmm(b[0], a, b)),
      "linear": (lambda: torch.nn.functional.linear(input=a, weight=w),
                 lambda: torch.nn.functional.linear(a, w)),
      "mm": (lambda: torch.mm(a, mat2=b), lambda: torch.mm(a, b)),
      "matmul": (lambda: torch.matmul(input=a3, other=b3),
                 lambda: torch.matmul(a3, b3)),
      "mean": (lambda: torch.mean(a3, dim=-1, keepdim=True),
               lambda: torch.mean(a3, -1, True)),
  }
  with rtb.batch_invariant_mode():
    for name, (named, positional) in pairs.items():
      assert same_bits(named(), positional()), name
    linear = pairs["linear"][0]()
  assert same_bits(linear, rtb.det_gemm(a, w, transpose_b=True))


def test_mode_outputs_can_be_modified_in_place_in_training(rng):
  # Falcon's `mlp_output += attention_output`, Gemma 3n's `x *= scale` on a
  # linear's output: det_mm's result must not be a view made inside its
  # autograd function (autograd forbids modifying one in place).
  x = randn(rng, (2, 3, 8), requires_grad=True)
  w = randn(rng, (5, 8), requires_grad=True)
  z = randn(rng, (2, 3, 5))
  g = randn(rng, (2, 3, 5))

  def step(in_place):
    with rtb.batch_invariant_mode():
      y = torch.nn.functional.linear(x, w)
      if in_place:
        y += z
        y *= 2.0
      else:
        y = (y + z) * 2.0
      y.backward(g)
    grads = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    return y.detach(), grads

  y_in, (dx_in, dw_in) = step(True)
  y_out, (dx_out, dw_out) = step(False)
  assert same_bits(y_in, y_out)
  assert same_bits(dx_in, dx_out) and same_bits(dw_in, dw_out)


@pytest.mark.parametrize("stored", ["[E, K, N]", "[E, N, K]"])
def test_mode_runs_grouped_mm_one_det_gemm_per_expert(rng, stored):
  # A mixture of experts' torch._grouped_mm (transformers 5's default
  # experts): a row's output is its own expert's det_gemm row whatever the
  # other experts' row counts; gradients are each expert's det_gemm ones;
  # compiled, one rlk::det_grouped_mm call.
  k, n, sizes = 64, 24, (5, 0, 9, 3)
  e = len(sizes)
  a = randn(rng, (sum(sizes) + 2, k), torch.bfloat16, requires_grad=True)
  if stored == "[E, K, N]":
    b_leaf = randn(rng, (e, k, n), torch.bfloat16, requires_grad=True)
    b = b_leaf
  else:  # transformers' transposed experts: [E, N, K] viewed as [E, K, N]
    b_leaf = randn(rng, (e, n, k), torch.bfloat16, requires_grad=True)
    b = b_leaf.transpose(1, 2)
  ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
  g = randn(rng, (a.shape[0], n), torch.bfloat16)
  with rtb.batch_invariant_mode():
    out = torch._grouped_mm(a, b, offs=ends)
    out.backward(g)
  da, db = a.grad.clone(), b_leaf.grad.clone()
  a.grad = b_leaf.grad = None
  pieces, start = [], 0
  for i, end in enumerate(ends.tolist()):
    pieces.append(rtb.det_gemm(a[start:end], b[i].contiguous()))
    start = end
  want = torch.cat(pieces + [torch.zeros(2, n, dtype=torch.bfloat16)])
  assert same_bits(out, want)
  want.backward(g)
  assert same_bits(da, a.grad) and same_bits(db, b_leaf.grad)
  ref = torch.cat([a[s:t].double() @ b[i].double() for i, (s, t) in enumerate(
      zip([0, *ends.tolist()[:-1]], ends.tolist()))])
  assert relative_error(out[:ref.shape[0]], ref) < 1e-2
  # Expert 2's rows alone: the same bits.
  alone = torch.tensor([0, 0, 9, 9], dtype=torch.int32)
  with rtb.batch_invariant_mode():
    got = torch._grouped_mm(a[5:14].detach(), b.detach(), offs=alone)
    recorder = Ops()
    traced = torch.compile(lambda: torch._grouped_mm(a.detach(), b.detach(),
                                                     offs=ends),
                           fullgraph=True, backend=recorder)()
  assert same_bits(got, out[5:14])
  assert same_bits(traced, out)
  assert "rlk.det_grouped_mm.default" in recorder.targets


def test_det_grouped_mm_names_bad_shapes():
  from rlk_torch_bridge._grouped_mm_op import det_grouped_mm
  a = torch.randn(6, 8).bfloat16()
  b = torch.randn(3, 8, 4).bfloat16()
  with pytest.raises(RuntimeError, match=r"offs \(2,\)"):
    det_grouped_mm(a, b, torch.tensor([2, 6], dtype=torch.int32),
                   torch.bfloat16, None)
  with pytest.raises(RuntimeError, match=r"b \(3, 7, 4\)"):
    det_grouped_mm(a, torch.randn(3, 7, 4).bfloat16(),
                   torch.tensor([2, 4, 6], dtype=torch.int32),
                   torch.bfloat16, None)
