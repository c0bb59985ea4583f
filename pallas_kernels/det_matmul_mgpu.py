"""det_gemm's Pallas kernel on Mosaic GPU (Hopper): ``op(A) @ op(B)`` with
TMA loads, wgmma into one f32 accumulator per output tile, a memory
warpgroup feeding two compute warpgroups, and a persistent grid.

Why its bits are the SM90 kernels' (``cuda_ffi``): every output tile walks
K in 64-wide steps from 0 upwards, each step four k16 wgmma instructions
issued in order into the same f32 accumulator, exactly the order CUTLASS's
mainloop issues them; the K tail and the tiles' overhang past M and N are
TMA zero fills (a zero product leaves an f32 sum's bits alone), and the
epilogue rounds the accumulator once to the output dtype. Tile shape,
warpgroup split, pipeline depth and tile order only decide which SM runs a
tile and when, never the order of one element's sum: a row's bits do not
depend on M or on the rows around it.

The operands keep their layouts: a stored-transposed operand is loaded as
its own ``[K, M]`` / ``[N, K]`` tiles and handed to wgmma transposed in
shared memory (bf16/f16 only), so the backward's ``g·Bᵀ`` and ``Aᵀ·g`` read
the forward operands in place.

A TMA copy into a swizzled tile needs the global array's rows to be whole
tiles: a multiple of 8 rows and of 64 elements (128 bytes) per row. Other
shapes are zero-padded up to that and the result sliced back: padded K
adds exact zero products (the K loop already runs to a multiple of 64 and
the SM90 kernels zero-fill that tail the same way), padded rows and columns
are other outputs, dropped. Written against jax 0.11.2's
``jax.experimental.pallas.mosaic_gpu`` (modelled on its ``hopper_matmul_mgpu``
example, which refuses shapes its tiles do not divide).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

BLOCK_K = 64  # the K step of every rlk det_gemm kernel: part of the bits
_SWIZZLE = 128  # bytes: 64 bf16 per swizzled row, for A, B and the output
_SMEM_BYTES = 227 * 1024
_EPILOGUE = 64  # epilogue sub-tiles are at most 64x64


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
  """One compute warpgroup's tile (`tile_m` x `tile_n`); the two compute
  warpgroups split the CTA's tile along `split` ("m" or "n"). `stages`:
  TMA pipeline depth (lowered to fit shared memory); `snake`: the
  persistent loop's tile-order band width (L2 reuse). `cluster`: None, or
  "m"/"n": two CTAs side by side along that dimension share the other
  operand's tile, each loading half of it and multicasting it (TMA
  multicast halves that operand's L2 reads). `chain`: the memory
  warpgroup runs one pipeline across all of a CTA's tiles, loading the
  next tile's first K steps during this tile's last ones and its epilogue
  (where a stage count divides K's steps). `epilogue_n`: the width of the
  epilogue's shared-memory sub-tiles at a 16-bit output (32 leaves room
  for a fourth 128x256 stage). `compute_wgs`: 2, or 1 for a CTA of one
  warpgroup's tile (`split` unused): small CTAs for small products. None of
  them changes the order of an element's sum."""
  tile_m: int = 128
  tile_n: int = 128
  split: str = "n"
  stages: int = 4
  snake: int = 8
  cluster: str | None = None
  chain: bool = False
  epilogue_n: int = 64
  compute_wgs: int = 2

  @property
  def cta_m(self) -> int:
    return self.tile_m * (2 if self.wg_split == "m" else 1)

  @property
  def cta_n(self) -> int:
    return self.tile_n * (2 if self.wg_split == "n" else 1)

  @property
  def wg_split(self) -> str | None:
    """How the CTA's tile splits between its compute warpgroups ("m",
    "n"; None for one warpgroup)."""
    return self.split if self.compute_wgs == 2 else None

  @property
  def cluster_m(self) -> int:
    return self.cta_m * (2 if self.cluster == "m" else 1)

  @property
  def cluster_n(self) -> int:
    return self.cta_n * (2 if self.cluster == "n" else 1)

  @property
  def ctas(self) -> int:
    return 2 if self.cluster else 1


