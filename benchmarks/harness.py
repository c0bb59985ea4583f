"""What every ``bench_*.py`` shares: flags, timing, the CSV schema, the table.

Timing: device work is asynchronous, so a timed batch enqueues ``iters`` calls
back to back and blocks once at the end; the batch time over ``iters`` is one
sample, the median over batches is reported. JAX calls are unrolled over
several distinct input sets inside one jit, so host dispatch is paid once per
set of calls and the figure is device time; the distinct buffers also keep
repeated calls from re-reading a warm L2.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Sequence

import jax
from absl import flags

import rlk_jax

SMOKE = flags.DEFINE_bool(
    "smoke", None, "Tiny CPU-friendly sizes. Default: on when no GPU is present.")
CSV = flags.DEFINE_string("csv", None, "Append result rows to this CSV file.")
REPEATS = flags.DEFINE_integer("repeats", 15, "Timed batches per case (median).")

COLUMNS = ("date", "commit", "device", "benchmark", "case", "implementation",
           "median_ms", "gbps", "tflops", "floor_ms", "ratio_to_floor",
           "peak_mem_mb", "note", "kernel_ms")


@dataclasses.dataclass
class Row:
  benchmark: str
  case: str
  implementation: str
  median_ms: float | None = None
  gbps: float | None = None
  floor_ms: float | None = None
  peak_mem_mb: float | None = None
  note: str = ""
  tflops: float | None = None
  kernel_ms: float | None = None  # the kernels' own time per call (CUPTI)

  @property
  def ratio_to_floor(self) -> float | None:
    if self.median_ms is None or not self.floor_ms:
      return None
    return self.median_ms / self.floor_ms


_OUTPUT_DIR: list[str] = []


def set_output_dir(path: str) -> None:
  """Where the main job writes its report: benchmarks may put side files
  (tables, extra CSVs) there."""
  _OUTPUT_DIR[:] = [path]


def output_dir() -> str:
  return _OUTPUT_DIR[0] if _OUTPUT_DIR else os.getcwd()


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def smoke_mode() -> bool:
  return (not on_gpu()) if SMOKE.value is None else SMOKE.value


def device_name() -> str:
  dev = jax.devices()[0]
  return getattr(dev, "device_kind", dev.platform) or dev.platform


def commit() -> str:
  # The device machine runs a copy of the working tree whose .git may lag
  # behind it: there the caller names the commit (scripts/gpu_suite.sh).
  if os.environ.get("RLK_COMMIT", "unknown") != "unknown":
    return os.environ["RLK_COMMIT"]
  here = os.path.dirname(os.path.abspath(__file__))
  try:
    rev = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here,
                         capture_output=True, text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           cwd=here, capture_output=True, text=True).stdout.strip()
    return rev + ("-dirty" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return os.environ.get("RLK_COMMIT", "unknown")


def time_interleaved(batches: dict[str, tuple[Callable[[int], None], int]],
                     *, iters: int, repeats: int | None = None,
                     warmup: int = 2) -> dict[str, float]:
  """Median milliseconds per call of each implementation.

  `batches[name] = (run_batch, calls)`: `run_batch(n)` enqueues n iterations
  of `calls` calls each and blocks at the end. One sample of each
  implementation per round, in an order rotated every round: on a
  power-capped card (the H100 here drops from 1.9 to 1.3-1.5 GHz within a
  second of large GEMMs) timing one implementation after another would hand
  the later ones a hotter, slower card.

  A sample is the time `iters` more iterations add: a batch of `2 * iters`
  less one of `iters`, timed back to back. What a batch costs once, however
  long it is (the host's dispatch of its first call, the wait at its end,
  a graph's launch), cancels, and the figure is a call's time within a run
  of calls, as in a training or decode step. (Timed whole, a 2 ms batch of
  jitted products carried 5-15% of such once-per-batch time that a CUDA
  graph's replay did not: H100, 2026-11-24.) Give a batch of `iters` about
  10 ms of work: shorter ones still favour the route that pauses longer
  between batches (the card runs faster just after a pause). Where the
  added time is lost in the noise (a median of zero or less: calls far
  shorter than the timer's jitter), the figure is the longer batch's time
  per call instead, an upper bound.
  """
  if repeats is None and flags.FLAGS.is_parsed() and smoke_mode():
    # Smoke sizes show that a benchmark runs end to end; their times (the
    # kernels in interpreters) measure nothing worth the repeats: one
    # warm-up call and one round (batches of one and two calls); --repeats
    # asks for more rounds. (A GPU run with --smoke too.)
    warmup, iters = min(warmup, 1), 1
    repeats = REPEATS.value if REPEATS.present else 1
  repeats = repeats or REPEATS.value
  names = list(batches)
  for name in names:
    for _ in range(warmup):
      batches[name][0](1)
  added = {name: [] for name in names}
  whole = {name: [] for name in names}
  for r in range(repeats):
    for name in names[r % len(names):] + names[:r % len(names)]:
      run_batch, calls = batches[name]
      start = time.perf_counter()
      run_batch(iters)
      middle = time.perf_counter()
      run_batch(2 * iters)
      longer = time.perf_counter() - middle
      added[name].append((longer - (middle - start)) * 1e3 / iters / calls)
      whole[name].append(longer * 1e3 / (2 * iters) / calls)
  medians = {}
  for name in names:
    medians[name] = statistics.median(added[name])
    if medians[name] <= 0:
      medians[name] = statistics.median(whole[name])
  return medians


def time_batches(run_batch: Callable[[int], None], *, iters: int,
                 repeats: int | None = None, warmup: int = 2) -> float:
  """Median milliseconds per iteration of `run_batch(n)` (n iterations,
  blocking at the end)."""
  return time_interleaved({"": (run_batch, 1)}, iters=iters, repeats=repeats,
                          warmup=warmup)[""]


def tune_traced_products() -> bool:
  """Tunes the det_gemm products first met in the traces just made (no
  tuning runs inside a trace: they ran the table's or the rule's configs)
  and, where there were any, drops jit's traces (it keeps them, a jitted
  `fn`'s own included), so the next call traces again and runs the tuned
  configs, as a user's later traces would. True where it did."""
  if not rlk_jax.det_gemm_tune_pending():
    return False
  jax.clear_caches()
  return True


def jax_batch(fn: Callable, arg_sets: Sequence[tuple],
              outputs: list | None = None):
  """`(run_batch, calls)` for time_interleaved: one jitted call runs `fn` on
  every arg set (one launch sequence back to back, one host dispatch), so
  the figure is the device's time per call, not the host's dispatch
  latency. Give every set its own buffers: identical inputs would let XLA
  merge the calls. `outputs`, where given, receives the first call's
  result per arg set (checking bits costs no compile of its own)."""
  many = jax.jit(lambda sets: [fn(*s) for s in sets])
  first = jax.block_until_ready(many(list(arg_sets)))  # compile
  if tune_traced_products():
    first = jax.block_until_ready(many(list(arg_sets)))
  if outputs is not None:
    outputs.extend(first)

  def batch(n):
    out = None
    for _ in range(max(n, 1)):
      out = many(list(arg_sets))
    jax.block_until_ready(out)

  return batch, len(arg_sets)


def cupti_kernel_time(run_batch: Callable, batches: int,
                      calls_per_batch: int) -> tuple[float, float] | None:
  """``(wall_ms, kernel_ms)`` per call over the second half of `batches`
  batches run back to back under one CUPTI trace (torch.profiler; it sees
  XLA's kernels too, graph-launched ones included): wall is the span from
  that half's first kernel start to its last kernel end, kernel time the
  part of it in which some kernel ran (the union of the kernels'
  intervals). Both come from the same stretch, on a card as hot as in the
  timed rounds. None without torch or when no kernel was seen."""
  return cupti_kernel_times({"": (run_batch, calls_per_batch)}, batches)[""]


# A kernel launched between two competitors in one trace, so their kernels
# part there (torch.cuda._sleep's spin kernel: no competitor launches it).
_MARKER = "spin_kernel"


def cupti_kernel_times(batches: dict[str, tuple[Callable, int]],
                       n_batches: int) -> dict[str, tuple[float, float] | None]:
  """cupti_kernel_time for several competitors in one trace (a profiler
  session costs about a second to start and read): `batches[name] =
  (run_batch, calls_per_batch)`, each run for `n_batches` batches in turn,
  a marker kernel between two. All None without torch."""
  torch = torch_or_none()
  if torch is None:
    return {name: None for name in batches}
  from torch.profiler import ProfilerActivity, profile
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for run_batch, _ in batches.values():
      run_batch(n_batches)  # blocks at its end
      torch.cuda._sleep(1000)
      torch.cuda.synchronize()
  kernels = sorted((e.time_range.start, e.time_range.end, e.name)
                   for e in prof.events() if e.device_type.name == "CUDA")
  parts, part = [], []
  for start, end, name in kernels:
    if _MARKER in name:
      parts.append(part)
      part = []
    else:
      part.append((start, end))
  if len(parts) != len(batches):
    raise RuntimeError(f"{len(parts)} marker kernels in the trace for "
                       f"{len(batches)} competitors")
  return {name: _busy_per_call(spans, n_batches * calls)
          for (name, (_, calls)), spans in zip(batches.items(), parts)}


def _busy_per_call(spans, calls: int) -> tuple[float, float] | None:
  """(wall_ms, kernel_ms) per call over the second half of `calls` calls'
  kernel spans (sorted), or None where there are fewer spans than calls."""
  per_call = len(spans) // calls
  if not per_call:
    return None
  counted = calls // 2 or 1
  hot = spans[-counted * per_call:]
  busy_us, reach = 0.0, hot[0][0]
  for start, end in hot:  # overlapping kernels count once
    busy_us += max(0.0, end - max(start, reach))
    reach = max(reach, end)
  return (reach - hot[0][0]) / counted / 1e3, busy_us / counted / 1e3


def kernel_names(torch, fn) -> list[str]:
  """The CUDA kernels one call of `fn` launches (torch's profiler): which
  kernel a library chose, e.g. cuBLAS's tile and cluster."""
  fn()
  torch.cuda.synchronize()
  with torch.profiler.profile(
      activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    fn()
    torch.cuda.synchronize()
  return sorted({e.key for e in prof.key_averages()
                 if e.device_type == torch.autograd.DeviceType.CUDA})


def traced_kernel_times(batches: dict[str, tuple[Callable, int]],
                        n_batches: int
                        ) -> tuple[dict[str, tuple[float, float] | None], str]:
  """cupti_kernel_times, and a note saying why where the trace failed (the
  figures it would have added are then left out, not guessed)."""
  try:
    return cupti_kernel_times(batches, n_batches), ""
  except Exception as e:  # noqa: BLE001 - reported, the rest still stands
    return ({name: None for name in batches},
            f"kernel time failed: {type(e).__name__}: {e}"[:160])


def time_jax(fn: Callable, arg_sets: Sequence[tuple], *, iters: int = 10,
             repeats: int | None = None) -> float:
  """Median device milliseconds per call of `fn`, over distinct `arg_sets`
  (jax_batch)."""
  return time_interleaved({"": jax_batch(fn, arg_sets)}, iters=iters,
                          repeats=repeats)[""]


def _failed_row(benchmark, case, implementation, e: Exception) -> Row:
  return Row(benchmark, case, implementation, note=f"FAILED: {type(e).__name__}"
             f": {str(e).splitlines()[0][:120] if str(e) else ''}")


def timed_row(benchmark, case, implementation, fn, arg_sets, *, nbytes=None,
              flops=None, floor_ms=None, note="", peak_mem_mb=None,
              iters: int = 10) -> Row:
  """Times `fn` into a Row; a competitor that fails is recorded as a row with
  the error and no time, so one broken competitor does not hide the rest."""
  try:
    ms = time_jax(fn, arg_sets, iters=iters)
  except Exception as e:  # noqa: BLE001 - reported in the table, not hidden
    row = _failed_row(benchmark, case, implementation, e)
  else:
    row = Row(benchmark, case, implementation, ms,
              nbytes / ms / 1e6 if nbytes else None, floor_ms, note=note,
              tflops=flops / ms / 1e9 if flops else None)
  row.peak_mem_mb = peak_mem_mb
  return progress(row)


def interleaved_rows(benchmark, case, competitors: dict[str, Callable], *,
                     flops=None, iters: int = 10, repeats: int | None = None,
                     warmup: int = 2, kernel_times: bool = False) -> list[Row]:
  """Rows for competitors timed against each other by time_interleaved.
  `competitors[name]()` builds its `(run_batch, calls)` (jax_batch,
  torch_batch); one that fails to build is a row with the error. With
  `kernel_times`, each row also gets its kernels' time per call
  (`kernel_ms`: `cupti_kernel_time` over 2 x iters batches; a profiler that
  fails leaves it empty and says why in the note): kernel against kernel,
  where a small product's wall time measures the host's dispatch."""
  batches, failed = {}, {}
  for name, make in competitors.items():
    try:
      batches[name] = make()
    except Exception as e:  # noqa: BLE001 - reported in the table
      failed[name] = _failed_row(benchmark, case, name, e)
  try:
    times = (time_interleaved(batches, iters=iters, repeats=repeats,
                              warmup=warmup) if batches else {})
  except Exception as e:  # noqa: BLE001 - one failure stops the shared rounds
    failed.update({name: _failed_row(benchmark, case, name, e)
                   for name in batches})
  seen, why = ({}, "")
  if kernel_times:
    seen, why = traced_kernel_times(
        {name: batch for name, batch in batches.items() if name in times},
        2 * iters)
  rows = []
  for name in competitors:
    if name in failed:
      rows.append(progress(failed[name]))
      continue
    ms = times[name]
    row = Row(benchmark, case, name, ms,
              tflops=flops / ms / 1e9 if flops else None, note=why)
    if seen.get(name):
      row.kernel_ms = seen[name][1]
    rows.append(progress(row))
  return rows


def copy_bandwidth(benchmark, xs, to_torch=None) -> tuple[float, list[Row]]:
  """Device-to-device copy bandwidth (bytes read + written per second, in
  GB/s): the better of XLA's elementwise copy over the buffers `xs` and
  torch's `copy_` (where torch is here; `to_torch(torch, x)` makes its
  tensor, a zero-copy view by default). The byte floors of memory-bound
  products divide by it; its rows go in the record."""
  import jax.numpy as jnp
  rows = []
  x = xs[0]
  nbytes = 2 * x.size * x.dtype.itemsize
  copy = lambda a, c: a + c  # one read, one write
  ms = time_jax(copy, [(xs[i % len(xs)], jnp.asarray(i + 1, x.dtype))
                       for i in range(max(len(xs), 16))])
  rows.append(Row(benchmark, "copy", "xla_elementwise_copy", ms,
                  nbytes / ms / 1e6))
  best = nbytes / ms / 1e6
  torch = torch_or_none()
  if torch is not None:
    t = (to_torch or (lambda torch, x: torch.from_dlpack(x)))(torch, x)
    dst = torch.empty_like(t)
    ms_t = time_torch(lambda a: dst.copy_(a), [(t,)])
    rows.append(Row(benchmark, "copy", "torch_copy", ms_t, nbytes / ms_t / 1e6))
    best = max(best, nbytes / ms_t / 1e6)
  return best, rows


def progress(row: Row) -> Row:
  """Prints a row as soon as it is measured: progress, and a record if a
  time limit stops the run before the report is written."""
  peak = f" | peak {row.peak_mem_mb:.1f} MB" if row.peak_mem_mb is not None else ""
  if row.kernel_ms is not None:
    peak += f" | kernels {row.kernel_ms:.6g} ms"
  print(f"  {row.case} | {row.implementation} | {row.median_ms} ms | "
        f"{row.tflops or row.gbps or ''}{peak} | {row.note}", file=sys.stderr,
        flush=True)
  return row


def torch_batch(fn: Callable, arg_sets: Sequence[tuple], *,
                graph: bool = False):
  """`(run_batch, calls)` for time_interleaved: `fn` over the arg sets in
  turn. graph=True captures one call per set into a CUDA graph and replays
  it, as XLA's command buffers replay ours: launch cost stays out of the
  figure (a torch loop of decode products measures the host)."""
  import torch
  sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
  fn(*arg_sets[0])
  sync()
  if graph:
    g = torch_graph(fn, arg_sets)

    def replay(n):
      for _ in range(max(n, 1)):
        g.replay()
      sync()

    return replay, len(arg_sets)

  def batch(n):
    for i in range(max(n, 1)):
      fn(*arg_sets[i % len(arg_sets)])
    sync()

  return batch, 1


def torch_graph(fn: Callable, arg_sets: Sequence[tuple],
                calls: int | None = None):
  """A torch CUDA graph of `calls` calls of `fn` (default one per arg set),
  going through the arg sets in turn."""
  import torch
  # Warm up (handles, workspaces, autograd's streams) outside the capture,
  # on a side stream as torch's CUDA-graph notes ask.
  side = torch.cuda.Stream()
  side.wait_stream(torch.cuda.current_stream())
  with torch.cuda.stream(side):
    for s in arg_sets:
      fn(*s)
  torch.cuda.current_stream().wait_stream(side)
  torch.cuda.synchronize()
  g = torch.cuda.CUDAGraph()
  # thread_local: XLA's own threads may touch CUDA during the capture.
  with torch.cuda.graph(g, capture_error_mode="thread_local"):
    for i in range(len(arg_sets) if calls is None else calls):
      fn(*arg_sets[i % len(arg_sets)])
  return g


def time_torch(fn: Callable, arg_sets: Sequence[tuple], *, iters: int = 20,
               repeats: int | None = None) -> float:
  return time_interleaved({"": torch_batch(fn, arg_sets)}, iters=iters,
                          repeats=repeats)[""]


def write_csv(rows: Sequence[Row], path: str) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  new = not os.path.exists(path)
  stamp = dict(date=datetime.date.today().isoformat(), commit=commit(),
               device=device_name())
  # Appending to a CSV written before a column was added: its own header's
  # columns, so every row stays aligned with it.
  columns = COLUMNS
  if not new:
    with open(path, newline="") as f:
      columns = next(csv.reader(f), COLUMNS)
  with open(path, "a", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
    if new:
      writer.writeheader()
    for row in rows:
      record = dataclasses.asdict(row)
      record["ratio_to_floor"] = row.ratio_to_floor
      writer.writerow({k: _fmt(v) for k, v in {**stamp, **record}.items()})


def _fmt(v):
  if isinstance(v, float):
    return f"{v:.6g}"
  return "" if v is None else v


def peer_ratios(rows: Sequence[Row], peer: str) -> list[float | None]:
  """Each row's time over the `peer` implementation's time in the same case."""
  peer_ms = {r.case: r.median_ms for r in rows
             if r.implementation == peer and r.median_ms}
  return [r.median_ms / peer_ms[r.case]
          if r.median_ms and r.case in peer_ms else None for r in rows]


def format_table(rows: Sequence[Row], peer: str | None = None) -> str:
  headers = ("benchmark", "case", "implementation", "ms", "GB/s", "TFLOP/s",
             "x floor", "x peer", "peak MB", "note")
  ratios = peer_ratios(rows, peer) if peer else [None] * len(rows)
  body = [(r.benchmark, r.case, r.implementation, _num(r.median_ms, 4),
           _num(r.gbps, 1), _num(r.tflops, 1), _num(r.ratio_to_floor, 2),
           _num(x, 2), _num(r.peak_mem_mb, 1), r.note)
          for r, x in zip(rows, ratios)]
  widths = [max(len(str(c)) for c in col) for col in zip(headers, *body)]
  line = lambda cells: "| " + " | ".join(
      str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
  sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
  return "\n".join([line(headers), sep, *map(line, body)])


def _num(v, digits):
  return "" if v is None else f"{v:.{digits}g}" if abs(v) < 1 else f"{v:.{digits}f}".rstrip("0").rstrip(".")


def torch_or_none():
  """torch if it is installed (the peers' baselines), else None."""
  try:
    import torch
  except ImportError:
    return None
  return torch


def bench_main(run: Callable[[bool], Sequence[Row]]) -> Callable:
  """The absl main of a bench_<op>.py: run, print the table, append the CSV."""

  def main(argv):
    del argv
    rows = run(smoke_mode())
    print(format_table(rows))
    if CSV.value:
      write_csv(rows, CSV.value)

  return main
