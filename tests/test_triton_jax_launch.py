"""triton_kernels.jax_launch: JAX's Triton calls through rlk's FFI handler.

On CPU: Triton's compiler makes the sm_90a cubin the handler launches, and
a jitted call lowers for CUDA to rlk's typed FFI call (API version 4, which
XLA may capture into a command buffer; not jax-triton's legacy custom call)
carrying that cubin and the launch's facts. On the GPU: every rlk kernel
JAX launches gives jax-triton's launch's bits, and a program with several
such calls runs as one command buffer."""

import os
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from conftest import ON_GPU

triton = pytest.importorskip("triton", reason="Triton wheels: Linux x86_64")
from triton.runtime.jit import JITFunction  # noqa: E402

from triton_kernels import jax_launch, row_gather  # noqa: E402


def compiled_kernel(kernel):
  """The kernel as Triton's compiler takes it: under TRITON_INTERPRET=1
  (the CPU tests) `@triton.jit` made an interpreted function."""
  return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)


GATHER = dict(n_out=100, width=256, FILL=0, BLOCK_ROWS=16, BLOCK_COLS=128)


def gather_compiled(**changes):
  constexprs = dict(GATHER, **changes)
  return jax_launch.compile_kernel(
      compiled_kernel(row_gather._gather_rows_kernel),
      ("*i32", "*bf16", "*bf16"), tuple(sorted(constexprs.items())), 4, 1, 90)


