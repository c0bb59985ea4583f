// Entry points of the SM90 det_gemm: an XLA FFI handler (JAX) and a plain C
// function (the torch bridge, on torch's current stream). Both check the
// problem the same way and launch the same kernels, so they give the same
// bits for the same inputs. The FFI handler is command-buffer compatible
// (ffi_traits.h): its workspace is an XLA-allocated result.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "det_gemm_sm90.h"
#include "device_info.h"
#include "ffi_traits.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace rlk {

// The rows of a decode step, and those few enough for the swapped tile.
constexpr int64_t kMaxDecodeRows = 64;
constexpr int64_t kMaxSwapRows = 32;

// The kernels, one per (layout, output dtype, config), as the build
// delivers them: each compiled object is linked into a kernel library of its
// own as soon as it is compiled (and all of them into one at the end), and
// rlk's loader hands this library each kernel's launch function
// (rlk_det_gemm_sm90_add_kernel). So a process can run the kernels that
// exist while the rest still compile, and the library links with any subset
// of them. Slots are atomic: a kernel may arrive while another thread
// launches; once set, a slot only ever holds a function giving the same
// bits (the same kernel from another of its libraries).
using KernelFn = LaunchStatus (*)(const GemmProblem&, size_t*);
constexpr int kConfigSlots = static_cast<int>(GemmConfig::kLastConfig) + 1;
std::atomic<KernelFn> kernels[8][kConfigSlots];

int LayoutIndex(bool ta, bool tb, bool out_f32) {
  return (ta ? 4 : 0) + (tb ? 2 : 0) + (out_f32 ? 1 : 0);
}

KernelFn FindKernel(bool ta, bool tb, bool out_f32, GemmConfig config) {
  const int code = static_cast<int>(config);
  if (code <= 0 || code >= kConfigSlots) return nullptr;
  return kernels[LayoutIndex(ta, tb, out_f32)][code].load(
      std::memory_order_acquire);
}

// Whether a config can run in layout `layout` (LayoutIndex; -1: any, the
// rule as it was before kernels arrived one by one).
bool Built(int layout, GemmConfig config) {
  if (layout < 0) return true;
  if (config == GemmConfig::kSplit256x192And128x256) {
    return Built(layout, GemmConfig::kCooperative256x192) &&
           Built(layout, GemmConfig::kCooperative128x256);
  }
  const int code = static_cast<int>(config);
  return code > 0 && code < kConfigSlots &&
         kernels[layout][code].load(std::memory_order_acquire) != nullptr;
}

