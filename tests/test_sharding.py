"""rlk ops in sharded jit programs: the checks need 8 devices, fixed when JAX
starts, so they run in a child pytest with 8 host (CPU) devices."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("checks", ["sharded_gemm_logp_checks.py",
                                    "sharded_pack_checks.py"])
def test_sharded_checks_on_8_host_devices(checks):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                        " --xla_force_host_platform_device_count=8").strip())
  done = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       os.path.join(HERE, checks)],
      cwd=os.path.dirname(HERE), env=env, capture_output=True, text=True,
      timeout=900)
  assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
  assert " passed" in done.stdout and "failed" not in done.stdout
