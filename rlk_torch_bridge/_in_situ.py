"""Choosing a large det_gemm product's SM90 config by timing the caller's
own calls of it (the torch bridge's SM90 routes: ``_gemm_op`` and
its C++ route, both in ``_sm90``).

Why: the autotuner times each config alone, on its own operands and
stream. Inside a model's forward, between the elementwise kernels around
them, the same configs ran in another order: on the H200 (2026-11-27) the
tuner's picks took 33.4 ms of an 8-layer Llama's 32x512-token forward where
the configs fastest back to back took 29.6 ms (cuBLAS: 28.6). Every config
walks K in the same order into one f32 accumulator, so each gives the same
bits (the device tests prove it): which one runs a call is a speed decision
only, and the caller's own calls may decide it.

How: each product (M, N, K, layout, output dtype) has one :class:`Trial` a
process (:func:`trial`). Its first calls, from whichever route runs the
product, rotate through ``_gemm_tuning.trial_configs`` (the tuner's choice
first), ``SAMPLES`` calls each, a CUDA event pair on the call's stream
around each launch. Nothing waits on the events: once the last pair has
completed (polled at later calls), the fastest config by its best sample
(ties: the tuner's) is kept for the product, in this process and in the
on-disk tuning cache (with the times, as ``in_situ_ms``, so later
processes do not try again). Products under ``MIN_FLOP`` are not tried:
their calls' times are the host's as much as the kernel's. Nothing is tried
inside a CUDA-graph capture (the call runs the current choice) or when
``RLK_DET_GEMM_IN_SITU`` is ``0``.
"""

from __future__ import annotations

import os
import warnings
from typing import Callable

import torch

SAMPLES = 2
MIN_FLOP = 2e10


def enabled() -> bool:
  return os.environ.get("RLK_DET_GEMM_IN_SITU", "1") != "0"


class CudaTimer:
  """A started, stopped and later read pair of CUDA events on a stream."""

  def __init__(self, stream):
    self.stream = stream
    self.start = torch.cuda.Event(enable_timing=True)
    self.stop = torch.cuda.Event(enable_timing=True)
    self.start.record(stream)

  def end(self) -> None:
    self.stop.record(self.stream)

  def ready(self) -> bool:
    return self.stop.query()

  def ms(self) -> float:
    return self.start.elapsed_time(self.stop)


class Trial:
  """One product's trial: ``run(launch, a, b)`` calls ``launch(a, b,
  config)`` with each of `configs` in turn, `samples` calls each, timed;
  then, once every timer is ready, ``keep(best, times)`` (and each of
  `on_keep`) and `best` for every later call. `timer(a)` starts a timer on
  a's stream (tests pass their own)."""

  def __init__(self, configs: list[str], keep: Callable[[str, dict], None],
               pick: Callable, samples: int = SAMPLES,
               timer: Callable | None = None):
    self.order = [c for _ in range(samples) for c in configs]
    self.configs = list(configs)
    self.keep = keep
    self.pick = pick
    self.on_keep: list[Callable[[str], None]] = []
    self.timer = timer or (lambda a: CudaTimer(
        torch.cuda.current_stream(a.device)))
    self.timed: list[tuple[str, object]] = []
    self.best: str | None = None

  @property
  def current(self) -> str:
    return self.best or self.configs[0]

  def run(self, launch: Callable, a, b):
    if self.best is not None or _capturing(a):
      return launch(a, b, self.current)
    if len(self.timed) < len(self.order):
      config = self.order[len(self.timed)]
      timer = self.timer(a)
      out = launch(a, b, config)
      timer.end()
      self.timed.append((config, timer))
      return out
    if self.timed[-1][1].ready():  # a stream's events complete in order
      times: dict[str, float] = {}
      for config, timer in self.timed:
        t = timer.ms()
        times[config] = min(t, times.get(config, t))
      self.best = self.pick(times, self.configs)
      self.timed = []
      self.keep(self.best, times)
      for hook in self.on_keep:
        hook(self.best)
    return launch(a, b, self.current)


def _capturing(a) -> bool:
  return a.is_cuda and torch.cuda.is_current_stream_capturing()


_TRIALS: dict[tuple, Trial | None] = {}


def trial(m: int, n: int, k: int, transpose_a: bool, transpose_b: bool,
          out_f32: bool, chosen: str) -> Trial | None:
  """This process's trial of the product whose tuned choice is `chosen`
  (the same object for every route and call site), or None where there is
  nothing to try."""
  import cuda_ffi
  if not cuda_ffi.build_complete():
    # While the build still adds kernels: no trial (it would keep a choice
    # made among part of them); the plans are made again as kernels come.
    return None
  key = (m, n, k, transpose_a, transpose_b, out_f32)
  if key in _TRIALS:
    return _TRIALS[key]
  from rlk_jax import _gemm_tuning
  found = None
  if enabled() and 2.0 * m * n * k >= MIN_FLOP:
    configs = [c for c in _gemm_tuning.trial_configs(
        m, n, k, transpose_a=transpose_a, transpose_b=transpose_b,
        out_f32=out_f32, chosen=chosen)
               if launchable(m, n, k, transpose_a, transpose_b, out_f32, c)]
    if len(configs) >= 2:
      found = Trial(configs, lambda best, times: _keep(key, best, times),
                    _gemm_tuning.pick)
  if len(_TRIALS) >= 4096:
    _TRIALS.clear()
  _TRIALS[key] = found
  return found


def _keep(key, best, times) -> None:
  from rlk_jax import _gemm_tuning
  m, n, k, ta, tb, f32 = key
  try:
    _gemm_tuning.keep_choice(m, n, k, transpose_a=ta, transpose_b=tb,
                             out_f32=f32, config=best, in_situ_ms=times)
  except OSError as e:  # a read-only home: the choice stays this process's
    warnings.warn(f"rlk: cannot write the det_gemm tuning cache: {e}")


def launchable(m, n, k, transpose_a, transpose_b, out_f32, config) -> bool:
  """Whether the direct launch takes this config (it refuses one that needs
  a workspace)."""
  import cuda_ffi
  try:
    cuda_ffi.launcher(m, n, k, transpose_a=transpose_a,
                      transpose_b=transpose_b, out_f32=out_f32,
                      config=config)
  except RuntimeError:
    return False
  return True


def clear() -> None:
  """Forgets every trial (tests)."""
  _TRIALS.clear()
