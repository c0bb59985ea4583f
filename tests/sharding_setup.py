"""What the sharded checks run on: 8 host devices in CI (a 4x2 mesh) or the
GPUs of a multi-GPU machine (with 2, a 2x1 and a 1x2 mesh, so data and model
axes are each really split once), and which implementations take part
there (``cuda_ffi`` on an SM90 machine, with bf16 operands: it takes no
other input dtype)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import cuda_ffi

DEVICES = jax.device_count()
assert DEVICES >= 2 and DEVICES % 2 == 0, (
    f"the sharded checks need an even number (>= 2) of devices, not {DEVICES}: "
    "run with --xla_force_host_platform_device_count=8 or on 2+ GPUs")
MESH_SHAPES = [(DEVICES // 2, 2)] if DEVICES >= 4 else [(2, 1), (1, 2)]
ONE = jax.devices()[0]
IMPLEMENTATIONS = ["xla", "pallas"] + (
    ["cuda_ffi"] if cuda_ffi.unavailable_reason(jax.default_backend()) is None else [])


@pytest.fixture(params=MESH_SHAPES, ids=lambda s: f"mesh{s[0]}x{s[1]}")
def mesh(request):
  return Mesh(np.array(jax.devices()).reshape(request.param), ("data", "model"))


def operand_dtype(impl):
  return jnp.bfloat16 if impl == "cuda_ffi" else jnp.float32


def put(mesh, x, *spec):
  return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def single(x):
  return jax.device_put(x, ONE)
