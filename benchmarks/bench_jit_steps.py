"""rlk's kernels inside whole jitted JAX programs: what a decode step and a
packed training step cost per product and beyond their kernels.

    python -m benchmarks.bench_jit_steps [--smoke] [--csv out.csv]

Cases:

* **decode step**: a small transformer's projections, 4 layers x 7 products
  (q, k, v, o, gate, up, down), each with its own weight, at M = 1, 16, 64
  rows; elementwise ops stand in for attention and the MLP's gate, so every
  product depends on the one before it, as in a real step.
* **packed training step**: pack a padded batch, 4 det_gemm layers,
  linear_logp on the packed rows, and the gradient of every weight.

Implementations:

* ``rlk_jit``: the step with rlk's ops (default implementations), jitted.
* ``xla_jit``: the same step in plain XLA ops (``jnp.dot``, a dense
  log-softmax, ``nonzero`` + ``take`` for the packing).
* ``..._no_cmdbuf``: the two above in a child process whose XLA runs
  without command buffers (``--xla_gpu_enable_command_buffer=``: XLA reads
  its flags once per process). GPU only.
* ``rlk_jit_donated`` (decode): ``rlk_jit`` called in a loop on its own
  output, donated, so every call sees the same buffer addresses (what a
  command buffer needs to replay without re-recording its rlk calls).
* ``rlk_torch_graph``: the same SM90 kernels, in the same order, replayed
  from one torch CUDA graph (the training step through the torch bridge's
  ops, its backward by torch's autograd): the launch-free reference a
  jitted program is judged against.

Notes: the decode step's time per product; each step's ratio to
``rlk_torch_graph``; the training step's time beyond the sum of its
kernels' device times (CUPTI, through torch.profiler) while steps run back
to back, and what a step costs more when the host waits on each one.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks import harness
from benchmarks.harness import Row

BENCH = "jit_steps"
PEER = "xla_jit"
LAYERS, PRODUCTS_PER_LAYER = 4, 7
TRAIN_ITERS = 5  # training steps per timed batch

CHILD_OUT = flags.DEFINE_string(
    "jit_steps_child_out", None, "Internal: time only the JAX "
    "implementations and write their rows as JSON to this path (the "
    "no-command-buffer child process).")

NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="


# ----------------------------------------------------------------------------
# The steps


def decode_step(gemm, x, layers, silu=jax.nn.silu):
  """4 layers of 7 products; `gemm(a, w)` is ``a @ w`` (JAX arrays, or
  torch tensors with torch's `silu`: the same products in the same order)."""
  for wq, wk, wv, wo, wg, wu, wd in layers:
    q, k, v = gemm(x, wq), gemm(x, wk), gemm(x, wv)
    x = x + gemm(q + k * v, wo)  # one token's attention, in spirit
    x = x + gemm(silu(gemm(x, wg)) * gemm(x, wu), wd)
  return x


def _rlk_gemm(a, w):
  import rlk_jax
  return rlk_jax.det_gemm(a, w)


def _xla_gemm(a, w):
  return jnp.dot(a, w, preferred_element_type=jnp.float32).astype(a.dtype)


def train_loss_torch(capacity: int, x, mask, targets, weights, head_vh):
  """`train_loss` with rlk's ops from torch (the bridge; the head as
  ``lm_head.weight``, ``[V, H]``): the same kernels, on torch's stream."""
  import torch
  import rlk_torch_bridge as rtb
  packed, info = rtb.pack(x, mask, capacity=capacity, checked=False)
  labels = rtb.pack(targets, info, fill_value=-100, checked=False)[0]
  h = packed
  for w in weights:
    h = torch.nn.functional.silu(rtb.det_gemm(h, w))
  logp = rtb.linear_logp(h, head_vh, labels)
  return -logp.sum() / (labels >= 0).sum().clamp(min=1)


def train_loss(rlk: bool, capacity: int, x, mask, targets, weights, head):
  """Mean negative log-prob of the packed targets after 4 layers."""
  import rlk_jax
  if rlk:
    packed, info = rlk_jax.pack(x, mask, capacity=capacity)
    labels = rlk_jax.pack(targets, info, fill_value=-100)[0]
  else:
    (where,) = jnp.nonzero(mask.reshape(-1), size=capacity, fill_value=0)
    valid = jnp.arange(capacity) < mask.sum()
    packed = jnp.take(x.reshape(-1, x.shape[-1]), where, axis=0)
    labels = jnp.where(valid, jnp.take(targets.reshape(-1), where), -100)
  h = packed
  for w in weights:
    h = jax.nn.silu(_rlk_gemm(h, w) if rlk else _xla_gemm(h, w))
  if rlk:
    logp = rlk_jax.linear_logp(h, head, labels)
  else:
    logits = jnp.dot(h, head, preferred_element_type=jnp.float32)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits),
                               jnp.maximum(labels, 0)[:, None], 1)[:, 0]
    logp = jnp.where(labels >= 0, logp, 0.0)
  return -logp.sum() / jnp.maximum((labels >= 0).sum(), 1)