@pytest.mark.skipif(ON_GPU, reason="the CPU half; the GPU half is below")
class TestOnCpu:

  def test_compiles_a_hopper_cubin(self):
    c = gather_compiled()
    assert c.cubin[:4] == b"\x7fELF"
    assert c.name == "_gather_rows_kernel"
    assert c.num_warps == 4
    assert c.shared_bytes >= 0
    assert c.trailing_pointers in (0, 1, 2)
    # The compile is deterministic (the id names the content) and the
    # constants are in it.
    jax_launch.compile_kernel.cache_clear()
    assert gather_compiled().kernel_id == c.kernel_id
    assert gather_compiled(width=512).kernel_id != c.kernel_id

  def test_an_array_parameter_given_as_a_keyword_is_named(self):
    constexprs = dict(GATHER, out_ptr=0)
    with pytest.raises(TypeError, match="out_ptr"):
      jax_launch.compile_kernel(
          compiled_kernel(row_gather._gather_rows_kernel),
          ("*i32", "*bf16", "*bf16"), tuple(sorted(constexprs.items())), 4,
          1, 90)

  def test_a_dtype_without_a_pointer_type_goes_to_jax_triton(self):
    assert jax_launch._pointer_type(jnp.complex64) is None
    assert jax_launch.ffi_triton_call(
        jnp.ones(4, jnp.complex64),
        kernel=compiled_kernel(row_gather._gather_rows_kernel),
        out_shape=jax.ShapeDtypeStruct((4,), jnp.complex64), grid=(1,),
        capability=90) is None

  def test_a_parameter_not_given_takes_its_default(self):
    def kernel_fn(x_ptr, y_ptr, N: triton.language.constexpr,
                  SCALE: triton.language.constexpr = 3.0):
      offs = triton.language.arange(0, N)
      triton.language.store(y_ptr + offs,
                            triton.language.load(x_ptr + offs) * SCALE)
    kernel = JITFunction(kernel_fn)
    default = jax_launch.compile_kernel(kernel, ("*fp32", "*fp32"),
                                        (("N", 64),), 4, 1, 90)
    given = jax_launch.compile_kernel(kernel, ("*fp32", "*fp32"),
                                      (("N", 64), ("SCALE", 3.0)), 4, 1, 90)
    other = jax_launch.compile_kernel(kernel, ("*fp32", "*fp32"),
                                      (("N", 64), ("SCALE", 2.0)), 4, 1, 90)
    assert default.kernel_id == given.kernel_id != other.kernel_id

  def test_a_jitted_call_lowers_to_the_typed_ffi_call(self, monkeypatch):
    monkeypatch.setattr(jax_launch, "launcher_reason", lambda: None)
    monkeypatch.setattr(jax_launch, "_device_capability", lambda: 90)
    monkeypatch.setattr(row_gather, "_gather_rows_kernel",
                        compiled_kernel(row_gather._gather_rows_kernel))
    from pallas_kernels.row_gather import default_config
    rng = np.random.default_rng(0)
    src = jnp.asarray(rng.standard_normal((77, 384)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(-1, 77, 131), jnp.int32)
    config = default_config(131, 384, 2)

    def f(src, idx):
      return row_gather.gather_rows(src, idx, 0.0, config=config)

    text = jax.jit(f).trace(src, idx).lower(
        lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"stablehlo\.custom_call @(\w+)", text)
    assert calls == ["rlk_triton_launch"]
    # Typed FFI attributes (API version 4), not an opaque legacy config.
    assert "mhlo.backend_config = {" in text
    assert "api_version = 2" not in text
    grid = row_gather._grid(131, 384, config)
    grid = tuple(grid) + (1,) * (3 - len(grid))
    assert f"grid = dense<[{', '.join(map(str, grid))}]>" in text
    assert 'name = "_gather_rows_kernel"' in text
    # The cubin in the call is the compiled kernel's, byte for byte.
    blob = re.search(r'cubin = dense<"0x([0-9A-F]+)">', text).group(1)
    c = jax_launch.compile_kernel(
        row_gather._gather_rows_kernel, ("*i32", "*bf16", "*bf16"),
        tuple(sorted(dict(n_out=131, width=384, FILL=0.0,
                          BLOCK_ROWS=config.block_rows,
                          BLOCK_COLS=config.block_cols).items())),
        config.num_warps, 1, 90)
    assert bytes.fromhex(blob) == c.cubin

  def test_aliased_outputs_lower_as_aliases(self, monkeypatch):
    monkeypatch.setattr(jax_launch, "launcher_reason", lambda: None)

    def add_one(x_ptr, y_ptr, N: triton.language.constexpr):
      offs = triton.language.arange(0, N)
      triton.language.store(y_ptr + offs,
                            triton.language.load(x_ptr + offs) + 1.0)

    kernel = JITFunction(add_one)

    def f(x):
      return jax_launch.ffi_triton_call(
          x, kernel=kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
          grid=(1,), input_output_aliases={0: 0}, capability=90, N=64)

    text = jax.jit(f).trace(jnp.ones(64, jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "output_operand_aliases" in text
    assert "rlk_triton_launch" in text


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
class TestOnGpu:
  """The FFI launch against jax-triton's, bit for bit, on rlk's kernels."""

  @pytest.fixture(autouse=True)
  def _launcher(self):
    reason = jax_launch.launcher_reason()
    if reason is not None:
      pytest.fail(f"rlk's FFI launcher is not loaded: {reason}")

  @staticmethod
  def both(fn, *args):
    """fn(*args) jitted through the FFI launcher and through jax-triton
    (caches cleared between: rlk's inner jitted functions retrace)."""
    jax.clear_caches()
    ffi_out = jax.jit(fn)(*args)
    original = jax_launch.launcher_reason
    jax_launch.launcher_reason = lambda: "forced: jax-triton"
    jax.clear_caches()
    try:
      jt_out = jax.jit(lambda *a: fn(*a))(*args)
    finally:
      jax_launch.launcher_reason = original
      jax.clear_caches()
    return jax.tree.leaves(ffi_out), jax.tree.leaves(jt_out)

  @staticmethod
  def same_bits(a, b):
    for x, y in zip(a, b, strict=True):
      assert x.shape == y.shape and x.dtype == y.dtype
      assert np.array_equal(np.asarray(x).view(np.uint8),
                            np.asarray(y).view(np.uint8))

  @pytest.mark.parametrize("layout", ["packed", "kv cache"])
  def test_attention_forward_and_backward(self, layout):
    import rlk_jax
    rng = np.random.default_rng(11)
    hq, hkv, d = 8, 2, 128
    if layout == "packed":
      lens = [37, 300, 129]
      t = sum(lens)
      q = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.bfloat16)
      k = jnp.asarray(rng.standard_normal((t, hkv, d)), jnp.bfloat16)
      v = jnp.asarray(rng.standard_normal((t, hkv, d)), jnp.bfloat16)
      cu = jnp.asarray(np.cumsum([0] + lens), jnp.int32)

      def fn(q, k, v):
        def loss(q, k, v):
          out = rlk_jax.det_attention(q, k, v, cu_seqlens=cu)
          return jnp.sum(out.astype(jnp.float32) ** 2), out
        return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    else:
      b, s = 5, 700
      q = jnp.asarray(rng.standard_normal((b, 1, hq, d)), jnp.bfloat16)
      k = jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.bfloat16)
      v = jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.bfloat16)
      kv_lens = jnp.asarray([1, 64, 333, 699, 700], jnp.int32)

      def fn(q, k, v):
        return rlk_jax.det_attention(q, k, v, kv_lens=kv_lens)
    self.same_bits(*self.both(fn, q, k, v))

  def test_det_matmul_gather_and_logits_stats(self):
    from pallas_kernels.row_gather import default_config
    from triton_kernels import det_matmul, linear_logp
    rng = np.random.default_rng(12)
    a = jnp.asarray(rng.standard_normal((300, 512)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((512, 384)), jnp.bfloat16)
    from pallas_kernels.det_matmul import DEFAULT_CONFIG as config

    def products(a, b):
      return det_matmul.matmul(a, b, transpose_a=False, transpose_b=False,
                               out_dtype=jnp.float32, config=config)
    self.same_bits(*self.both(products, a, b))
    idx = jnp.asarray(rng.integers(-1, 300, 257), jnp.int32)
    gconfig = default_config(257, 512, 2)
    self.same_bits(*self.both(
        lambda a, i: row_gather.gather_rows(a, i, 0.0, config=gconfig),
        a, idx))
    logits = jnp.asarray(rng.standard_normal((300, 1024)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 1024, 300), jnp.int32)
    temps = jnp.asarray(rng.uniform(0.5, 1.5, 300), jnp.float32)
    stats = tuple(jnp.asarray(rng.standard_normal(300), jnp.float32)
                  for _ in range(4))
    self.same_bits(*self.both(
        lambda x, t, tp, *s: linear_logp.update_stats(
            x, t, tp, s, config=config), logits, targets, temps, *stats))

  def test_every_launch_runs_in_a_command_buffer(self, tmp_path):
    """A program of several decode-attention calls: every Triton launch is
    captured into a command buffer (jax-triton's legacy custom call ran
    outside them, each cutting the graph)."""
    import rlk_jax
    from benchmarks.xla_dump import custom_call_thunks, thunk_sequence
    rng = np.random.default_rng(13)
    b, s, hq, hkv, d = 4, 256, 8, 2, 128
    q = jnp.asarray(rng.standard_normal((b, 1, hq, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.bfloat16)
    lens = jnp.asarray([3, 100, 200, 256], jnp.int32)

    def fn(q, k):
      for _ in range(3):
        q = rlk_jax.det_attention(q, k, k, kv_lens=lens) * 1.5
      return q
    lowered = jax.jit(fn).lower(q, k)
    hlo = lowered.compile().as_text()
    launches = hlo.count('custom_call_target="rlk_triton_launch"')
    assert launches >= 3 and "triton_kernel_call" not in hlo
    sequence = thunk_sequence(lowered, tmp_path)
    assert sequence, "no thunk pass changed the program (nothing captured)"
    captured, outside = custom_call_thunks(sequence)
    assert outside == 0 and captured >= launches, (captured, outside,
                                                   launches)
