"""rlk_torch_bridge's operators on an SM90 GPU (`pytest -m gpu`): CUDA-graph
capture and replay, torch.compile (Inductor, and its CUDA-graph mode) with
eager's bits, opcheck on CUDA tensors, and the batch-invariant mode."""

import pytest
import torch

import rlk_jax
import rlk_torch_bridge as rtb
from conftest import ON_GPU, relative_error
from rlk_torch_bridge import _gemm_op, _pack_op

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (ON_GPU and torch.cuda.is_available()),
                       reason="requires a CUDA GPU"),
    pytest.mark.skipif(ON_GPU and rlk_jax.implementations("det_gemm")["cuda_ffi"]
                       is not None, reason="requires the SM90 cuda_ffi library"),
]


def same_bits(x, y):
  width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
  assert x.shape == y.shape and x.dtype == y.dtype
  return torch.equal(x.detach().view(width[x.element_size()]),
                     y.detach().view(width[y.element_size()]))


def bf16(*shape, requires_grad=False):
  return torch.randn(*shape, device="cuda").to(torch.bfloat16).requires_grad_(
      requires_grad)


def captured(step):
  """(graph, outputs): `step()` run once eagerly and once on a side stream
  (the warm-up torch's CUDA-graph notes ask for), then recorded into a
  CUDA graph."""
  step()
  torch.cuda.synchronize()
  side = torch.cuda.Stream()
  side.wait_stream(torch.cuda.current_stream())
  with torch.cuda.stream(side):
    step()  # warm-up on the capture stream
  torch.cuda.current_stream().wait_stream(side)
  graph = torch.cuda.CUDAGraph()
  # thread_local: JAX's own threads may touch CUDA during the capture.
  with torch.cuda.graph(graph, capture_error_mode="thread_local"):
    outputs = step()
  return graph, outputs


def test_cuda_graph_replays_det_gemm_pack_and_unpack_with_eager_bits():
  a, w = bf16(300, 1024), bf16(768, 1024)
  mask = torch.rand(8, 64, device="cuda") < 0.5
  x = torch.randn(8, 64, 256, device="cuda")

  def step():
    packed, info = rtb.pack(x, mask)
    return (rtb.det_gemm(a, w, transpose_b=True), packed,
            rtb.unpack(packed * 2, info), info.cu_seqlens)

  graph, got = captured(step)
  # New inputs in the captured buffers: the replay must read them.
  a.copy_(bf16(300, 1024))
  x.copy_(torch.randn(8, 64, 256, device="cuda"))
  mask.copy_(torch.rand(8, 64, device="cuda") < 0.5)
  graph.replay()
  want = step()
  torch.cuda.synchronize()
  for g, e in zip(got, want):
    assert same_bits(g, e)


def test_cuda_graph_replays_linear_logp_forward_and_backward_with_eager_bits():
  # The SM90 route launches on torch's stream: a training step's head, loss
  # and gradients captured whole, replayed on new inputs.
  n, h, v = 200, 512, 4096 + 808
  hidden = bf16(n, h, requires_grad=True)
  weight = (torch.randn(v, h, device="cuda") * 0.05).to(torch.bfloat16)
  weight.requires_grad_()
  targets = torch.randint(0, v, (n,), device="cuda")

  def step():
    logp, entropy = rtb.linear_logp(hidden, weight, targets, temperature=0.8,
                                    chunk_size=2048, return_entropy=True)
    loss = -(logp.sum() + 0.01 * entropy.sum())
    return (logp, entropy,
            *torch.autograd.grad(loss, (hidden, weight)))

  graph, got = captured(step)
  with torch.no_grad():
    hidden.copy_(bf16(n, h))
    weight.copy_((torch.randn(v, h, device="cuda") * 0.05).to(torch.bfloat16))
  targets.copy_(torch.randint(0, v, (n,), device="cuda"))
  graph.replay()
  want = step()
  torch.cuda.synchronize()
  for i, (g, e) in enumerate(zip(got, want)):
    assert same_bits(g, e), f"output {i}"


