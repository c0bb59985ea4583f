"""rlk's torch operators against torch's own, through the routes a PyTorch
user calls: eager (per-call cost at launch-bound sizes, and forward +
backward time at training sizes), torch.compile, CUDA-graph replay, and an
unmodified HF-style decoder's training tokens/s with the batch-invariant
mode on against off.

    python -m benchmarks.bench_torch_ops [--smoke] [--csv out.csv]

Implementations: ``torch`` (``x @ w.T`` / ``nn.Linear``, cuBLAS on GPUs),
``rlk`` (``rlk_torch_bridge.det_gemm`` / ``DetLinear``: eager CUDA calls on
the C++ autograd route ``rlk::det_mm_sm90``, traced ones the ``rlk::det_mm``
operator), ``rlk_python_autograd`` (the same call with the C++ route off:
``rlk::det_mm`` and its Python autograd; CUDA), ``rlk_batch_invariant_mode`` (an unmodified ``nn.Linear`` model
inside ``batch_invariant_mode()``). Notes give rlk's cost over torch's: added
microseconds per call where launch cost dominates, a time ratio where the
GPU does. Interleaved rounds, medians (``harness.time_interleaved``).
"""

from __future__ import annotations

import functools

from absl import app

from benchmarks import harness
from benchmarks.harness import Row

BENCH = "torch_ops"
PEER = "torch"


def run(smoke: bool) -> list[Row]:
  torch = harness.torch_or_none()
  if torch is None:
    return [Row(BENCH, "det_gemm", "rlk", note="torch not installed")]
  device = "cuda" if harness.on_gpu() and torch.cuda.is_available() else "cpu"
  dtype = torch.bfloat16 if device == "cuda" else torch.float32
  rows = _eager_cost_rows(torch, device, dtype, smoke)
  rows += _training_rows(torch, device, dtype, smoke)
  rows += _compiled_rows(torch, device, dtype, smoke)
  rows += _model_rows(torch, device, dtype, smoke)
  if device == "cuda":
    rows += _graph_rows(torch, dtype)
  return rows


def _linear_fns(torch):
  import rlk_torch_bridge as rtb
  fns = {PEER: lambda x, w: torch.nn.functional.linear(x, w),
         "rlk": lambda x, w: rtb.det_gemm(x, w, transpose_b=True),
         "rlk_batch_invariant_mode": functools.partial(_in_mode, torch, rtb)}
  if torch.cuda.is_available():
    fns["rlk_python_autograd"] = functools.partial(_python_route, rtb)
  return fns


def _in_mode(torch, rtb, x, w):
  """torch's own F.linear call inside the batch-invariant mode."""
  with rtb.batch_invariant_mode():
    return torch.nn.functional.linear(x, w)


def _python_route(rtb, x, w):
  """rtb.det_gemm with the C++ autograd route off (rlk::det_mm)."""
  from rlk_torch_bridge import _cpp_extension
  was = _cpp_extension.enabled()
  _cpp_extension.set_enabled(False)
  try:
    return rtb.det_gemm(x, w, transpose_b=True)
  finally:
    _cpp_extension.set_enabled(was)


def _interleaved(torch, calls: dict, args, iters):
  """{name: ms per call} of fn(*args) loops, interleaved."""
  return harness.time_interleaved(
      {name: harness.torch_batch(fn, [args]) for name, fn in calls.items()},
      iters=iters)


def _cost_rows(case, times, per_call_us: bool) -> list[Row]:
  rows = []
  for name, ms in times.items():
    note = ""
    if name != PEER:
      note = (f"+{(ms - times[PEER]) * 1e3:.1f} us per call over torch"
              if per_call_us else f"{ms / times[PEER]:.3f}x torch's time")
    rows.append(Row(BENCH, case, name, ms, note=note))
  return rows


def _fwd_bwd(fn):
  def step(x, w, g):
    fn(x, w).backward(g)
  return step


def _eager_cost_rows(torch, device, dtype, smoke):
  """Launch-bound sizes: what the Python route adds per call."""
  m, k, n = (16, 128, 128) if smoke else (16, 256, 256)
  x = torch.randn(m, k, device=device, dtype=dtype)
  w = torch.randn(n, k, device=device, dtype=dtype)
  fns = _linear_fns(torch)
  case = f"eager forward M={m} K={k} N={n} ({device})"
  rows = _cost_rows(case, _interleaved(torch, fns, (x, w), 100), True)
  xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
  g = torch.randn(m, n, device=device, dtype=dtype)
  steps = {name: _fwd_bwd(fn) for name, fn in fns.items()}
  case = f"eager forward+backward M={m} K={k} N={n} ({device})"
  return rows + _cost_rows(case, _interleaved(torch, steps, (xg, wg, g), 50),
                           True)