namespace {

// Tile rows of bm over m rows, paired for the 2x1 cluster both large configs
// use (a cluster's CTAs take neighbouring M tiles).
int64_t PairedRows(int64_t m, int64_t bm) {
  const int64_t rows = (m + bm - 1) / bm;
  return rows + rows % 2;
}

// The tile slots a persistent grid of bm x bn tiles (2x1 clusters) spends on
// an m x n output: waves x SMs x tile area. Each tile costs its whole area
// whatever it covers, so the slots beyond m x n are the waste: the empty
// slots of the last wave and the padding of ragged edge tiles.
int64_t TileSlots(int64_t m, int64_t n, int64_t bm, int64_t bn, int sm_count) {
  if (n <= 0) return 0;
  const int64_t waves =
      (PairedRows(m, bm) * ((n + bn - 1) / bn) + sm_count - 1) / sm_count;
  return waves * sm_count * bm * bn;
}

struct Split {
  int64_t columns = 0;  // given to 256x192; 0: no split possible
  int64_t slots = 0;    // of both grids
};

Split BestSplit(int64_t m, int64_t n, int sm_count) {
  Split best;
  const int64_t max_blocks = (n - 1) / 192;  // leaves 128x256 >= 1 column
  if (max_blocks < 1 || m < 1) return best;
  const int64_t rows = PairedRows(m, 256);
  // For a given number of waves of 256x192, the widest block costs its
  // kernel nothing more and leaves the least to 128x256: only the widest
  // block of each wave count is a candidate. Ties go to the wider block.
  const int64_t max_waves = (rows * max_blocks + sm_count - 1) / sm_count;
  for (int64_t waves = 1; waves <= max_waves; ++waves) {
    const int64_t blocks = std::min(max_blocks, waves * sm_count / rows);
    if (blocks < 1) continue;
    const int64_t columns = 192 * blocks;
    const int64_t slots = TileSlots(m, columns, 256, 192, sm_count) +
                          TileSlots(m, n - columns, 128, 256, sm_count);
    if (best.columns == 0 || slots <= best.slots) best = {columns, slots};
  }
  return best;
}

// A config, and for kSplit256x192And128x256 its 256x192 columns, so the
// launch does not search the split again.
struct Plan {
  GemmConfig config;
  int64_t split_columns = 0;
};

// `layout` (LayoutIndex, or -1 for every config): the rule then chooses
// among the configs built for that layout, the same way, passing over the
// others (kAuto: none of its configs is built yet).
Plan ChoosePlan(int64_t m, int64_t n, int64_t k, int sm_count,
                int layout = -1) {
  auto built = [&](GemmConfig c) { return Built(layout, c); };
  // K is never split, whatever the shape: that would change the bits.
  auto tiles = [&](int64_t bm, int64_t bn) {
    return ((m + bm - 1) / bm) * ((n + bn - 1) / bn);
  };
  // Decode rows stream the weight; a tile taller than them only pads MMA
  // rows for the same weight bytes. Measured on the H100 in CUDA-graph
  // replays of 16 calls with their own weights, K=4096, as cuBLAS's speed
  // (benchmarks/results/experiments/h100-2026-11-22/det_gemm_swap_pdl*,
  // two machines).
  //
  // Up to 32 rows: the swapped 64x32 tile (C^T = B^T A^T), whatever N.
  // M=1: 0.94-0.97x at N=4096 (0.86-0.88x for the 64x128 tile chosen
  // before), 1.05-1.06x at 14336 (1.03x), 1.16-1.25x at 2048 (0.91-0.96x,
  // 64x64), 0.99-1.08x at 1024 (0.72-0.89x, 64x32), 1.00x at 128256 (0.63x,
  // 128x256). M=16 and 32: 0.95-1.28x, ahead of every tile measured or
  // within 3% of the best.
  if (m <= kMaxSwapRows && built(GemmConfig::kSwapPingpong64x32)) {
    return {GemmConfig::kSwapPingpong64x32};
  }
  if (m <= kMaxDecodeRows) {
    // 33-64 rows, one 64-row tile deep: a CTA takes about the same time
    // whatever its width, so the widest ping-pong tile that still gives
    // kMinStreamingTiles CTAs wins. M=64: 64x64 at N=4096 (1.05-1.08x; 64x128
    // 0.97-1.01x), 64x128 at 14336 (0.97-0.98x, 64x64 alike), 64x32 at 2048
    // and 1024 (earlier runs: 0.96x, 64x64 0.92x).
    constexpr int64_t kMinStreamingTiles = 64;
    if (tiles(64, 128) >= kMinStreamingTiles &&
        built(GemmConfig::kPingpong64x128)) {
      return {GemmConfig::kPingpong64x128};
    }
    if (tiles(64, 64) >= kMinStreamingTiles &&
        built(GemmConfig::kPingpong64x64)) {
      return {GemmConfig::kPingpong64x64};
    }
    if (built(GemmConfig::kPingpong64x32)) return {GemmConfig::kPingpong64x32};
  }
  // Beyond decode rows: the config of least estimated time, where a
  // persistent grid of bm x bn tiles takes waves x (per-tile cost) and a
  // tile costs bm x bn x K multiply-adds at the config's rate plus a fixed
  // per-tile cost (prologue, epilogue). The waves count the tile slots a
  // grid spends, the empty slots of its last wave and the padding of its
  // edge tiles included. The rates and fixed costs are fitted to the H100
  // sweep of every config on 879 products of eight open-model families, M
  // 128-16384, forward and both backward layouts
  // (benchmarks/results/nvidia-h100-80gb-hbm3-2026-11-23/det_gemm_sweep-*):
  // the rule's choice ran 1.017x the fastest config's time in geomean (the
  // old rule: 1.126x, 158 products past 1.25x), 1.015-1.020x on shapes left
  // out of the fit. It is the fallback: rlk_jax measures configs on first
  // use, or reads a shipped table, wherever it can.
  struct Candidate {
    GemmConfig config;
    int bm, bn;
    int cluster_m, cluster_n;  // 2: tiles are paired along M (N)
    double ps_per_kmac;        // picoseconds per 1000 multiply-adds of a tile
    double tile_ns;            // fixed cost per tile
  };
  static constexpr Candidate kCandidates[] = {
      {GemmConfig::kCooperative128x256, 128, 256, 2, 1, 289.3, 2640},
      {GemmConfig::kCooperative256x192, 256, 192, 2, 1, 273.7, 4212},
      {GemmConfig::kPingpong128x128, 128, 128, 1, 1, 383.0, 859},
      {GemmConfig::kCooperative128x128, 128, 128, 2, 1, 365.3, 1208},
      {GemmConfig::kCooperative256x128, 256, 128, 2, 1, 297.4, 2597},
      {GemmConfig::kCooperative128x192, 128, 192, 2, 1, 304.4, 1900},
      {GemmConfig::kCooperative128x256Cluster1x2, 128, 256, 1, 2, 294.6, 2620},
      {GemmConfig::kPingpong64x256, 64, 256, 1, 1, 413.7, 992},
      {GemmConfig::kPingpong64x128, 64, 128, 1, 1, 582.4, 397},
      {GemmConfig::kPingpong64x64, 64, 64, 1, 1, 844.1, 208},
      {GemmConfig::kPingpong64x32, 64, 32, 1, 1, 1400.3, 124},
  };
  auto estimate = [&](const Candidate& c, int64_t columns) {
    if (columns <= 0) return 0.0;
    int64_t rows = (m + c.bm - 1) / c.bm, cols = (columns + c.bn - 1) / c.bn;
    rows += (c.cluster_m == 2) ? rows % 2 : 0;
    cols += (c.cluster_n == 2) ? cols % 2 : 0;
    const double waves = static_cast<double>(
        (rows * cols + sm_count - 1) / sm_count);
    return waves * (1e-3 * c.ps_per_kmac * c.bm * c.bn * k / 1000.0 +
                    c.tile_ns);
  };
  Plan best{GemmConfig::kAuto};
  double best_ns = -1;
  for (const Candidate& c : kCandidates) {  // ties: the first listed
    if (!built(c.config)) continue;
    const double ns = estimate(c, n);
    if (best_ns < 0 || ns < best_ns) best = {c.config}, best_ns = ns;
  }
  // Both large tiles, one column block each (kSplit256x192And128x256).
  const Split split = BestSplit(m, n, sm_count);
  if (split.columns > 0 &&
      built(GemmConfig::kSplit256x192And128x256)) {
    const double ns = estimate(kCandidates[1], split.columns) +
                      estimate(kCandidates[0], n - split.columns);
    if (best_ns < 0 || ns < best_ns) {
      best = {GemmConfig::kSplit256x192And128x256, split.columns};
    }
  }
  return best;
}

}  // namespace

int64_t SplitColumns(int64_t m, int64_t n, int sm_count) {
  return BestSplit(m, n, sm_count).columns;
}

