"""rlk ops in sharded jit programs. The checks need several devices, fixed
when JAX starts, so they run in a child pytest: with 8 host (CPU) devices
everywhere, and on the real GPUs of a multi-GPU machine."""

import os
import subprocess
import sys

import jax
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKS = ["sharded_gemm_logp_checks.py", "sharded_pack_checks.py",
          "sharded_batch_invariant_checks.py", "sharded_tree_checks.py"]


def run_checks(checks, env):
  done = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       os.path.join(HERE, checks)],
      cwd=os.path.dirname(HERE), env=env, capture_output=True, text=True,
      timeout=900)
  assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
  assert " passed" in done.stdout and "failed" not in done.stdout
  print(done.stdout[-3000:])


@pytest.mark.parametrize("checks", CHECKS)
def test_sharded_checks_on_8_host_devices(checks):
  run_checks(checks, dict(
      os.environ, JAX_PLATFORMS="cpu",
      XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                 " --xla_force_host_platform_device_count=8").strip()))


@pytest.mark.gpu
@pytest.mark.parametrize("checks", CHECKS)
def test_sharded_checks_on_gpus(checks):
  gpus = jax.device_count() if jax.default_backend() == "gpu" else 0
  if gpus < 2:
    pytest.skip(f"needs 2 or more GPUs; this machine has {gpus}")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  run_checks(checks, dict(env, XLA_PYTHON_CLIENT_PREALLOCATE="false"))