def _training_rows(torch, device, dtype, smoke):
  """Training sizes: the GPU's time, forward + backward."""
  shapes = ((64, 128, 192),) if smoke else (
      (1024, 3584, 4608), (4096, 3584, 4608), (1024, 3584, 3584),
      (2048, 4096, 14336), (1024, 18944, 3584))
  rows = []
  steps = {name: _fwd_bwd(fn) for name, fn in _linear_fns(torch).items()}
  for m, k, n in shapes:
    x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(n, k, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(m, n, device=device, dtype=dtype)
    case = f"eager forward+backward M={m} K={k} N={n} ({device})"
    rows += _cost_rows(case, _interleaved(torch, steps, (x, w, g),
                                          5 if smoke else 10), False)
  return rows


def _mlp(torch, device, dtype, h, f):
  return torch.nn.Sequential(
      torch.nn.Linear(h, f, bias=False), torch.nn.SiLU(),
      torch.nn.Linear(f, h, bias=False)).to(device=device, dtype=dtype)


def _compiled_rows(torch, device, dtype, smoke):
  """An MLP's forward + backward under torch.compile: nn.Linear, the same
  model with DetLinear, and the plain model inside batch_invariant_mode."""
  import rlk_torch_bridge as rtb
  m, h, f = (32, 64, 128) if smoke else (2048, 4096, 11008)
  backend = "aot_eager" if smoke else "inductor"
  torch.manual_seed(0)
  plain = _mlp(torch, device, dtype, h, f)
  swapped = rtb.replace_linear(_mlp(torch, device, dtype, h, f))
  x = torch.randn(m, h, device=device, dtype=dtype, requires_grad=True)
  g = torch.randn(m, h, device=device, dtype=dtype)

  def step(model):
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    return lambda: compiled(x).backward(g)

  plain_step, swapped_step = step(plain), step(swapped)
  mode_model = _mlp(torch, device, dtype, h, f)
  with rtb.batch_invariant_mode():
    mode_compiled = torch.compile(mode_model, fullgraph=True, backend=backend)
    mode_compiled(x).backward(g)  # traced with the mode on

  def mode_step():
    with rtb.batch_invariant_mode():
      mode_compiled(x).backward(g)

  calls = {PEER: plain_step, "rlk": swapped_step,
           "rlk_batch_invariant_mode": mode_step}
  times = harness.time_interleaved(
      {name: harness.torch_batch(fn, [()]) for name, fn in calls.items()},
      iters=3 if smoke else 10)
  case = f"torch.compile MLP {h}->{f}->{h} M={m} fwd+bwd ({backend}, {device})"
  return _cost_rows(case, times, False)


def _model_rows(torch, device, dtype, smoke):
  """An unmodified HF-style decoder (``examples/grpo_step_torch.py``'s, SDPA
  attention) training on 8 x 1024 tokens, eager: tokens/s of forward +
  backward with the batch-invariant mode on against off."""
  import rlk_torch_bridge as rtb
  from examples.grpo_step_torch import TinyDecoder
  b, s, vocab = (2, 16, 256) if smoke else (8, 1024, 32000)
  sizes = (dict(hidden=64, n_heads=4, n_layers=2, ffn=128) if smoke else
           dict(hidden=2048, n_heads=16, n_layers=4, ffn=5632))
  torch.manual_seed(0)
  model = TinyDecoder(vocab, **sizes).to(device=device, dtype=dtype)
  ids = torch.randint(0, vocab, (b, s), device=device)
  mask = torch.ones(b, s, dtype=torch.bool, device=device)

  def step():
    logits = model.lm_head(model(ids, mask))
    logits.float().logsumexp(-1).mean().backward()

  def mode_step():
    with rtb.batch_invariant_mode():
      step()

  times = harness.time_interleaved(
      {name: harness.torch_batch(fn, [()]) for name, fn in
       ((PEER, step), ("rlk_batch_invariant_mode", mode_step))},
      iters=2 if smoke else 5)
  case = (f"HF-style decoder {sizes['n_layers']}x{sizes['hidden']} "
          f"{b}x{s} tokens fwd+bwd (eager, {device})")
  tokens = b * s
  return [Row(BENCH, case, name, ms,
              note=f"{tokens / ms * 1e3:.0f} tokens/s" + (
                  "" if name == PEER else
                  f", {times[PEER] / ms:.3f}x torch's tokens/s"))
          for name, ms in times.items()]


def _graph_rows(torch, dtype):
  """Kernel against kernel: one product per CUDA-graph replay."""
  rows = []
  for m, k, n in ((16, 4096, 4096), (1024, 3584, 3584), (4096, 4096, 14336)):
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    times = harness.time_interleaved(
        {name: harness.torch_batch(fn, [(x, w)], graph=True)
         for name, fn in _linear_fns(torch).items()}, iters=50)
    rows += _cost_rows(f"CUDA graph replay forward M={m} K={k} N={n}", times,
                       False)
  return rows


if __name__ == "__main__":
  app.run(harness.bench_main(run))
