"""rlk_torch_bridge._in_situ.Trial on the CPU: which config each of a
product's first calls runs, which it keeps from their times, and that
nothing waits on a timer. On the device the calls are det_gemm's own,
forward and backward (tests/test_torch_ops_gpu.py::
test_in_situ_trials_keep_every_calls_bits)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from rlk_jax import _gemm_tuning  # noqa: E402
from rlk_torch_bridge import _in_situ  # noqa: E402


class FakeTimer:
  """Reads `ms[config]` (one value per sample, in order) once `ready`."""

  def __init__(self, clock, config):
    self.clock, self.config = clock, config
    self.value = clock["ms"][config].pop(0)
    self.ended = False

  def end(self):
    self.ended = True

  def ready(self):
    return self.clock["ready"]

  def ms(self):
    assert self.ended
    return self.value


def _trial(configs, ms, samples=2):
  clock = {"ms": {c: list(v) for c, v in ms.items()}, "ready": False}
  launched, kept, hooked = [], [], []

  def launch(a, b, config):
    launched.append(config)
    return (a, b, config)

  def timer(a):  # started before the launch it times: its config is next
    return FakeTimer(clock, trial.order[len(trial.timed)])

  trial = _in_situ.Trial(configs, lambda best, t: kept.append((best, t)),
                         _gemm_tuning.pick, samples=samples, timer=timer)
  trial.on_keep.append(hooked.append)
  return (lambda a, b: trial.run(launch, a, b)), clock, launched, kept, hooked


def test_trial_rotates_then_keeps_the_fastest_best_sample():
  a, b = torch.ones(2), torch.ones(3)
  configs = ["pingpong_128x128", "pingpong_192x128_cluster_2x1",
             "cooperative_256x192"]
  trial, clock, launched, kept, hooked = _trial(configs, {
      configs[0]: [1.00, 0.98], configs[1]: [0.93, 0.99],
      configs[2]: [1.20, 0.96]})
  for _ in range(6):
    assert trial(a, b)[2] in configs
  assert launched == configs * 2
  # Timers not ready: later calls run the tuner's choice, nothing kept.
  assert trial(a, b)[2] == configs[0] and not kept
  clock["ready"] = True
  assert trial(a, b)[2] == configs[1]
  assert kept == [(configs[1], {configs[0]: 0.98, configs[1]: 0.93,
                                configs[2]: 0.96})]
  assert hooked == [configs[1]]
  for _ in range(3):
    assert trial(a, b)[2] == configs[1]
  assert len(kept) == 1


def test_a_trial_within_the_tie_keeps_the_tuners_choice():
  a = torch.ones(1)
  configs = ["cooperative_256x192", "pingpong_128x128"]
  trial, clock, _, kept, _ = _trial(configs, {configs[0]: [1.005],
                                           configs[1]: [1.0]}, samples=1)
  trial(a, a), trial(a, a)
  clock["ready"] = True
  trial(a, a)
  assert kept[0][0] == configs[0]