CONFIGS = {
    "128x256": MgpuConfig(128, 128, "n"),
    "256x128": MgpuConfig(128, 128, "m"),
    "128x128": MgpuConfig(128, 64, "n"),
    "64x256": MgpuConfig(64, 128, "n"),
    # 192-wide warpgroup tiles: whole waves where 128- and 256-wide tiles
    # leave the last one part-empty (M=1024, N=6144: 128 CTA tiles of
    # 256x192 on 132 SMs, against 192 of 128x256).
    "256x192": MgpuConfig(128, 192, "m"),
    "128x192": MgpuConfig(64, 192, "m"),
    # 2-CTA clusters along M sharing B through TMA multicast, with a fourth
    # stage where 64x32 epilogue sub-tiles leave room, chained across tiles
    # (256x192's 56 KiB stages fit three: no depth divides most K's steps).
    "128x256_c2m": MgpuConfig(128, 128, "n", epilogue_n=32, chain=True,
                              cluster="m"),
    "256x128_c2m": MgpuConfig(128, 128, "m", epilogue_n=32, chain=True,
                              cluster="m"),
    "256x192_c2m": MgpuConfig(128, 192, "m", epilogue_n=32, cluster="m"),
    # Half-size CTA tiles for small products (M <= 512, say), where 128x256
    # tiles leave most of the 132 SMs idle: twice the CTAs. (A 64x64 CTA,
    # MgpuConfig(64, 32), does not lower with B stored [K, N]: a 32-column
    # slice of a 128-byte-swizzled tile.)
    "64x128": MgpuConfig(64, 64, "n"),
    "128x64": MgpuConfig(64, 64, "m"),
    # One compute warpgroup's 64x64 tile per CTA: four times 128x128's CTAs,
    # for products too small to fill the SMs with larger tiles. (64x32 does
    # not lower with B stored [K, N]: no wgmma layout for a 64-byte-swizzled
    # B.)
    "64x64": MgpuConfig(64, 64, compute_wgs=1),
}


# Relative throughput of one CTA tile of each config when every SM is busy
# (H100, 2026-11-23/24: geomeans over llama3.1-8b's qkv, gate_up and down
# at M=4096, forward, dA and dB, det_gemm_sweep --sweep_mosaic_gpu_configs;
# records det_gemm_mosaic_configs-e4fbcd4/ and det_gemm_mosaic_tiles-312929d/
# under benchmarks/results/; 64x128 and 128x64 from llama3.1-8b's o and qkv
# dA at M=4096, det_gemm_mosaic_small_tiles-e2be270/). Alone, a fourth
# stage, a chained pipeline or one wgmma group in flight measured no faster
# than 128x256 (det_gemm_mosaic_variants-fcf59d7/). 64x64 from the MoE
# expert's qkv and o at M 128-512, kernel times of eight configs per
# product (det_gemm_mosaic_small_m_configs-87a36ec/): a fit of time per
# CTA tile's MACs gives it 0.28 of 128x256's rate; 0.32-0.40 all choose
# the fastest config there or one within 9% of it, where 64x64 at 0 lost
# up to 13%.
_EFFICIENCY = {"128x256": 1.0, "256x128": 1.0, "128x128": 0.89,
               "64x256": 0.75, "256x192": 0.98, "128x192": 0.93,
               "128x256_c2m": 1.01, "256x128_c2m": 0.96, "256x192_c2m": 0.98,
               "64x128": 0.55, "128x64": 0.62, "64x64": 0.34}


