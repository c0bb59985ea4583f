"""linear_logp's torch route against the fused log-prob kernels RL users run
today, timed side by side on the same operands: forward, forward+backward
of ``-(logp · adv).sum()``, the peak memory beyond the inputs, each against
the measured product floor (cuBLAS's dense ``hidden @ Wᵀ`` in the same run),
and each one's invariance count (rows alone against the same rows in the
batch, with their own targets).

``rlk`` asks for log-probs only (no entropy work); ``rlk_entropy`` asks for
the entropy too and puts it in the loss, as verl's kernel always computes
it. Peers, where they import (the device carries them; none is a
dependency):
``liger_flce`` (Liger's ``LigerFusedLinearCrossEntropyFunction``,
reduction "none", log-prob = -loss), ``liger_ppo`` (the verl-compatible op
Liger dispatches to off its CuTe-DSL SM90 kernel:
``_FusedLinearPPOFallbackFunction``), ``liger_scaled_sm90`` (that CuTe-DSL
kernel, where ``nvidia-cutlass-dsl`` is installed), ``verl``
(``verl.utils.kernel.linear_cross_entropy``), ``torch_dense``
(``log_softmax`` over the full f32 logits) and ``torch_compiled_chunks``
(``torch.compile`` of a loop over 1024-row chunks).
"""

from __future__ import annotations

import math

from benchmarks import harness
from benchmarks.harness import Row

BENCH = "logp"
CHUNK_ROWS = 1024
# Products a forward+backward runs, for its floor: rlk, verl and Liger's PPO
# op recompute the logits in the backward; Liger's FLCE and dense torch keep
# what the forward made.
PRODUCTS_FWD_BWD = {"rlk": 4, "rlk_entropy": 4, "verl": 4, "liger_ppo": 4,
                    "liger_scaled_sm90": 4}
ENTROPY_COEF = 0.01


def _peers(torch):
  """(peers by name, {name: why it is missing})."""
  import rlk_torch_bridge as rtb
  def rlk_entropy(h, w, t):  # the entropy asked for and in the loss, as verl's
    logp, entropy = rtb.linear_logp(h, w, t, return_entropy=True)
    return logp + ENTROPY_COEF * entropy

  peers = {"rlk": lambda h, w, t: rtb.linear_logp(h, w, t),
           "rlk_entropy": rlk_entropy}
  missing = {}
  try:
    from liger_kernel.ops.fused_linear_cross_entropy import (
        LigerFusedLinearCrossEntropyFunction as flce)
    peers["liger_flce"] = lambda h, w, t: -flce.apply(
        h, w, t, None, None, -100, 0.0, 0.0, "none")[0]
  except ImportError as e:
    missing["liger_flce"] = repr(e)
  try:
    from liger_kernel.ops import fused_linear_scaled_cross_entropy as scaled
    peers["liger_ppo"] = lambda h, w, t: -scaled._FusedLinearPPOFallbackFunction.apply(
        h, w, t, 1.0, -100, False)
    try:
      scaled._load_sm90_function()
      peers["liger_scaled_sm90"] = lambda h, w, t: -(
          scaled.LigerFusedLinearScaledCrossEntropyFunction.apply(h, w, t))
    except ImportError as e:
      missing["liger_scaled_sm90"] = repr(e)
  except ImportError as e:
    missing["liger_ppo"] = repr(e)
  try:
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy
    peers["verl"] = lambda h, w, t: linear_cross_entropy(h, w, t, 1.0,
                                                         "none")[0]
  except ImportError as e:
    missing["verl"] = repr(e)

  def dense(h, w, t):
    logits = (h @ w.t()).float()
    return torch.log_softmax(logits, -1).gather(1, t[:, None])[:, 0]

  def chunk_rows(h, w, t):
    logits = (h @ w.t()).float()
    return logits.gather(1, t[:, None])[:, 0] - torch.logsumexp(logits, -1)

  compiled = torch.compile(chunk_rows)

  def chunks(h, w, t):
    return torch.cat([compiled(h[i:i + CHUNK_ROWS], w, t[i:i + CHUNK_ROWS])
                      for i in range(0, h.shape[0], CHUNK_ROWS)])

  peers["torch_dense"] = dense
  peers["torch_compiled_chunks"] = chunks
  return peers, missing