GemmConfig ChooseConfig(int64_t m, int64_t n, int64_t k, int sm_count) {
  return ChoosePlan(m, n, k, sm_count).config;
}

namespace {

thread_local std::string last_error;

// A thread that has made no CUDA runtime call yet has no current context
// (torch's autograd worker for device 0 never sets the device it already
// reports), and CUTLASS's TMA descriptors are encoded through the driver,
// which then fails with CUDA_ERROR_INVALID_CONTEXT; CUTLASS only prints
// that and launches with a bad descriptor. cudaSetDevice makes the device's
// primary context current here (CUDA 12+), once per thread and device.
// False with last_error set when it cannot.
bool MakeContextCurrent(int* device) {
  cudaGetDevice(device);
  thread_local int context_device = -1;
  if (context_device != *device) {
    if (cudaSetDevice(*device) != cudaSuccess) {
      last_error = "rlk cuda_ffi det_gemm: cannot make the CUDA context of "
                   "device " + std::to_string(*device) + " current";
      return false;
    }
    context_device = *device;
  }
  return true;
}

// Checks shared by both entry points; empty when the problem is fine.
std::string CheckProblem(int64_t m, int64_t n, int64_t k, bool ta, bool tb,
                         bool out_f32, int64_t config, int64_t swizzle,
                         int64_t raster, const DeviceInfo& info) {
  char buf[320];
  if (info.major != 9 || info.minor != 0) {
    std::snprintf(buf, sizeof buf,
                  "rlk cuda_ffi det_gemm needs an SM90 GPU (compute "
                  "capability 9.0); this one is %d.%d",
                  info.major, info.minor);
    return buf;
  }
  if (m < 0 || n < 1 || k < 1 || m > INT32_MAX || n > INT32_MAX ||
      k > INT32_MAX) {
    std::snprintf(buf, sizeof buf,
                  "rlk cuda_ffi det_gemm: unsupported sizes M=%lld N=%lld "
                  "K=%lld (need 0 <= M, 1 <= N, K < 2^31)",
                  (long long)m, (long long)n, (long long)k);
    return buf;
  }
  // TMA moves rows whose pitch is a multiple of 16 bytes. The pitches are:
  // A [M, K] -> K, A stored [K, M] -> M; B [K, N] -> N, B stored [N, K] -> K;
  // C [M, N] -> N.
  const int64_t a_pitch = ta ? m : k, b_pitch = tb ? k : n;
  if (a_pitch % 8 != 0 || b_pitch % 8 != 0 || n % (out_f32 ? 4 : 8) != 0) {
    std::snprintf(buf, sizeof buf,
                  "rlk cuda_ffi det_gemm: row pitches must be multiples of 16 "
                  "bytes for TMA: A %s has rows of %lld, B %s rows of %lld, "
                  "C [M, N] rows of %lld elements (M=%lld N=%lld K=%lld)",
                  ta ? "[K, M]" : "[M, K]", (long long)a_pitch,
                  tb ? "[N, K]" : "[K, N]", (long long)b_pitch, (long long)n,
                  (long long)m, (long long)n, (long long)k);
    return buf;
  }
  if (config < 0 || config > static_cast<int64_t>(GemmConfig::kLastConfig)) {
    std::snprintf(buf, sizeof buf, "rlk cuda_ffi det_gemm: unknown config %lld",
                  (long long)config);
    return buf;
  }
  if ((swizzle != 0 && swizzle != 1 && swizzle != 2 && swizzle != 4 &&
       swizzle != 8) || raster < 0 || raster > 2) {
    std::snprintf(buf, sizeof buf,
                  "rlk cuda_ffi det_gemm: unknown tile order swizzle=%lld "
                  "raster=%lld (swizzle 0/1/2/4/8, raster 0/1/2)",
                  (long long)swizzle, (long long)raster);
    return buf;
  }
  return "";
}

LaunchStatus LaunchOne(bool ta, bool tb, bool out_f32, const GemmProblem& p,
                       GemmConfig config, size_t* workspace_needed) {
  // CUTLASS loads a B stored [N, K] (K contiguous) in TMA boxes of the
  // tile's N rows, split between the row tiles of a cluster that multicasts
  // B. A box holds at most 256 rows, and where the driver refuses one
  // CUTLASS only prints that and launches with a bad descriptor. Of the
  // configs, only the 320-wide tile without a cluster is past the limit:
  // refused here, so the autotuner skips it for this layout (its timing
  // marks a config that cannot launch) and a caller naming it gets this
  // message.
  if (tb && config == GemmConfig::kPingpong64x320) {
    return {false, "rlk cuda_ffi det_gemm: config pingpong_64x320 cannot "
                   "read a B stored [N, K] (transpose_b): its TMA box would "
                   "be 320 rows, past the limit of 256; any other config can"};
  }
  const KernelFn kernel = FindKernel(ta, tb, out_f32, config);
  if (kernel == nullptr) {
    return {false, "rlk cuda_ffi det_gemm: this kernel config is not built "
                   "for this operand layout (yet): the build adds kernels "
                   "as it compiles them (python -m cuda_ffi.build --status)"};
  }
  return kernel(p, workspace_needed);
}

// Columns [0, columns) with 256x192, the rest with 128x256, on one
// stream. Each output element is still computed whole by one tile, K in
// order, so the bits are either config's (the device tests run this as a
// config of its own). The second kernel reads nothing the first writes, but
// it launches with PDL like any other and so waits for the first before its
// first load: ordering stays the one rule every kernel here follows, and
// the cost, the first kernel's tail, is inside the measured gain.
LaunchStatus LaunchSplit(bool ta, bool tb, bool out_f32, const GemmProblem& p,
                         int64_t columns, size_t* workspace_needed) {
  GemmProblem left = p, right = p;
  left.n = columns;
  right.n = p.n - columns;
  // B [K, N] and C [M, N]: a column block keeps the product's row pitch.
  // B stored [N, K]: a column block of the product is a block of B's rows,
  // itself densely packed.
  left.b_pitch = right.b_pitch = tb ? 0 : p.n;
  left.c_pitch = right.c_pitch = p.n;
  const int64_t b_offset = (tb ? columns * p.k : columns) * 2;  // bf16
  if (p.b != nullptr) right.b = static_cast<const char*>(p.b) + b_offset;
  if (p.c != nullptr) {
    right.c = static_cast<char*>(p.c) + columns * (out_f32 ? 4 : 2);
  }
  size_t left_needs = 0, right_needs = 0;
  if (columns > 0) {
    const LaunchStatus status = LaunchOne(
        ta, tb, out_f32, left, GemmConfig::kCooperative256x192, &left_needs);
    if (!status.ok) return status;
  }
  const LaunchStatus status = LaunchOne(
      ta, tb, out_f32, right, GemmConfig::kCooperative128x256, &right_needs);
  // One after the other on the stream: they may share one workspace.
  if (workspace_needed != nullptr) {
    *workspace_needed = std::max(left_needs, right_needs);
  }
  return status;
}

LaunchStatus Launch(bool ta, bool tb, bool out_f32, const GemmProblem& p,
                    GemmConfig config, size_t* workspace_needed) {
  Plan plan{config};
  if (config == GemmConfig::kAuto) {  // the rule, among the kernels built
    plan = ChoosePlan(p.m, p.n, p.k, p.sm_count, LayoutIndex(ta, tb, out_f32));
    if (plan.config == GemmConfig::kAuto) {
      return {false, "rlk cuda_ffi det_gemm: no kernel is built for this "
                     "operand layout yet (python -m cuda_ffi.build --status)"};
    }
  } else if (config == GemmConfig::kSplit256x192And128x256) {
    plan.split_columns = SplitColumns(p.m, p.n, p.sm_count);
  }
  if (plan.config == GemmConfig::kSplit256x192And128x256) {
    return LaunchSplit(ta, tb, out_f32, p, plan.split_columns,
                       workspace_needed);
  }
  return LaunchOne(ta, tb, out_f32, p, plan.config, workspace_needed);
}


// The autotuner's measurement (rlk_jax/_gemm_tuning.py decides what to do
// with it). Every config runs the same problem on the library's own
// buffers, on a stream of its own: the caller's streams are never waited
// on nor synchronized, and nothing is captured into a graph a caller is
// recording (this thread's capture mode is relaxed for the duration, the
// only capture is of our own stream, and the Python side never calls this
// while its stream is capturing).
//
// A config's timed launches are one CUDA graph, replayed: launched one by
// one from the host, a product of a few microseconds runs at the host's
// launch rate (every config alike: 8-10 us a launch on the H100 where the
// graph-replayed kernel took 6 us), so the choice would be noise. Users
// replay too (XLA's command buffers, torch's CUDA graphs).
// The timer's second stage (ConfigTimer::TimeSustained); finalists 0: none.
// The values come from the caller (cuda_ffi.sustained_times's defaults).
struct Sustain {
  int finalists;
  int rounds;
  double ms;
  double budget_ms;
  double heat_ms;
};

class ConfigTimer {
 public:
  ~ConfigTimer() {
    for (cudaGraphExec_t g : graphs_) cudaGraphExecDestroy(g);
    for (void* p : buffers_) cudaFreeAsync(p, stream_);
    if (stream_ != nullptr) {
      cudaStreamSynchronize(stream_);  // ours alone
      cudaStreamDestroy(stream_);
    }
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    cudaThreadExchangeStreamCaptureMode(&saved_mode_);
  }