def test_cuda_graph_capture_of_a_jax_route_is_a_clear_error():
  a, b = bf16(64, 256), bf16(256, 128)
  rtb.det_gemm(a, b, implementation="pallas")
  graph = torch.cuda.CUDAGraph()
  with pytest.raises(RuntimeError, match="a torch CUDA graph cannot capture"):
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
      rtb.det_gemm(a, b, implementation="pallas")
  x, mask = torch.randn(4, 32, 8, device="cuda"), torch.rand(4, 32, device="cuda") < 0.5
  with pytest.raises(RuntimeError, match="pass checked=False"):
    with torch.cuda.graph(torch.cuda.CUDAGraph(),
                          capture_error_mode="thread_local"):
      rtb.pack(x, mask, capacity=50)


def test_opcheck_on_cuda():
  a, b = bf16(70, 512, requires_grad=True), bf16(512, 264, requires_grad=True)
  torch.library.opcheck(_gemm_op.OP, (a, b, False, False, torch.bfloat16, None))
  torch.library.opcheck(_gemm_op.OP, (a, b, False, False, torch.float32, "pallas"))
  x = torch.randn(5, 40, 16, device="cuda", requires_grad=True)
  mask = torch.rand(5, 40, device="cuda") < 0.5
  torch.library.opcheck(_pack_op.PACK, (x, mask, 200, 0.0, True, None))


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_model_has_eager_bits(mode):
  torch.manual_seed(0)
  model = rtb.replace_linear(torch.nn.Sequential(
      torch.nn.Linear(1024, 2048, bias=False), torch.nn.ReLU(),
      torch.nn.Linear(2048, 1024, bias=False)).cuda().to(torch.bfloat16))
  mask = torch.rand(16, 128, device="cuda") < 0.6
  x = bf16(16, 128, 1024, requires_grad=True)

  def step(x, mask):
    packed, info = rtb.pack(x, mask, capacity=1536, checked=False)
    return rtb.unpack(model(packed), info)

  compiled = torch.compile(step, fullgraph=True, mode=mode)
  g = bf16(16, 128, 1024)
  results = []
  for fn in (compiled, compiled, step):  # twice: CUDA-graph mode replays
    for p in (x, *model.parameters()):
      p.grad = None
    out = fn(x, mask)
    out.backward(g)
    results.append([out.detach().clone(), x.grad.clone()]
                   + [p.grad.clone() for p in model.parameters()])
  for got in results[:2]:
    for i, (u, v) in enumerate(zip(got, results[2])):
      assert same_bits(u, v), f"output {i}"


def test_batch_invariant_mode_rows_alone_match_the_batch_on_the_gpu():
  torch.manual_seed(1)
  model = torch.nn.Sequential(
      torch.nn.Linear(1024, 3072), torch.nn.SiLU(),
      torch.nn.Linear(3072, 1024, bias=False)).cuda().to(torch.bfloat16)
  x = bf16(257, 1024)
  plain_rows_differ = 0
  for m in (1, 3, 64, 256):
    plain_rows_differ += not same_bits(model(x[:m]), model(x)[:m])
  with rtb.batch_invariant_mode():
    batch = model(x)
    # Compiled, Inductor fuses the bias add, the cast and SiLU without the
    # intermediate bf16 roundings eager makes (its own pointwise semantics):
    # the compiled model is batch-invariant in its own bits.
    compiled = torch.compile(model, fullgraph=True)
    compiled_batch = compiled(x)
    for m in (1, 3, 64):
      assert same_bits(compiled(x[:m]), compiled_batch[:m]), m
    for m in (1, 3, 64, 256):
      assert same_bits(model(x[:m]), batch[:m]), m
      assert same_bits(model(x[m:m + 1]), batch[m:m + 1]), m
    xs = x.detach().clone().requires_grad_()
    model(xs).float().square().sum().backward()
    dx_batch = xs.grad.clone()
    xs.grad = None
    model(xs[:5]).float().square().sum().backward()
    assert same_bits(xs.grad[:5], dx_batch[:5])
  print(f"plain torch: {plain_rows_differ} of 4 prefixes differed from the batch")


