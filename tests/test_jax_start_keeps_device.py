"""JAX's GPU backend, started by whatever asks it something first, leaves
the last visible GPU current; in a rank of a multi-GPU job torch's later
launches would then go to another GPU than its tensors' (seen on two and
four H200s, 2026-11-28). Every bridge path that may be the first to ask JAX
must start it through ``_checks.start_jax``, which sets torch's device back.

On a CPU machine the move is simulated: a fake current device that asking
JAX for its devices moves to 1, as the real start does."""

import jax
import pytest
import torch

import cuda_ffi
from rlk_torch_bridge import _checks, _cpp_extension, _dlpack, _row_routes


@pytest.fixture
def jax_moves_the_device(monkeypatch):
  current = [0]
  monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
  monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
  monkeypatch.setattr(torch.cuda, "set_device",
                      lambda d: current.__setitem__(0, int(d)))
  real_devices, started = jax.devices, []

  def devices(*args, **kwargs):
    if not started:  # the backend's start leaves the last GPU current
      started.append(True)
      current[0] = 1
    return real_devices(*args, **kwargs)
  monkeypatch.setattr(jax, "devices", devices)
  monkeypatch.setattr(jax, "local_devices", lambda *a, **k: devices())
  # The library's availability check asks JAX (cuda_ffi.sm90_reason).
  monkeypatch.setattr(cuda_ffi, "unavailable_reason",
                      lambda *a, **k: (devices(), "simulated")[1])
  monkeypatch.setattr(_checks, "_JAX_STARTED", [])
  return current


def _row_kernel_check():
  _row_routes.library_kernel.cache_clear()
  try:
    _row_routes.library_kernel()
  finally:
    _row_routes.library_kernel.cache_clear()


def _extension_check():
  _cpp_extension._load.cache_clear()
  _cpp_extension.load()


def _dlpack_device_lookup():
  _dlpack._state.jax_device.clear()
  try:
    _dlpack._jax_device(torch.device("cuda", 0))
  except StopIteration:  # this machine's JAX has no GPU: after the start
    pass
  finally:
    _dlpack._state.jax_device.clear()


@pytest.mark.parametrize("first_asker", [
    _row_kernel_check, _extension_check, _dlpack_device_lookup,
    _checks.start_jax],
    ids=["row_kernel", "cpp_extension", "dlpack_device", "start_jax"])
def test_the_first_path_to_ask_jax_keeps_torchs_device(jax_moves_the_device,
                                                       first_asker):
  first_asker()
  assert _checks._JAX_STARTED  # the path started JAX through start_jax
  assert jax_moves_the_device[0] == 0


def test_the_simulation_moves_the_device_when_jax_is_asked_directly(
    jax_moves_the_device):
  # The check above can fail: asking JAX without start_jax moves it.
  jax.devices()
  assert jax_moves_the_device[0] == 1