  std::string Time(bool ta, bool tb, bool out_f32, int64_t m, int64_t n,
                   int64_t k, const int64_t* configs, int count, int rounds,
                   double min_ms, float* ms_out, const Sustain& sustain,
                   float* sustained_out) {
    cudaThreadExchangeStreamCaptureMode(&saved_mode_);
    int device = 0;
    if (!MakeContextCurrent(&device)) return last_error;
    const DeviceInfo& info = InfoOf(device);
    for (int i = 0; i < count; ++i) {
      std::string problem = CheckProblem(m, n, k, ta, tb, out_f32, configs[i],
                                         0, 0, info);
      if (!problem.empty()) return problem;
    }
    if (m < 1 || count < 1 || rounds < 1) {
      return "rlk cuda_ffi det_gemm timing: need M >= 1, configs and rounds";
    }
    if (cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking) !=
        cudaSuccess) {
      stream_ = nullptr;
      return "rlk cuda_ffi det_gemm timing: cannot create a stream";
    }
    GemmProblem p{nullptr, nullptr, nullptr, m, n, k, info.sm_count, nullptr,
                  0, stream_};
    // A config CUTLASS cannot run on this problem gets -1 and no time.
    std::vector<int> live;
    size_t workspace = 0;
    for (int i = 0; i < count; ++i) {
      size_t needed = 0;
      ms_out[i] = -1;
      if (Launch(ta, tb, out_f32, p, static_cast<GemmConfig>(configs[i]),
                 &needed).ok) {
        live.push_back(i);
        workspace = std::max(workspace, needed);
      }
    }
    if (live.empty()) {
      return "rlk cuda_ffi det_gemm timing: no config can run this problem";
    }
    const int n_live = static_cast<int>(live.size());
    // Operands as a user's call meets them, because that is what ranks the
    // configs (H100, 2026-11-24, scripts/probe_tuner_fidelity.py): with one
    // constant-valued set, re-read from a warm L2, every config ran 10-30%
    // faster than on random data from HBM, and not alike (the card draws
    // less power on constant data, so it holds higher clocks, and configs
    // trade bytes for clocks differently): the configs picked that way ran
    // 1.04x the fastest's time, geomean over 20 products, up to 1.15x.
    // So: random normal values, and enough sets, launched in turn, that
    // none is still in L2 when its turn comes again.
    const size_t a_bytes = Aligned(m * k * 2), b_bytes = Aligned(k * n * 2),
                 c_bytes = Aligned(m * n * (out_f32 ? 4 : 2));
    const int sets = OperandSets(a_bytes + b_bytes + c_bytes, device);
    void *a = nullptr, *b = nullptr, *c = nullptr, *w = nullptr;
    if (!Allocate(sets * a_bytes, &a) || !Allocate(sets * b_bytes, &b) ||
        !Allocate(sets * c_bytes, &c) ||
        (workspace && !Allocate(workspace, &w))) {
      return "rlk cuda_ffi det_gemm timing: cannot allocate the operands (" +
             std::to_string(sets * (a_bytes + b_bytes + c_bytes) + workspace) +
             " bytes)";
    }
    if (!FillRandom(a, sets * a_bytes) || !FillRandom(b, sets * b_bytes)) {
      return "rlk cuda_ffi det_gemm timing: cannot fill the operands";
    }
    p.workspace = w;
    p.workspace_bytes = workspace;
    int turn = 0;  // the set the next launch reads and writes
    auto launch = [&](int i, int times) -> bool {
      for (int t = 0; t < times; ++t, turn = (turn + 1) % sets) {
        p.a = static_cast<char*>(a) + turn * a_bytes;
        p.b = static_cast<char*>(b) + turn * b_bytes;
        p.c = static_cast<char*>(c) + turn * c_bytes;
        if (!Launch(ta, tb, out_f32, p, static_cast<GemmConfig>(configs[i]),
                    nullptr).ok) {
          return false;
        }
      }
      return true;
    };
    // Warm-up (module load, TMA descriptors), then one timed launch each
    // to size the repetitions: every sample lasts at least min_ms.
    std::vector<cudaEvent_t> probe(2 * n_live);
    for (int j = 0; j < n_live; ++j) {
      probe[2 * j] = NewEvent();
      probe[2 * j + 1] = NewEvent();
      if (!launch(live[j], 1)) {
        return "rlk cuda_ffi det_gemm timing: launch failed";
      }
      cudaEventRecord(probe[2 * j], stream_);
      launch(live[j], 1);
      cudaEventRecord(probe[2 * j + 1], stream_);
    }
    if (cudaEventSynchronize(probe.back()) != cudaSuccess) {
      return "rlk cuda_ffi det_gemm timing: the warm-up failed";
    }
    float fastest = 1e30f;
    for (int j = 0; j < n_live; ++j) {
      float ms = 0;
      cudaEventElapsedTime(&ms, probe[2 * j], probe[2 * j + 1]);
      fastest = std::min(fastest, ms);
    }
    // The probe ran at the host's pace: sizing from it gives tiny products
    // fewer repetitions than min_ms asks, never more.
    const int reps = static_cast<int>(std::min<double>(
        256, std::max<double>(sets, min_ms / std::max(fastest, 1e-4f) +
                                        0.999)));
    for (int j = 0; j < n_live; ++j) {
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      if (cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed) !=
          cudaSuccess) {
        cudaGetLastError();
        return "rlk cuda_ffi det_gemm timing: cannot capture a graph";
      }
      const bool launched = launch(live[j], reps);
      const bool captured =
          cudaStreamEndCapture(stream_, &graph) == cudaSuccess && launched;
      const bool ready = captured && cudaGraphInstantiate(&exec, graph, 0) ==
                                         cudaSuccess;
      if (graph != nullptr) cudaGraphDestroy(graph);
      if (!ready) {
        cudaGetLastError();
        return "rlk cuda_ffi det_gemm timing: cannot build the timed graph";
      }
      graphs_.push_back(exec);
      cudaGraphLaunch(exec, stream_);  // the graph's own first-launch upload
    }
    // Interleaved rounds, the order rotated every round: on a power-capped
    // card, one config after another would hand the later ones a hotter
    // card.
    std::vector<cudaEvent_t> marks(2 * n_live * rounds);
    for (cudaEvent_t& e : marks) e = NewEvent();
    for (int r = 0; r < rounds; ++r) {
      for (int t = 0; t < n_live; ++t) {
        const int j = (t + r) % n_live;
        cudaEventRecord(marks[2 * (r * n_live + j)], stream_);
        cudaGraphLaunch(graphs_[j], stream_);
        cudaEventRecord(marks[2 * (r * n_live + j) + 1], stream_);
      }
    }
    if (cudaEventSynchronize(marks.back()) != cudaSuccess ||
        cudaStreamSynchronize(stream_) != cudaSuccess) {
      return "rlk cuda_ffi det_gemm timing: the timed launches failed";
    }
    for (int j = 0; j < n_live; ++j) {
      std::vector<float> samples(rounds);
      for (int r = 0; r < rounds; ++r) {
        cudaEventElapsedTime(&samples[r], marks[2 * (r * n_live + j)],
                             marks[2 * (r * n_live + j) + 1]);
      }
      ms_out[live[j]] = Median(samples) / reps;
    }
    if (sustain.finalists > 0 && sustained_out != nullptr) {
      return TimeSustained(live, reps, sustain, ms_out, sustained_out);
    }
    return "";
  }

 private:
  static float Median(std::vector<float> samples) {
    std::sort(samples.begin(), samples.end());
    const size_t n = samples.size();
    return n % 2 ? samples[n / 2]
                 : 0.5f * (samples[n / 2 - 1] + samples[n / 2]);
  }

  // The second stage. The screen's short samples rank configs as a card at
  // rest runs them; a user's step of such products keeps the card at its
  // power cap, where the configs that draw more power per FLOP lose clock
  // (700 W, 1.3-1.5 GHz on the H100 within a second). The det_gemm_sweep
  // times each config seconds into a run, after a batch of the same config
  // (its clocks settled to what it draws): timed that way, picks ran 1.03x
  // the sweep's fastest over 10 products where the screen's ran 1.07-1.09x
  // (H100, 2026-11-24, scripts/probe_timing_structure.py); without the
  // seconds of heat before, 1.04x over 20 (scripts/probe_tuner_fidelity.py).
  // So: the card is heated first (`sustain.heat_ms` of the screen's fastest,
  // unless a tuning ended less than a second ago, as when the forward and
  // backward products of a new shape are tuned one after another), then
  // the screen's fastest few are timed again: per round, each runs
  // `sustain.ms` untimed, then as long again timed (its screen graph
  // replayed), rounds rotated, the stage held to `sustain.budget_ms` of
  // expected work.
  std::string TimeSustained(const std::vector<int>& live, int reps,
                            const Sustain& sustain, const float* ms_out,
                            float* sustained_out) {
    const int n_live = static_cast<int>(live.size());
    std::vector<int> order(n_live);  // indices into live, fastest first
    for (int j = 0; j < n_live; ++j) order[j] = j;
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) {
      return ms_out[live[x]] < ms_out[live[y]];
    });
    const int finalists = std::min(sustain.finalists, n_live);
    order.resize(finalists);
    const int rounds = std::max(1, sustain.rounds);
    float slowest_graph_ms = 0;
    for (int j : order) {
      slowest_graph_ms = std::max(slowest_graph_ms, ms_out[live[j]] * reps);
    }
    slowest_graph_ms = std::max(slowest_graph_ms, 1e-4f);
    // Graph launches per warm-up and per sample: sustain.ms of work, fewer
    // where the budget (2 x finalists x rounds of them) would not hold it,
    // never fewer than one.
    const int wanted = static_cast<int>(sustain.ms / slowest_graph_ms + 0.999);
    const int afforded = static_cast<int>(
        sustain.budget_ms / (2.0 * finalists * rounds * slowest_graph_ms));
    const int graphs = std::max(1, std::min(wanted, afforded));
    static std::mutex heat_mu;
    static std::chrono::steady_clock::time_point last_end;
    bool hot;
    {
      std::lock_guard<std::mutex> lock(heat_mu);
      hot = last_end.time_since_epoch().count() != 0 &&
            std::chrono::steady_clock::now() - last_end <
                std::chrono::seconds(1);
    }
    if (!hot) {
      const float fastest_graph_ms =
          std::max(ms_out[live[order[0]]] * reps, 1e-4f);
      const int heat = static_cast<int>(sustain.heat_ms / fastest_graph_ms);
      for (int i = 0; i < heat; ++i) {
        cudaGraphLaunch(graphs_[order[0]], stream_);
      }
    }
    std::vector<cudaEvent_t> marks(2 * finalists * rounds);
    for (cudaEvent_t& e : marks) e = NewEvent();
    for (int r = 0; r < rounds; ++r) {
      for (int t = 0; t < finalists; ++t) {
        const int f = (t + r) % finalists;
        cudaGraphExec_t g = graphs_[order[f]];
        for (int i = 0; i < graphs; ++i) cudaGraphLaunch(g, stream_);
        cudaEventRecord(marks[2 * (r * finalists + f)], stream_);
        for (int i = 0; i < graphs; ++i) cudaGraphLaunch(g, stream_);
        cudaEventRecord(marks[2 * (r * finalists + f) + 1], stream_);
      }
    }
    if (cudaEventSynchronize(marks.back()) != cudaSuccess ||
        cudaStreamSynchronize(stream_) != cudaSuccess) {
      return "rlk cuda_ffi det_gemm timing: the sustained launches failed";
    }
    {
      std::lock_guard<std::mutex> lock(heat_mu);
      last_end = std::chrono::steady_clock::now();
    }
    for (int j = 0; j < n_live; ++j) sustained_out[live[j]] = -1;
    for (int f = 0; f < finalists; ++f) {
      std::vector<float> samples(rounds);
      for (int r = 0; r < rounds; ++r) {
        cudaEventElapsedTime(&samples[r], marks[2 * (r * finalists + f)],
                             marks[2 * (r * finalists + f) + 1]);
      }
      sustained_out[live[order[f]]] = Median(samples) / (graphs * reps);
    }
    return "";
  }

  // Each set starts 256-byte aligned (TMA needs 16).
  static size_t Aligned(size_t bytes) { return (bytes + 255) / 256 * 256; }

  // Sets of `set_bytes` each whose sum passes four times this device's L2
  // and 256 MB (the det_gemm_sweep's rule for a user's distinct layers), at
  // most 32: a product large enough gets one.
  static int OperandSets(size_t set_bytes, int device) {
    int l2 = 0;
    cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device);
    const size_t cold = std::max<size_t>(size_t{256} << 20, size_t{4} * l2);
    return static_cast<int>(
        std::min<size_t>(32, std::max<size_t>(1, (cold + set_bytes - 1) /
                                                     set_bytes)));
  }

  // Normal bf16 values (never zeros: some hardware paths treat them more
  // cheaply): a 2 MB block drawn on the host from a fixed seed, copied in,
  // then doubled device to device until the buffer is full.
  bool FillRandom(void* buffer, size_t bytes) {
    constexpr size_t kBlock = size_t{1} << 20;  // bf16 values
    static const std::vector<uint16_t> block = [] {
      std::vector<uint16_t> v(kBlock);
      uint64_t state = 0x9e3779b97f4a7c15ull;
      auto uniform = [&state] {  // splitmix64, top 24 bits
        uint64_t z = (state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return static_cast<float>((z ^ (z >> 31)) >> 40) / 16777216.0f;
      };
      for (uint16_t& x : v) {
        // Irwin-Hall(4), scaled to unit variance: close enough to normal.
        float f = (uniform() + uniform() + uniform() + uniform() - 2.0f) *
                  1.7320508f;
        if (f == 0.0f) f = 0.5f;
        uint32_t u = 0;
        std::memcpy(&u, &f, 4);
        x = static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
      }
      return v;
    }();
    const size_t first = std::min(bytes, kBlock * 2);
    if (cudaMemcpyAsync(buffer, block.data(), first, cudaMemcpyHostToDevice,
                        stream_) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    char* base = static_cast<char*>(buffer);
    for (size_t filled = first; filled < bytes; filled *= 2) {
      if (cudaMemcpyAsync(base + filled, base,
                          std::min(filled, bytes - filled),
                          cudaMemcpyDeviceToDevice, stream_) != cudaSuccess) {
        cudaGetLastError();
        return false;
      }
    }
    return true;
  }

  bool Allocate(size_t bytes, void** ptr) {
    if (cudaMallocAsync(ptr, std::max<size_t>(bytes, 16), stream_) !=
        cudaSuccess) {
      cudaGetLastError();  // not sticky: clear it for the caller's next call
      return false;
    }
    buffers_.push_back(*ptr);
    return true;
  }

  cudaEvent_t NewEvent() {
    cudaEvent_t e = nullptr;
    cudaEventCreate(&e);
    events_.push_back(e);
    return e;
  }

  cudaStream_t stream_ = nullptr;
  std::vector<void*> buffers_;
  std::vector<cudaEvent_t> events_;
  std::vector<cudaGraphExec_t> graphs_;
  cudaStreamCaptureMode saved_mode_ = cudaStreamCaptureModeRelaxed;
};

ffi::Error DetGemmFfi(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                      ffi::Result<ffi::AnyBuffer> c,
                      ffi::Result<ffi::AnyBuffer> workspace, bool transpose_a,
                      bool transpose_b, int64_t config, int64_t swizzle,
                      int64_t raster) {
  auto da = a.dimensions(), db = b.dimensions(), dc = c->dimensions();
  if (da.size() != 2 || db.size() != 2 || dc.size() != 2) {
    return ffi::Error::InvalidArgument(
        "rlk cuda_ffi det_gemm: operands and result must be rank 2");
  }
  if (a.element_type() != ffi::BF16 || b.element_type() != ffi::BF16) {
    return ffi::Error::InvalidArgument(
        "rlk cuda_ffi det_gemm: operands must be bfloat16");
  }
  const bool out_f32 = c->element_type() == ffi::F32;
  if (!out_f32 && c->element_type() != ffi::BF16) {
    return ffi::Error::InvalidArgument(
        "rlk cuda_ffi det_gemm: the result must be bfloat16 or float32");
  }
  const int64_t m = transpose_a ? da[1] : da[0];
  const int64_t k = transpose_a ? da[0] : da[1];
  const int64_t n = transpose_b ? db[0] : db[1];
  const int64_t kb = transpose_b ? db[1] : db[0];
  if (kb != k || dc[0] != m || dc[1] != n) {
    return ffi::Error::InvalidArgument(
        "rlk cuda_ffi det_gemm: shapes disagree: A [" + std::to_string(da[0]) +
        ", " + std::to_string(da[1]) + "], B [" + std::to_string(db[0]) +
        ", " + std::to_string(db[1]) + "], C [" + std::to_string(dc[0]) +
        ", " + std::to_string(dc[1]) + "]");
  }
  if (m == 0) return ffi::Error::Success();
  const DeviceInfo& info = CurrentDeviceInfo();
  const std::string problem = CheckProblem(
      m, n, k, transpose_a, transpose_b, out_f32, config, swizzle, raster, info);
  if (!problem.empty()) return ffi::Error::InvalidArgument(problem);

  GemmProblem p{a.untyped_data(), b.untyped_data(), nullptr, m, n, k,
                info.sm_count, nullptr, 0, stream, static_cast<int>(swizzle),
                static_cast<int>(raster)};
  const auto cfg = static_cast<GemmConfig>(config);
  size_t needed = 0;
  LaunchStatus status = Launch(transpose_a, transpose_b, out_f32, p, cfg,
                               &needed);
  if (!status.ok) return ffi::Error::Internal(status.message);
  if (needed > workspace->size_bytes()) {
    return ffi::Error::InvalidArgument(
        "rlk cuda_ffi det_gemm: the kernel needs " + std::to_string(needed) +
        " workspace bytes, the workspace result has " +
        std::to_string(workspace->size_bytes()));
  }
  p.workspace = workspace->untyped_data();
  p.workspace_bytes = workspace->size_bytes();
  p.c = c->untyped_data();
  status = Launch(transpose_a, transpose_b, out_f32, p, cfg, nullptr);
  if (!status.ok) return ffi::Error::Internal(status.message);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace rlk

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlkDetGemmSm90, rlk::DetGemmFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b")
                                  .Attr<int64_t>("config")
                                  .Attr<int64_t>("swizzle")
                                  .Attr<int64_t>("raster"),
                              RLK_FFI_TRAITS);

extern "C" {

// The torch bridge's entry: launches on `stream` (torch's current stream),
// so stream order and the caching allocator's reuse rules hold by
// construction. Returns NULL, or a message valid until the next call on this
// thread. `out_f32` selects the result dtype; `workspace` may be NULL when
// rlk_det_gemm_sm90_workspace reported 0 bytes.
const char* rlk_det_gemm_sm90(int transpose_a, int transpose_b, int out_f32,
                              const void* a, const void* b, void* c,
                              int64_t m, int64_t n, int64_t k, int64_t config,
                              void* workspace, size_t workspace_bytes,
                              void* stream) {
  using namespace rlk;
  if (m == 0) return nullptr;
  int device = 0;
  if (!MakeContextCurrent(&device)) return last_error.c_str();
  const DeviceInfo& info = InfoOf(device);
  last_error = CheckProblem(m, n, k, transpose_a, transpose_b, out_f32, config,
                            0, 0, info);
  if (!last_error.empty()) return last_error.c_str();
  GemmProblem p{a, b, c, m, n, k, info.sm_count, workspace, workspace_bytes,
                static_cast<cudaStream_t>(stream)};
  LaunchStatus status = Launch(transpose_a, transpose_b, out_f32, p,
                               static_cast<GemmConfig>(config), nullptr);
  if (status.ok) return nullptr;
  last_error = status.message;
  return last_error.c_str();
}

// Workspace bytes a call needs (0 for the persistent schedulers used here),
// or -1 with the message in *error.
int64_t rlk_det_gemm_sm90_workspace(int transpose_a, int transpose_b,
                                    int out_f32, int64_t m, int64_t n,
                                    int64_t k, int64_t config,
                                    const char** error) {
  using namespace rlk;
  const DeviceInfo& info = CurrentDeviceInfo();
  last_error = CheckProblem(m, n, k, transpose_a, transpose_b, out_f32, config,
                            0, 0, info);
  if (!last_error.empty()) {
    *error = last_error.c_str();
    return -1;
  }
  GemmProblem p{nullptr, nullptr, nullptr, m, n, k, info.sm_count, nullptr,
                0, nullptr};
  size_t needed = 0;
  LaunchStatus status = Launch(transpose_a, transpose_b, out_f32, p,
                               static_cast<GemmConfig>(config), &needed);
  if (!status.ok) {
    last_error = status.message;
    *error = last_error.c_str();
    return -1;
  }
  return static_cast<int64_t>(needed);
}

// Times `count` configs (GemmConfig codes) on an M x N x K problem of this
// layout and output dtype: median milliseconds per launch over `rounds`
// interleaved rounds, each sample at least `min_ms` long, into ms_out.
// Then, where `finalists` > 0, the fastest `finalists` of them again, each
// sample of about `sustain_ms` after as long of the same config untimed,
// over `sustain_rounds` rounds, the stage held to about `budget_ms`, on a
// card first heated with `heat_ms` of work unless a tuning ended less than
// a second ago, into sustained_out (-1 for the others). Allocates its own
// operands on a stream of its own (never the caller's). Returns NULL, or a
// message valid until the next call on this thread.
const char* rlk_det_gemm_sm90_time_configs(
    int transpose_a, int transpose_b, int out_f32, int64_t m, int64_t n,
    int64_t k, const int64_t* configs, int count, int rounds, double min_ms,
    float* ms_out, int finalists, int sustain_rounds, double sustain_ms,
    double budget_ms, double heat_ms, float* sustained_out) {
  using namespace rlk;
  std::string error;
  {
    ConfigTimer timer;
    error = timer.Time(transpose_a, transpose_b, out_f32, m, n, k, configs,
                       count, rounds, min_ms, ms_out,
                       Sustain{finalists, sustain_rounds, sustain_ms,
                               budget_ms, heat_ms},
                       sustained_out);
  }
  if (error.empty()) return nullptr;
  last_error = error;
  return last_error.c_str();
}

// Adds a kernel (a launch function of a kernel library, built from
// det_gemm_kernels.cu for this layout and GemmConfig code): 0, or -1 for a
// layout or code out of range.
int rlk_det_gemm_sm90_add_kernel(int transpose_a, int transpose_b,
                                 int out_f32, int64_t config, void* launch) {
  using namespace rlk;
  if (config <= 0 || config >= kConfigSlots || launch == nullptr ||
      config == static_cast<int64_t>(GemmConfig::kSplit256x192And128x256)) {
    return -1;
  }
  KernelFn expected = nullptr;
  kernels[LayoutIndex(transpose_a, transpose_b, out_f32)][config]
      .compare_exchange_strong(expected, reinterpret_cast<KernelFn>(launch),
                               std::memory_order_acq_rel);
  return 0;
}

// The instantiation an auto call picks on the current device (a GemmConfig
// code), so tests and benchmarks can name what ran.
int rlk_det_gemm_sm90_choose_config(int64_t m, int64_t n, int64_t k) {
  return static_cast<int>(
      rlk::ChooseConfig(m, n, k, rlk::CurrentDeviceInfo().sm_count));
}

// The same rule among the configs built for this layout (0: none is yet).
int rlk_det_gemm_sm90_choose_built_config(int transpose_a, int transpose_b,
                                          int out_f32, int64_t m, int64_t n,
                                          int64_t k) {
  using namespace rlk;
  return static_cast<int>(
      ChoosePlan(m, n, k, CurrentDeviceInfo().sm_count,
                 LayoutIndex(transpose_a, transpose_b, out_f32))
          .config);
}

// The columns a kSplit256x192And128x256 call (forced, or auto where
// ChooseConfig picks it) gives its 256x192 kernel on the current device; 0
// when N <= 192.
int64_t rlk_det_gemm_sm90_split_columns(int64_t m, int64_t n) {
  return rlk::SplitColumns(m, n, rlk::CurrentDeviceInfo().sm_count);
}

}  // extern "C"