def choose_config(m: int, n: int, num_sms: int) -> MgpuConfig:
  """The config with the least estimated time: waves of CTA tiles over the
  SMs (the last one partly idle) times a tile's work over its efficiency.
  Any config gives the same bits; ties go to the first in CONFIGS."""
  def cost(name):
    cfg = CONFIGS[name]
    if not _EFFICIENCY[name]:
      return float("inf")
    # A wave runs one CTA tile per SM (a cluster's tile on two).
    tiles = pl.cdiv(m, cfg.cluster_m) * pl.cdiv(n, cfg.cluster_n)
    return (pl.cdiv(tiles, num_sms // cfg.ctas) * cfg.cta_m * cfg.cta_n
            / _EFFICIENCY[name])
  return CONFIGS[min(CONFIGS, key=cost)]


def operand_reason(m, n, k, transpose_a, transpose_b, dtype, out_dtype):
  """None if the kernel takes this product, else why not (wgmma's 16-bit
  transposable operands; any shape, padded where TMA needs it)."""
  del m, n, k, transpose_a, transpose_b  # padded to whole tiles
  dtype, out_dtype = np.dtype(dtype), np.dtype(out_dtype)
  if dtype.name not in ("bfloat16", "float16"):
    return f"operands must be bfloat16 or float16, got {dtype}"
  if out_dtype.name not in (dtype.name, "float32"):
    return f"the result must be {dtype} or float32, got {out_dtype}"
  return None


def _round_up(x: int, multiple: int) -> int:
  return pl.cdiv(x, multiple) * multiple


def _zero_padded(x, shape):
  pads = [(0, want - have) for have, want in zip(x.shape, shape)]
  return jnp.pad(x, pads) if any(p for _, p in pads) else x


@functools.cache  # asked on every dispatch
def unavailable_reason(platform: str) -> str | None:
  """None where jax has Pallas's Mosaic GPU backend for `platform` (the
  kernel also needs a Hopper GPU for wgmma: the caller's check)."""
  if platform != "gpu":
    return f"Mosaic GPU kernels run on NVIDIA GPUs (platform {platform!r})"
  try:
    _plgpu()
  except ImportError as e:
    return f"jax.experimental.pallas.mosaic_gpu does not import: {e}"
  return None


def _plgpu():
  from jax.experimental.pallas import mosaic_gpu as plgpu
  return plgpu


def _interpreter(plgpu):
  # Exported from plgpu since jax 0.11; private before.
  params = getattr(plgpu, "InterpretGPUParams", None)
  if params is None:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    params = InterpretGPUParams
  return params()


def _swizzled(plgpu, itemsize: int, minor: int):
  """A shared-memory tile's transforms: the widest swizzle its rows of
  `minor` elements fill (128 bytes; 64 for a 32-wide bf16 tile)."""
  swizzle = min(_SWIZZLE, minor * itemsize)
  return (plgpu.TilingTransform((8, swizzle // itemsize)),
          plgpu.SwizzleTransform(swizzle))


def _stages(cfg: MgpuConfig, itemsize: int, out_itemsize: int,
            epi_m: int, epi_n: int, k_iters: int) -> tuple[int, bool]:
  """(pipeline depth, whether the pipeline chains across tiles). A chained
  pipeline's depth must divide K's steps (its slots then line up from one
  tile to the next); without such a depth of at least 2 it does not chain."""
  per_stage = (cfg.cta_m + cfg.cta_n) * BLOCK_K * itemsize
  epilogue = 2 * 2 * epi_m * epi_n * out_itemsize
  fit = (_SMEM_BYTES - epilogue - 4096) // per_stage
  stages = max(2, min(cfg.stages, fit))
  if cfg.chain:
    if k_iters <= stages:
      return k_iters, True  # the pipeline shrinks to K's steps anyway
    for depth in range(stages, 1, -1):
      if k_iters % depth == 0:
        return depth, True
  return stages, False


def _whole_clusters(cfg: MgpuConfig, m: int, n: int) -> MgpuConfig:
  """`cfg`, without its cluster where the CTA tiles along the cluster's
  dimension are odd in number: a partner CTA wholly past M or N would load
  nothing but zero fills while its partner waits on its half of the shared
  tile (Mosaic GPU's interpreter deadlocks there). Same bits either way."""
  if cfg.cluster == "m" and pl.cdiv(m, cfg.cta_m) % 2:
    return dataclasses.replace(cfg, cluster=None)
  if cfg.cluster == "n" and pl.cdiv(n, cfg.cta_n) % 2:
    return dataclasses.replace(cfg, cluster=None)
  return cfg


def _kernel(a_gmem, b_gmem, out_gmem, *, m, n, k, transpose_a, transpose_b,
            cfg: MgpuConfig):
  plgpu = _plgpu()
  tm, tn, cta_m, cta_n = cfg.tile_m, cfg.tile_n, cfg.cta_m, cfg.cta_n
  m_iters, n_iters = pl.cdiv(m, cfg.cluster_m), pl.cdiv(n, cfg.cluster_n)
  k_iters = pl.cdiv(k, BLOCK_K)
  itemsize = jnp.dtype(a_gmem.dtype).itemsize
  out_dtype = out_gmem.dtype
  out_itemsize = jnp.dtype(out_dtype).itemsize
  # epilogue_n counts 16-bit columns: a 32-bit output's sub-tiles take half
  # as many, so the epilogue's shared memory does not grow with it.
  epi_m = min(_EPILOGUE, tm)
  epi_n = min(cfg.epilogue_n * 2 // out_itemsize, tn)
  slots = min(2, (tm * tn) // (epi_m * epi_n))
  stages, chain = _stages(cfg, itemsize, out_itemsize, epi_m, epi_n, k_iters)
  out_swizzle = plgpu.find_swizzle(epi_n * out_itemsize * 8)
  out_transforms = (
      plgpu.TilingTransform((8, out_swizzle // out_itemsize)),
      plgpu.SwizzleTransform(out_swizzle))
  # The two CTAs of a cluster along N read the same A tile (along M, the
  # same B tile): each loads half of it and multicasts it to both.
  shares_a = ("cluster",) if cfg.cluster == "n" else ()
  shares_b = ("cluster",) if cfg.cluster == "m" else ()
  # A tile is [cta_m, 64] or, stored transposed, [64, cta_m]; B's likewise.
  a_spec = plgpu.BlockSpec(
      (BLOCK_K, cta_m) if transpose_a else (cta_m, BLOCK_K),
      (lambda kk: (kk, 0)) if transpose_a else (lambda kk: (0, kk)),
      transforms=_swizzled(plgpu, itemsize, cta_m if transpose_a else BLOCK_K),
      memory_space=plgpu.SMEM, collective_axes=shares_a)
  b_spec = plgpu.BlockSpec(
      (cta_n, BLOCK_K) if transpose_b else (BLOCK_K, cta_n),
      (lambda kk: (0, kk)) if transpose_b else (lambda kk: (kk, 0)),
      transforms=_swizzled(plgpu, itemsize, BLOCK_K if transpose_b else cta_n),
      memory_space=plgpu.SMEM, collective_axes=shares_b)

  def pipeline(body, compute_context, state=None):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_iters,), memory_registers=40, in_specs=[a_spec, b_spec],
        wg_axis="wg", num_compute_wgs=cfg.compute_wgs,
        max_concurrent_steps=stages,
        compute_context=compute_context, pipeline_state=state)

  ignore = lambda *_, **__: None

  @functools.partial(
      pl.run_scoped,
      allocations=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem),
      out_smem=plgpu.SMEM((cfg.compute_wgs, slots, epi_m, epi_n), out_dtype,
                          transforms=out_transforms),
      collective_axes="wg")
  def _scope(allocations, out_smem):
    wg = lax.axis_index("wg")
    cta = lax.axis_index("cluster") if cfg.cluster else 0

    @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
    def _tiles(loop):
      (tile,) = loop.index
      mi, ni = plgpu.planar_snake(tile, (m_iters, n_iters), 1, cfg.snake)
      if cfg.cluster == "m":
        mi = mi * 2 + cta
      elif cfg.cluster == "n":
        ni = ni * 2 + cta
      # Both CTAs of a cluster hold rows and columns (_whole_clusters).
      rows, cols = pl.ds(mi * cta_m, cta_m), pl.ds(ni * cta_n, cta_n)
      wg_rows = pl.ds(wg * tm, tm) if cfg.wg_split == "m" else slice(None)
      wg_cols = pl.ds(wg * tn, tn) if cfg.wg_split == "n" else slice(None)

      def compute(run_pipeline):
        # A fresh accumulator per output tile (zeroed at allocation).
        @functools.partial(pl.run_scoped,
                           acc=plgpu.ACC((tm, tn), jnp.float32))
        def _acc(acc):
          run_pipeline(acc)
          out = acc[...].astype(out_dtype)  # waits for every wgmma
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          dst = out_gmem.at[rows, cols].at[wg_rows, wg_cols]
          for ei in range(tm // epi_m):
            for ej in range(tn // epi_n):
              sub_m = slice(ei * epi_m, (ei + 1) * epi_m)
              sub_n = slice(ej * epi_n, (ej + 1) * epi_n)
              slot = (ei * (tn // epi_n) + ej) % slots
              # The slot's previous TMA store must have read it.
              plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
              out_smem[wg, slot] = out[sub_m, sub_n]
              plgpu.commit_smem()
              # Rows and columns past M and N are clipped by the TMA store.
              plgpu.copy_smem_to_gmem(out_smem.at[wg, slot],
                                      dst.at[sub_m, sub_n])

      def k_step(_, a_smem, b_smem, acc):
        a_op = (a_smem.at[:, wg_rows].T if transpose_a
                else a_smem.at[wg_rows, :])
        b_op = (b_smem.at[wg_cols, :].T if transpose_b
                else b_smem.at[:, wg_cols])
        plgpu.wgmma(acc, a_op, b_op)
        # The stage is released when this returns: its wgmma must be done.
        plgpu.wgmma_wait(0)
        return acc

      a_view = a_gmem.at[:, rows] if transpose_a else a_gmem.at[rows, :]
      b_view = b_gmem.at[cols, :] if transpose_b else b_gmem.at[:, cols]

      def run(state=None):
        pipeline(k_step, compute, state)(a_view, b_view,
                                         allocations=allocations)

      if not chain:
        run()
        return
      # One pipeline over this CTA's tiles: the first tile fills it, the
      # last drains it; a CTA with one tile runs a whole pipeline.
      state = plgpu.PipelinePipeline
      first, last = loop.local_index == 0, (
          loop.local_index == loop.num_local_steps - 1)
      lax.cond(first & last, run,
               lambda: run(jnp.where(first, int(state.START),
                                     jnp.where(last, int(state.STOP),
                                               int(state.STEADY)))))

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def matmul(a: jax.Array, b: jax.Array, *, transpose_a: bool = False,
           transpose_b: bool = False, out_dtype=None,
           config: MgpuConfig | None = None, num_sms: int | None = None,
           interpret: bool = False) -> jax.Array:
  """``op(a) @ op(b)``: `a` is ``[M, K]`` (``[K, M]`` if `transpose_a`),
  `b` ``[K, N]`` (``[N, K]`` if `transpose_b`); f32 accumulation, result in
  `out_dtype` (default: the operands'). `interpret` runs Mosaic GPU's
  interpreter (CPU tests; its arithmetic is not the hardware's)."""
  plgpu = _plgpu()
  m, k = a.shape[::-1] if transpose_a else a.shape
  n = b.shape[0] if transpose_b else b.shape[1]
  out_dtype = jnp.dtype(out_dtype or a.dtype)
  reason = operand_reason(m, n, k, transpose_a, transpose_b, a.dtype,
                          out_dtype)
  if reason is not None or b.dtype != a.dtype:
    raise ValueError(f"det_matmul_mgpu: cannot take A {a.shape} {a.dtype}, "
                     f"B {b.shape} {b.dtype} -> {out_dtype}: "
                     f"{reason or 'A and B dtypes differ'}")
  if not (m and k):  # no launch for an empty grid; an empty sum is +0.0
    return jnp.zeros((m, n), out_dtype)
  # Whole TMA tiles: 8 rows, 64 elements per row (see the module docstring).
  mp = _round_up(m, BLOCK_K if transpose_a else 8)
  np_, kp = _round_up(n, BLOCK_K), _round_up(k, BLOCK_K)
  a = _zero_padded(a, (kp, mp) if transpose_a else (mp, kp))
  b = _zero_padded(b, (np_, kp) if transpose_b else (kp, np_))
  if num_sms is None:
    num_sms = 4 if interpret else jax.devices()[0].core_count
  cfg = _whole_clusters(config or choose_config(m, n, num_sms), mp, np_)
  tiles = pl.cdiv(mp, cfg.cluster_m) * pl.cdiv(np_, cfg.cluster_n)
  params = {"interpret": _interpreter(plgpu)} if interpret else {}
  if cfg.cluster:
    params.update(cluster=(2,), cluster_names=("cluster",))
  out = plgpu.kernel(
      functools.partial(_kernel, m=mp, n=np_, k=kp, transpose_a=transpose_a,
                        transpose_b=transpose_b, cfg=cfg),
      out_type=jax.ShapeDtypeStruct((mp, np_), out_dtype),
      grid=(max(1, min(num_sms // cfg.ctas, tiles)),), grid_names=("sm",),
      num_threads=cfg.compute_wgs + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      **params)(a, b)
  return out if (mp, np_) == (m, n) else out[:m, :n]