def test_mode_makes_an_hf_style_decoder_batch_invariant_on_the_gpu():
  # The decoder of the CPU test at bf16 on the GPU: with the mode a
  # sequence's logits alone and in batches of 2 to 64 are the same bits,
  # eager and compiled; without it cuBLAS's kernel choice moves with the
  # batch. Short sequences and a long FFN: cuBLAS splits K=14336 for up to
  # 128 rows and not at 256 (bench_invariance, H100), so 4-68 rows against
  # 256 differ (at hidden 512, FFN 1536 and 96-token rows they did not).
  from hf_decoder import decoder, logits
  model = decoder(2048, 3, hidden=1024, n_heads=4, n_layers=2,
                  ffn=14336).cuda().to(torch.bfloat16)
  ids = torch.randint(0, 2048, (64, 4), device="cuda")
  with torch.no_grad():
    plain = logits(model, ids)
    plain_differ = sum(not same_bits(logits(model, ids[:b]), plain[:b])
                       for b in (1, 2, 5, 17))
    assert plain_differ, "torch's own logits did not move with the batch"
    with rtb.batch_invariant_mode():
      full = logits(model, ids)
      for b in (1, 2, 5, 17):
        assert same_bits(logits(model, ids[:b]), full[:b]), f"batch {b}"
      for i in (3, 40, 63):
        assert same_bits(logits(model, ids[i:i + 1]), full[i:i + 1]), f"row {i}"
      # Compiled: the mode runs attention's batched products one det_gemm
      # per (sequence, head), so the traced graph grows with the batch
      # (64 x 4 x 2 per layer took Inductor minutes): 8 sequences, static
      # shapes, one compile per size.
      compiled = torch.compile(lambda i: logits(model, i), fullgraph=True,
                               dynamic=False)
      # (Against its own batch, not eager: Inductor fuses the norms'
      # elementwise chains without eager's intermediate bf16 roundings.)
      compiled_eight = compiled(ids[:8])
      for b in (1, 3):
        assert same_bits(compiled(ids[:b]), compiled_eight[:b]), f"compiled {b}"
  err = relative_error(full, plain)
  assert err < 2e-2, err  # bf16 logits of a 2-layer model: rounding only


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [1000, 4096, 151936])
def test_torch_softmax_over_the_last_dim_is_already_batch_invariant(dtype,
                                                                   width):
  # Why the mode leaves softmax and log_softmax to torch: their CUDA kernels
  # size blocks from the row length alone, so a row's bits never depend on
  # the number of rows.
  x = (torch.randn(512, width, device="cuda") * 4).to(dtype)
  for fn in (torch.softmax, torch.log_softmax):
    full = fn(x, dim=-1)
    for m in (1, 2, 7, 100):
      assert same_bits(fn(x[:m], dim=-1), full[:m]), (fn.__name__, m)
    assert same_bits(fn(x[300:301], dim=-1), full[300:301]), fn.__name__


def test_cpp_autograd_route_gives_the_python_routes_bits(monkeypatch):
  # rlk::det_mm_sm90 (the backward's products launched from C++) against
  # rlk::det_mm's Python autograd: the same kernels, so the same bits, for
  # N-D rows and both weight layouts; double backward is refused.
  from rlk_torch_bridge import _cpp_extension
  assert _cpp_extension.load()
  for a_shape, transpose_b in (((3, 100, 512), True), ((257, 512), False)):
    a = bf16(*a_shape)
    b = bf16(*((384, 512) if transpose_b else (512, 384)))
    g = bf16(*a_shape[:-1], 384)
    results = []
    for cpp in (True, False):
      monkeypatch.setattr(_cpp_extension, "_switch", [cpp])
      x, w = a.clone().requires_grad_(), b.clone().requires_grad_()
      out = rtb.det_gemm(x, w, transpose_b=transpose_b)
      assert ("DetMmSm90" in out.grad_fn.name()) == cpp, out.grad_fn.name()
      out.backward(g)
      results.append((out, x.grad, w.grad))
    for name, u, v in zip(("out", "da", "db"), *results):
      assert same_bits(u, v), (a_shape, transpose_b, name)
  monkeypatch.setattr(_cpp_extension, "_switch", [True])
  x, w = bf16(16, 512, requires_grad=True), bf16(512, 64, requires_grad=True)
  out = rtb.det_gemm(x, w)
  g = torch.ones_like(out, requires_grad=True)
  with pytest.raises(RuntimeError, match="double backward"):
    torch.autograd.grad(out, x, grad_outputs=g, create_graph=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16,
                                   torch.float16])