def _peak_gib(torch, fn) -> float:
  torch.cuda.synchronize()
  torch.cuda.empty_cache()
  base = torch.cuda.memory_allocated()
  torch.cuda.reset_peak_memory_stats()
  fn()
  torch.cuda.synchronize()
  return (torch.cuda.max_memory_allocated() - base) / 2**30


def _rows_differing(torch, f, h, w, t) -> str:
  """Rows whose log-prob alone (windows of 1, 7 and 58 rows) differs in any
  bit from the same row in the whole batch; a window the peer cannot run
  is named, not counted (verl's kernel does not compile for one row on
  Triton 3.6: its epilogue calls ``.to`` on the row count, which Triton
  specializes to a constant when it is 1)."""
  bits = lambda x: x.float().view(torch.int32)
  full = bits(f(h, w, t))
  n, differ, failed = h.shape[0], 0, []
  for r0, r1 in ((0, 1), (5, 12), (n // 2, min(n, n // 2 + 58))):
    try:
      part = bits(f(h[r0:r1].contiguous(), w, t[r0:r1].contiguous()))
    except Exception as e:  # noqa: BLE001 - reported with the count
      failed.append(f"{r1 - r0} rows: {type(e).__name__}")
      continue
    differ += int((part != full[r0:r1]).sum())
  return f"{differ}" + (f" (failed alone at {'; '.join(failed)})"
                        if failed else "")


def rows(shapes, iters: int = 3) -> list[Row]:
  torch = harness.torch_or_none()
  if torch is None or not torch.cuda.is_available():
    return []
  peers, missing = _peers(torch)
  out = [Row(BENCH, "torch peers", name, note=f"not run: {why}"[:200])
         for name, why in missing.items()]
  for n, hd, v in shapes:
    g = torch.Generator(device="cuda").manual_seed(n + hd + v)
    h = torch.randn(n, hd, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, hd, device="cuda", generator=g)
         / math.sqrt(hd)).bfloat16()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    adv = torch.randn(n, device="cuda", generator=g)
    case = f"torch N={n} H={hd} V={v} bf16"
    floor = harness.time_torch(lambda: h @ w.t(), [()], iters=iters)
    out.append(harness.progress(Row(
        BENCH, case, "cublas_product_floor", floor,
        tflops=2 * n * hd * v / floor / 1e9,
        note="hidden @ W.T, bf16 out: the floor of one product")))
    logits_gib = n * v * 4 / 2**30
    for name, f in peers.items():
      if name == "torch_dense" and logits_gib > 24:
        out.append(Row(BENCH, case, name,
                       note=f"skipped: {logits_gib:.0f} GiB of f32 logits"))
        continue
      hg, wg = h.detach().requires_grad_(), w.detach().requires_grad_()

      def step():
        hg.grad = wg.grad = None
        (-(f(hg, wg, t).float() * adv).sum()).backward()

      try:
        with torch.no_grad():
          fwd = harness.time_torch(lambda: f(h, w, t), [()], iters=iters)
          fwd_gib = _peak_gib(torch, lambda: f(h, w, t))
          differ = _rows_differing(torch, f, h, w, t)
        both = harness.time_torch(step, [()], iters=iters)
        # Beyond the inputs and the previous step's gradients, which the
        # step frees first: what it holds besides its own two gradients.
        step_gib = _peak_gib(torch, step)
      except Exception as e:  # noqa: BLE001 - a peer's failure is reported
        out.append(Row(BENCH, case, name,
                       note=f"FAILED: {type(e).__name__}: {e}"[:200]))
        continue
      finally:
        torch.cuda.empty_cache()
      products = PRODUCTS_FWD_BWD.get(name, 3)
      out.append(harness.progress(Row(
          BENCH, case, name, fwd, floor_ms=floor, peak_mem_mb=fwd_gib * 1024,
          note=f"forward; rows differing alone vs batch: {differ}")))
      out.append(harness.progress(Row(
          BENCH, case + " fwd+bwd", name, both, floor_ms=products * floor,
          peak_mem_mb=step_gib * 1024,
          note=f"floor = {products} products; memory beyond inputs and "
               f"the two gradients")))
  return out