# ----------------------------------------------------------------------------
# Sizes and inputs


def _sizes(smoke: bool) -> dict:
  if smoke:
    return dict(hidden=64, ffn=128, ms=(2,), batch=2, seq=16, vocab=96,
                density=0.5)
  return dict(hidden=2048, ffn=5632, ms=(1, 16, 64), batch=8, seq=1024,
              vocab=32000, density=0.5)


def _bf16(key, shape, scale=1.0):
  return (jax.random.normal(key, shape, jnp.float32) * scale).astype(
      jnp.bfloat16)


def _decode_inputs(sizes, m):
  h, f = sizes["hidden"], sizes["ffn"]
  shapes = [(h, h)] * 4 + [(h, f), (h, f), (f, h)]
  keys = iter(jax.random.split(jax.random.key(m), LAYERS * 7 + 2))
  layers = [[_bf16(next(keys), s, s[0] ** -0.5) for s in shapes]
            for _ in range(LAYERS)]
  xs = [_bf16(next(keys), (m, h)) for _ in range(2)]
  return [(x, layers) for x in xs]


def _train_inputs(sizes):
  rng = np.random.default_rng(0)
  b, s, h, v = sizes["batch"], sizes["seq"], sizes["hidden"], sizes["vocab"]
  keys = jax.random.split(jax.random.key(1), LAYERS + 2)
  mask = jnp.asarray(rng.random((b, s)) < sizes["density"])
  capacity = -(-int(mask.sum()) // 128) * 128
  args = (_bf16(keys[0], (b, s, h)), mask,
          jnp.asarray(rng.integers(0, v, (b, s)), jnp.int32),
          [_bf16(k, (h, h), h ** -0.5) for k in keys[2:]],
          _bf16(keys[1], (h, v), h ** -0.5))
  return capacity, args


# ----------------------------------------------------------------------------
# Timing


def _jax_rows(smoke: bool, suffix: str = "") -> list[Row]:
  """The JAX implementations of both cases (what the child process times
  without command buffers)."""
  sizes = _sizes(smoke)
  rows = []
  for m in sizes["ms"]:
    sets = _decode_inputs(sizes, m)
    case = _decode_case(sizes, m)
    rows += harness.interleaved_rows(BENCH, case, {
        f"rlk_jit{suffix}": lambda: harness.jax_batch(
            functools.partial(decode_step, _rlk_gemm), sets),
        f"xla_jit{suffix}": lambda: harness.jax_batch(
            functools.partial(decode_step, _xla_gemm), sets),
        f"rlk_jit_donated{suffix}": lambda: _donated_batch(
            functools.partial(decode_step, _rlk_gemm), *sets[0]),
    }, iters=20)
  capacity, args = _train_inputs(sizes)
  grads = {name: jax.grad(functools.partial(train_loss, rlk, capacity),
                          argnums=(3, 4))
           for name, rlk in ((f"rlk_jit{suffix}", True),
                             (f"xla_jit{suffix}", False))}
  # Built once (one compile each): the timed rounds and the profile share them.
  batches = {}
  train_rows = harness.interleaved_rows(
      BENCH, _train_case(sizes, capacity),
      {name: (lambda name=name, g=g: batches.setdefault(
          name, harness.jax_batch(g, [args])))
       for name, g in grads.items()}, iters=TRAIN_ITERS)
  if harness.on_gpu():
    for row in train_rows:
      if row.median_ms:
        row.note = _overhead_note(*batches[row.implementation])
  return rows + train_rows


def _donated_batch(step, x, layers):
  """`(run_batch, calls)`: the step called in a loop on its own output,
  donated, so the output takes the input's buffer and every call sees the
  same addresses (XLA re-records a command buffer's commands whose buffers
  moved; without donation each call's output is a new allocation). Each
  batch starts from a fresh copy of `x`, so values stay bounded."""
  jitted = jax.jit(step, donate_argnums=0)
  jax.block_until_ready(jitted(x + 0, layers))  # compile
  if harness.tune_traced_products():
    jax.block_until_ready(jitted(x + 0, layers))

  def batch(n):
    state = x + 0
    for _ in range(max(n, 1)):
      state = jitted(state, layers)
    jax.block_until_ready(state)

  return batch, 1


def _decode_case(sizes, m):
  return (f"decode step {LAYERS}x{PRODUCTS_PER_LAYER} products "
          f"H={sizes['hidden']} F={sizes['ffn']} M={m}")


def _train_case(sizes, capacity):
  return (f"packed training step {sizes['batch']}x{sizes['seq']} tokens "
          f"(capacity {capacity}) H={sizes['hidden']} V={sizes['vocab']} "
          f"{LAYERS} layers fwd+bwd")


def _overhead_note(run_batch, calls: int, steps: int = 200) -> str:
  """The training step's time beyond its kernels, from one CUPTI trace of
  `steps` steps run back to back (`harness.cupti_kernel_time`: wall and
  kernel time from the same stretch; set against kernels profiled apart
  from the timed rounds, the figure would measure the card instead: a
  power-capped H100 runs the same kernels 5-8% faster or slower with its
  recent load), and what a step costs more when the host waits on each."""
  seen = harness.cupti_kernel_time(run_batch, steps, calls)
  if seen is None:
    return "profiled: no kernels seen"
  wall_ms, kernel_ms = seen
  # A loop that waits on every step also pays the dispatch and the wait
  # once per step: one step alone against one of 16 back to back.
  alone, in_16 = (harness.time_batches(lambda n, k=k: [run_batch(k)
                                                       for _ in range(n)],
                                       iters=5) / k / calls for k in (1, 16))
  return (f"last {steps * calls // 2} of {steps * calls} steps back to back "
          f"(CUPTI): {wall_ms:.3f} ms wall, kernels {kernel_ms:.3f} ms, "
          f"overhead {(wall_ms / kernel_ms - 1) * 100:.1f}%; a step waited "
          f"on alone +{alone - in_16:.3f} ms")


def _torch_graph_rows(smoke: bool) -> list[Row]:
  """Both steps' SM90 kernels replayed from a torch CUDA graph."""
  torch = harness.torch_or_none()
  import rlk_jax
  if (torch is None or not harness.on_gpu()
      or rlk_jax.implementations("det_gemm")["cuda_ffi"] is not None):
    return []
  import rlk_torch_bridge as rtb
  sizes = _sizes(smoke)
  gemm = functools.partial(rtb.det_gemm, implementation="cuda_ffi")
  rows = []
  for m in sizes["ms"]:
    sets = [(torch.from_dlpack(x), [[torch.from_dlpack(w) for w in layer]
                                    for layer in layers])
            for x, layers in _decode_inputs(sizes, m)]
    step = functools.partial(decode_step, gemm,
                             silu=torch.nn.functional.silu)
    rows += harness.interleaved_rows(BENCH, _decode_case(sizes, m), {
        "rlk_torch_graph": lambda: harness.torch_batch(step, sets, graph=True)
    }, iters=20)
  capacity, (x, mask, targets, weights, head) = _train_inputs(sizes)
  params = [torch.from_dlpack(w).clone().requires_grad_() for w in weights]
  params.append(torch.from_dlpack(head).t().contiguous().requires_grad_())
  args = (torch.from_dlpack(x), torch.from_dlpack(mask),
          torch.from_dlpack(targets), params)

  def train_step(x, mask, targets, params):
    loss = train_loss_torch(capacity, x, mask, targets, params[:-1],
                            params[-1])
    return torch.autograd.grad(loss, params)

  rows += harness.interleaved_rows(BENCH, _train_case(sizes, capacity), {
      "rlk_torch_graph": lambda: harness.torch_batch(train_step, [args],
                                                     graph=True)
  }, iters=TRAIN_ITERS)
  return rows


def _child_rows(smoke: bool) -> list[Row]:
  """_jax_rows in a process whose XLA has no command buffers."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + NO_COMMAND_BUFFERS).strip()
  with tempfile.NamedTemporaryFile(suffix=".json") as out:
    cmd = [sys.executable, "-m", "benchmarks.bench_jit_steps",
           f"--jit_steps_child_out={out.name}",
           "--smoke" if smoke else "--nosmoke"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
      return [Row(BENCH, "no command buffers", "rlk_jit_no_cmdbuf",
                  note=f"FAILED: child exited {done.returncode}: "
                       f"{done.stderr.strip().splitlines()[-1:]}")]
    with open(out.name) as f:
      return [Row(**r) for r in json.load(f)]


def _annotate(rows: list[Row]) -> list[Row]:
  graph = {r.case: r.median_ms for r in rows
           if r.implementation == "rlk_torch_graph" and r.median_ms}
  for row in rows:
    if not row.median_ms:
      continue
    notes = [row.note] if row.note else []
    if row.case.startswith("decode step"):
      per_product = row.median_ms * 1e3 / (LAYERS * PRODUCTS_PER_LAYER)
      notes = [f"{per_product:.1f} us per product"]
    if row.case in graph and row.implementation != "rlk_torch_graph":
      notes.append(f"{row.median_ms / graph[row.case]:.2f}x rlk_torch_graph")
    row.note = "; ".join(notes)
  return rows


def run(smoke: bool) -> list[Row]:
  rows = _jax_rows(smoke)
  if harness.on_gpu():
    rows += _child_rows(smoke) + _torch_graph_rows(smoke)
  return _annotate(rows)


def _child_main():
  rows = _jax_rows(harness.smoke_mode(), suffix="_no_cmdbuf")
  with open(CHILD_OUT.value, "w") as f:
    json.dump([{k: getattr(r, k) for k in (
        "benchmark", "case", "implementation", "median_ms", "note")}
        for r in rows], f)


def main(argv):
  if CHILD_OUT.value:
    return _child_main()
  return harness.bench_main(run)(argv)


if __name__ == "__main__":
  app.run(main)