@pytest.mark.parametrize("k", [1, 7, 256, 2048, 4099, 5120])
def test_row_kernel_rows_alone_equal_their_batch_on_every_route(
    monkeypatch, dtype, k):
  # rlk::det_row_mean / det_row_sum on the cuda_ffi row kernel: through the
  # C++ extension and through ctypes the same bits; each row's bits its own
  # in any batch and any layout; the mean close to float64's.
  from rlk_torch_bridge import _cpp_extension, _row_routes
  assert _row_routes.library_kernel() and _cpp_extension.load()
  x = (torch.randn(37, k, device="cuda") * 3 + 1).to(dtype)
  for op, divisor in ((torch.ops.rlk.det_row_mean, k),
                      (torch.ops.rlk.det_row_sum, 1)):
    full = op(x)
    assert full.shape == (37,) and full.dtype == dtype
    assert same_bits(_row_routes.through_ctypes(x, divisor), full)
    for rows in ((3, 4), (0, 37), (36, 37), (5, 22)):
      assert same_bits(op(x[rows[0]:rows[1]]), full[rows[0]:rows[1]]), rows
    # Rows as a strided view of a wider tensor, and in a 3-D batch.
    wide = torch.cat([x, x[:, :1]], dim=1)[:, :k]
    assert same_bits(op(wide), full)
    assert same_bits(op(x.reshape(37, 1, k)), full.reshape(37, 1))
    want = x.double().sum(-1) / divisor
    assert relative_error(full, want) < (1e-6 if dtype == torch.float32
                                         else 8e-3), op


def test_cpp_route_takes_products_and_means_with_the_python_routes_bits(
    monkeypatch):
  # Under the aten route (what generate decodes on), a bias-free bf16
  # nn.Linear product and a last-dim mean that need no gradient run from
  # C++: after the Python route planned the product once, neither reaches
  # a Python handler, and the bits are the Python route's.
  from rlk_torch_bridge import batch_invariant as bi
  seen = {"linear": 0, "mean": 0}
  for name in seen:
    real = getattr(bi._Products, name)

    def counted(self, *args, _real=real, _name=name, **kwargs):
      seen[_name] += 1
      return _real(self, *args, **kwargs)
    monkeypatch.setattr(bi._Products, name, counted)
  mode = bi.BatchInvariantMode()
  # 13 x 3 rows: a product no other test plans.
  x, w, bias = bf16(13, 3, 2048), bf16(1536, 2048), bf16(1536)
  h = torch.randn(8, 1, 2048, device="cuda")
  with torch.no_grad():
    with mode.aten_route():
      first = torch.nn.functional.linear(x, w)
      assert seen["linear"] == 1  # planned by the Python route
      again = torch.nn.functional.linear(x, w)
      mean = h.mean(-1, keepdim=True)
      assert seen == {"linear": 1, "mean": 0}
      with torch.inference_mode():
        inference_mean = h.mean(-1)
      with_bias = torch.nn.functional.linear(x, w, bias)
      assert seen == {"linear": 2, "mean": 0}  # a bias: Python's
    python_route = rtb.det_gemm(x, w, transpose_b=True)
  assert same_bits(first, python_route) and same_bits(again, python_route)
  assert same_bits(mean, torch.ops.rlk.det_row_mean(h).unsqueeze(-1))
  assert same_bits(inference_mean, mean[..., 0])
  assert relative_error(with_bias, x.float() @ w.float().T + bias.float()) < 1e-2
  # A call that needs a gradient records one: the Python route's autograd.
  with mode.aten_route():
    out = torch.nn.functional.linear(x, w.clone().requires_grad_())
    m = h.clone().requires_grad_().mean(-1)
  assert out.grad_fn is not None and m.grad_fn is not None
  assert seen == {"linear": 3, "mean": 1}
  assert same_bits(out, python_route)
  # Left and entered again (the C++ route refuses a second entry while on).
  with torch.no_grad(), mode.aten_route():
    assert same_bits(torch.nn.functional.linear(x, w), python_route)
  assert seen == {"linear": 3, "mean": 1}


def test_in_situ_trials_keep_every_calls_bits(tmp_path, monkeypatch):
  # A large product's first calls, forward and both backward products,
  # rotate through the configs worth trying (rlk_torch_bridge._in_situ),
  # timed on the stream: every step gives the first step's bits, each
  # trial keeps its fastest in the tuning cache with its times, and the C++
  # route then takes the product on the kept configs.
  from rlk_jax import _gemm_tuning
  from rlk_torch_bridge import _gemm_op, _gemm_routes, _in_situ, _sm90
  monkeypatch.setattr(_gemm_tuning, "cache_path",
                      lambda device, build: tmp_path / "tuning.json")

  def forget():
    _gemm_tuning.clear_memo()
    _in_situ.clear()
    for plans in (_sm90._PLANS, _sm90._PENDING, _gemm_op._PLANS,
                  _gemm_routes._PLANS):
      plans.clear()
  forget()
  m, n, k = 8832, 3072, 2048  # 2 m n k = 1.1e11 >= MIN_FLOP
  a, w = bf16(m, k, requires_grad=True), bf16(n, k, requires_grad=True)
  g = bf16(m, n)

  def step():
    a.grad = w.grad = None
    out = rtb.det_gemm(a, w, transpose_b=True)
    out.backward(g)
    return out.detach(), a.grad, w.grad
  first = step()
  steps = [step() for _ in range(2 * _in_situ.SAMPLES * 6)]
  torch.cuda.synchronize()
  steps += [step() for _ in range(2)]  # the trials read their times
  products = _sm90._products(m, n, k, True, False)
  trials = [_in_situ._TRIALS[p] for p in products]
  assert all(t is not None and t.best in t.configs for t in trials)
  for got in steps:
    assert all(same_bits(x, y) for x, y in zip(got, first))
  for (pm, pn, pk, ta, tb, f32), t in zip(products, trials):
    entry = _gemm_tuning.tuned_entry(pm, pn, pk, transpose_a=ta,
                                     transpose_b=tb, out_f32=f32)
    assert entry["config"] == t.best
    assert set(entry["in_situ_ms"]) == set(t.configs)
  assert _gemm_op.cpp_run(a, w, True, torch.bfloat16, None) is not None
  assert not _sm90._PENDING
  with torch.no_grad():
    assert same_bits(rtb.det_gemm(a, w, transpose_b=True), first[0])
  want = a.double() @ w.double().T
  assert relative_error(first[0].double(), want) < 1e-2
  forget()


@pytest.mark.parametrize("k", [1, 300, 2048, 11008])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_jax_row_sum_is_the_torch_row_kernels_bits(k, dtype):
  # rlk_jax.reference.row_sum (what batch_invariant runs for a last-axis
  # sum) walks the cuda_ffi row kernel's order in jnp ops: jitted JAX on
  # the GPU = rlk::det_row_sum's f32 sums, bit for bit.
  import jax
  import numpy as np
  from rlk_jax import reference
  from rlk_torch_bridge._row_mean_op import det_row_sum
  x = (torch.randn(37, k, device="cuda") * 3).to(dtype)
  want = det_row_sum(x.float())  # f32 rows: the kernel's own f32 sums
  got = jax.jit(reference.row_sum)(jax.numpy.asarray(
      x.float().cpu().numpy()).astype(
          jax.numpy.bfloat16 if dtype == torch.bfloat16 else jax.numpy.float32))
  np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                want.cpu().numpy().view(np.uint32))


@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_triton_kernels_give_the_per_expert_products_bits(transposed):
  # rlk::det_grouped_mm on the grouped Triton kernels (one launch, groups
  # read on the device; the default on a GPU) against the Hopper det_gemm
  # on each expert's rows (implementation "cuda_ffi"): forward, dA and dB
  # bit for bit, at decode and training row counts.
  from rlk_torch_bridge._grouped_mm_op import det_grouped_mm
  k, n, experts = 2048, 768, 8
  for counts in ((3, 0, 1, 5, 2, 0, 4, 1), (700, 1, 0, 257, 64, 1500, 3, 99)):
    rows = sum(counts) + 5
    w = bf16(experts, n, k) / 32
    b = (w.transpose(1, 2) if transposed else
         w.transpose(1, 2).contiguous()).requires_grad_(True)
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    g = bf16(rows, n)
    got = {}
    for impl in ("triton", "cuda_ffi"):
      a = bf16(rows, k).requires_grad_(True) if impl == "triton" else \
          got["triton"][3].detach().clone().requires_grad_(True)
      b.grad = None
      out = det_grouped_mm(a, b, offs, torch.bfloat16, impl)
      out.backward(g)
      got[impl] = (out.detach(), a.grad, b.grad.clone(), a)
    for name, x, y in zip(("out", "da", "db"), got["triton"][:3],
                          got["cuda_ffi"][:3]):
      assert same_bits(x, y), (counts, name)
    ref = torch.cat([got["triton"][3][s:e].double() @ b[i].double()
                     for i, (s, e) in enumerate(zip(
                         [0] + offs[:-1].tolist(), offs.tolist()))])
    assert relative_error(got["triton"][0][:int(offs[-1])], ref) < 1e-2
