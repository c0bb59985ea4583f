"""Figures from a benchmark CSV (the one ``python -m benchmarks`` writes).

    python -m benchmarks.plots RESULTS.csv OUT_DIR

Every figure is built from rows alone, so it works on any run: a GPU run, a
smoke run, or a CSV written before a column existed (missing cells read as
None). A figure whose rows are absent is skipped, not drawn empty.

The figures use matplotlib's object API (``matplotlib.figure.Figure``), not
pyplot: no backend is chosen and no global figure state is touched, so the
same functions save PNGs headless and display inline in a notebook.
Importing this module does not import matplotlib.
"""

from __future__ import annotations

import collections
import csv
import functools
import glob
import math
import os
import re
import subprocess
import sys
import tempfile

NUMERIC = ("median_ms", "gbps", "tflops", "floor_ms", "ratio_to_floor",
           "peak_mem_mb")


# ---------------------------------------------------------------- reading

def read_rows(csv_path: str) -> list[dict]:
  """Rows as dicts with numbers parsed; absent or empty cells are None."""
  with open(csv_path, newline="") as f:
    rows = list(csv.DictReader(f))
  for row in rows:
    for key in NUMERIC:
      row[key] = _float(row.get(key))
    row["note"] = row.get("note") or ""
  return rows


def _float(text):
  try:
    return float(text) if text not in (None, "") else None
  except ValueError:
    return None


def _param(case: str, key: str) -> float | None:
  """The number after `key=` in a case string ("... K=4096 ..." -> 4096)."""
  match = re.search(rf"(?<![A-Za-z_]){re.escape(key)}=([0-9.]+)", case)
  return float(match.group(1)) if match else None


def select(rows, benchmark: str, keep=lambda row: True) -> list[dict]:
  return [r for r in rows if r["benchmark"] == benchmark and keep(r)]


def _stamp(rows) -> str:
  """'device @ commit (date)' of the plotted rows: a title must say where
  and from which code the numbers came. Mixed runs list every value."""
  def joined(key):
    return ", ".join(sorted({r.get(key) or "?" for r in rows}))
  return f"{joined('device')} @ {joined('commit')} ({joined('date')})"


def _ordered(names, first=()) -> list[str]:
  """Peers first (in the given order), then the rest as they appeared."""
  seen = list(dict.fromkeys(names))
  return [n for n in first if n in seen] + [n for n in seen if n not in first]


# ---------------------------------------------------------------- drawing

# One colour per competitor in every figure: the torch/cuBLAS peer, the XLA
# peer, then rlk's implementations; other names take the remaining colours.
COLORS = {"cublas": "C0", "torch_native": "C0", "torch_dense": "C0",
          "torch_boolean_index": "C0", "xla_dot": "C1", "xla_dense": "C1",
          "xla_nonzero_take": "C1", "rlk_pallas": "C2", "rlk_cuda_ffi": "C3",
          "rlk_xla": "C4", "cublas_no_splitk": "C5"}


def _colors(labels) -> dict[str, str]:
  """Colour per series label ("rlk_pallas N=4096" is coloured as rlk_pallas)."""
  spare = iter(f"C{i}" for i in (6, 7, 8, 9, 5, 4, 3, 2, 1, 0) * 3)
  return {l: COLORS.get(l.split(" ")[0]) or next(spare) for l in labels}


def _figure(ncols: int = 1, width: float = 7.0, height: float = 4.5):
  from matplotlib.figure import Figure
  fig = Figure(figsize=(width * ncols, height), layout="constrained")
  axes = fig.subplots(1, ncols, squeeze=False)[0]
  return fig, list(axes)


def _bars(ax, groups: list[str], series: dict[str, dict[str, float]]):
  """Grouped bars: one group per x label, one bar per series. A missing
  value (a failed competitor) leaves a gap, not a zero bar."""
  width = 0.8 / max(len(series), 1)
  colors = _colors(series)
  for i, (name, values) in enumerate(series.items()):
    xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
    heights = [values.get(label, float("nan")) for label in groups]
    ax.bar(xs, heights, width, label=name, color=colors[name])
  ax.set_xticks(range(len(groups)), groups, fontsize=8)
  # Outside the axes: inside, it hides the tallest bars.
  ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _grouped_bar_figure(rows, value: str, title: str, ylabel: str,
                        first=(), label=lambda case: case, log=False):
  """Bars of `value` per case (x) and implementation (bar)."""
  rows = [r for r in rows if r[value] is not None]
  if not rows:
    return None
  groups = _ordered(label(r["case"]) for r in rows)
  series = {impl: {label(r["case"]): r[value] for r in rows
                   if r["implementation"] == impl}
            for impl in _ordered((r["implementation"] for r in rows), first)}
  fig, (ax,) = _figure(width=max(7.0, 1.5 * len(groups) + 2))
  _bars(ax, groups, series)
  ax.set_ylabel(ylabel)
  if log:
    _log_y(ax)
  ax.grid(axis="y", alpha=0.3)
  fig.suptitle(f"{title}\n{_stamp(rows)}", fontsize=10)
  return fig


def _log_y(ax):
  """Log scale with plain tick labels (0.2, 6, 2000), not 6x10^0; minor
  ticks (2, 3, 5 x 10^k) are labelled only on a short span, which would
  otherwise show no label at all."""
  from matplotlib.ticker import FuncFormatter

  def minor(v, _):
    lo, hi = ax.get_ylim()
    mantissa = round(v / 10 ** math.floor(math.log10(v)))
    short = lo > 0 and math.log10(hi / lo) <= 2
    return f"{v:g}" if short and mantissa in (2, 3, 5) else ""

  ax.set_yscale("log")
  ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
  ax.yaxis.set_minor_formatter(FuncFormatter(minor))


def _line_panels(panels: dict[str, dict[str, list[tuple[float, float]]]],
                 rows, title: str, xlabel: str, ylabel: str,
                 logx=False, logy=False, styles=None):
  """One axis per panel, one line per series of (x, y) points."""
  if not panels:
    return None
  fig, axes = _figure(ncols=len(panels), width=6.0)
  colors = _colors(dict.fromkeys(l for s in panels.values() for l in s))
  for ax, (name, series) in zip(axes, panels.items()):
    for label, points in series.items():
      xs, ys = zip(*sorted(points))
      style = {"marker": "o", "color": colors[label],
               **(styles or {}).get(label, {})}
      ax.plot(xs, ys, label=label, **style)
    ax.set(title=name, xlabel=xlabel, ylabel=ylabel)
    if logx:
      ax.set_xscale("log", base=2)
    if logy:
      _log_y(ax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.suptitle(f"{title}\n{_stamp(rows)}", fontsize=10)
  return fig


# ---------------------------------------------------------------- pack

PACK_PEERS = ("torch_boolean_index", "xla_nonzero_take")


def _is_pack_competitor(row) -> bool:
  impl = row["implementation"]
  return (row["gbps"] is not None and _param(row["case"], "density") is not None
          and (impl.startswith("rlk_") or impl in PACK_PEERS))


def pack_bandwidth_figure(rows):
  """GB/s vs density; a panel per capacity policy ("cap=..." in the case).

  torch_boolean_index only runs with an exact capacity ("cap=active", a case
  no rlk row has): it is drawn dashed in every panel of the same shape, as
  the reference the rlk capacities are judged against. The measured copy
  bandwidth is the roof, a horizontal line.
  """
  rows = select(rows, "pack")
  points = [r for r in rows if _is_pack_competitor(r)]
  if not points:
    return None
  by_panel = collections.defaultdict(list)
  for r in points:
    by_panel[re.sub(r"\s*density=\S+", "", r["case"])].append(r)
  own = {k: v for k, v in by_panel.items()
         if any(r["implementation"].startswith("rlk_") for r in v)} or by_panel
  refs = {k: v for k, v in by_panel.items() if k not in own}
  panels, dashed = {}, {}
  for key, panel_rows in own.items():
    shape = key.split(" cap=")[0]
    series = _density_series(panel_rows)
    for ref_key, ref_rows in refs.items():
      if ref_key.split(" cap=")[0] == shape:
        for label, pts in _density_series(ref_rows, ref_key).items():
          series[label] = pts
          dashed[label] = {"linestyle": "--"}
    panels[key] = series
  fig = _line_panels(panels, points, "pack bandwidth", "density (active rows)",
                     "GB/s", styles=dashed)
  copies = [r for r in rows if r["case"] == "copy" and r["gbps"] is not None]
  for ax in fig.axes:
    for i, r in enumerate(copies):
      ax.axhline(r["gbps"], color="grey", linestyle=(":", "-.")[i % 2],
                 label=f"copy {r['implementation']} ({r['gbps']:.0f} GB/s)")
    ax.legend(fontsize=7)
  return fig


def _density_series(rows, ref_key: str = ""):
  cap = f" ({ref_key.split(' ')[-1]})" if ref_key else ""
  series = collections.defaultdict(list)
  for r in rows:
    series[r["implementation"] + cap].append(
        (_param(r["case"], "density"), r["gbps"]))
  return dict(series)


# ---------------------------------------------------------------- det_gemm

GEMM_PEERS = ("cublas", "xla_dot", "cublas_eager")


def _is_gemm_competitor(row) -> bool:
  impl = row["implementation"]
  return impl in GEMM_PEERS or (impl.startswith("rlk_")
                                and not impl.endswith("_vjp"))


def _gemm_label(case: str) -> str:
  """'qkv M=4096 K=4096 N=6144 bf16' -> 'qkv / M=4096 / K=4096 N=6144' on
  three lines: the full case on one line overlaps its neighbours."""
  name, _, dims = case.replace(" bf16", "").partition(" ")
  return f"{name}\n" + dims.replace(" K=", "\nK=", 1)


def det_gemm_tflops_figure(rows):
  """The training-size forward GEMMs (M=4096 on a GPU run; the smoke run's
  small M stands in): not the backward cases, not decode."""
  rows = select(rows, "det_gemm", lambda r: _is_gemm_competitor(r)
                and not r["case"].endswith(" bwd")
                and not r["case"].startswith("decode"))
  return _grouped_bar_figure(rows, "tflops", "det_gemm forward throughput",
                             "TFLOP/s", GEMM_PEERS, _gemm_label)


def det_gemm_decode_figure(rows):
  rows = select(rows, "det_gemm", lambda r: _is_gemm_competitor(r)
                and r["case"].startswith("decode"))
  return _grouped_bar_figure(rows, "median_ms", "det_gemm decode latency",
                             "ms per call", GEMM_PEERS, _gemm_label)


# ---------------------------------------------------------------- invariance

def _rows_differ(row) -> int | None:
  match = re.search(r"rows_differ=(\d+)", row["note"])
  return int(match.group(1)) if match else None


def _m(row) -> float | None:
  """m of "K=4096 N=4096 M=16 vs M=4096" (16; the M after "vs" is the
  reference)."""
  return _param(row["case"].partition(" vs")[0], "M")


def invariance_figure(rows):
  """Rows of the m-row product that differ from the same rows computed
  inside the reference product ("M=16 vs M=4096"), per m; zero is
  batch-invariant. Invariant implementations all sit on zero, so each gets
  its own marker, larger first, to stay visible under the next."""
  # The "K=... N=..." products; the sweep's shapes are a table in the report.
  rows = select(rows, "invariance",
                lambda r: _rows_differ(r) is not None and _m(r) is not None
                and r["case"].startswith("K="))
  if not rows:
    return None
  panels = collections.defaultdict(lambda: collections.defaultdict(list))
  for r in rows:
    n = _param(r["case"], "N")
    label = r["implementation"] + (f" N={n:.0f}" if _several_n(rows, r) else "")
    k = _param(r["case"], "K")
    panels[f"K={k:.0f}"][label].append((_m(r), _rows_differ(r)))
  labels = _ordered(l for series in panels.values() for l in series)
  styles = {l: {"marker": "osD^vx*"[i % 7], "markersize": max(11 - 1.5 * i, 3)}
            for i, l in enumerate(labels)}
  refs = {_param(r["case"].partition(" vs")[2], "M") for r in rows} - {None}
  ref = ", ".join(f"M={m:.0f}" for m in sorted(refs)) or "the reference M"
  fig = _line_panels({k: dict(v) for k, v in panels.items()}, rows,
                     f"batch invariance: rows differing from those at {ref}",
                     "m (rows in the call)", "rows differing", logx=True,
                     styles=styles)
  _count_axes(fig, sorted({_m(r) for r in rows}))
  return fig


def _count_axes(fig, ms):
  """Counts are integers from zero, and m is read as a number: the default
  axes would show 2^k ticks and, when every count is 0, a -0.04..0.04 span."""
  from matplotlib.ticker import MaxNLocator, NullFormatter
  for ax in fig.axes:
    ax.set_xticks(ms, [f"{m:.0f}" for m in ms])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    top = max(ax.get_ylim()[1], 1)
    ax.set_ylim(-0.05 * top, top)


def _several_n(rows, row) -> bool:
  k = _param(row["case"], "K")
  return len({_param(r["case"], "N") for r in rows
              if _param(r["case"], "K") == k}) > 1


# ---------------------------------------------------------------- logp

LOGP_PEERS = ("xla_dense", "torch_dense")


def _logp_forward(rows):
  """The forward cases "N=.. H=.. V=.. bf16" (not fwd+bwd, not e2e)."""
  return select(rows, "logp",
                lambda r: re.match(r"N=\d+ H=\d+ V=\d+", r["case"])
                and "fwd+bwd" not in r["case"]
                and (r["implementation"] in LOGP_PEERS
                     or r["implementation"].startswith("rlk_")))


def _shape(case: str) -> str:
  """"N=16384 H=4096 V=32768 bf16" -> "N=16384 H=4096 bf16"."""
  return re.sub(r"\s*V=\d+", "", case)


def _by_v(rows, value: str):
  """One series per implementation (and per N, H when a run has several)."""
  rows = [r for r in rows if r[value] is not None]
  shapes = {_shape(r["case"]) for r in rows}
  series = collections.defaultdict(list)
  for impl in _ordered((r["implementation"] for r in rows), LOGP_PEERS):
    for r in rows:
      if r["implementation"] == impl:
        shape = _shape(r["case"])
        label = impl + (f" ({shape})" if len(shapes) > 1 else "")
        series[label].append((_param(r["case"], "V"), r[value]))
  return rows, dict(series)


def _panel(rows) -> str:
  return "forward, " + ", ".join(sorted({_shape(r["case"]) for r in rows}))


def logp_memory_figure(rows):
  rows, series = _by_v(_logp_forward(rows), "peak_mem_mb")
  if not series:
    return None
  return _line_panels({_panel(rows): series}, rows, "logp peak memory",
                      "V (vocabulary)", "peak MB (log)", logy=True)


def logp_time_figure(rows):
  rows, series = _by_v(_logp_forward(rows), "median_ms")
  if not series:
    return None
  return _line_panels({_panel(rows): series}, rows, "logp time",
                      "V (vocabulary)", "ms per call")


def logp_peers_by_n_figure(rows):
  """The torch route against the fused log-prob peers over N at one (H, V):
  forward+backward time and the step's memory beyond the gradients (the
  (H, V) with the most N values in the run)."""
  rows = select(rows, "logp", lambda r: r["case"].startswith("torch N=")
                and r["case"].endswith("fwd+bwd") and r["median_ms"])
  by_hv = collections.defaultdict(list)
  for r in rows:
    by_hv[(_param(r["case"], "H"), _param(r["case"], "V"))].append(r)
  if not by_hv:
    return None
  (h, v), rows = max(by_hv.items(),
                     key=lambda kv: len({_param(r["case"], "N") for r in kv[1]}))
  if len({_param(r["case"], "N") for r in rows}) < 2:
    return None
  panels = {}
  for value, name in (("median_ms", "forward+backward, ms (log)"),
                      ("peak_mem_mb", "memory beyond the gradients, MB (log)")):
    series = collections.defaultdict(list)
    for r in rows:
      if r[value]:
        series[r["implementation"]].append((_param(r["case"], "N"), r[value]))
    panels[name] = {k: series[k] for k in _ordered(series, ("rlk",))}
  return _line_panels(panels, rows, f"linear_logp against its peers, "
                      f"H={h:g} V={v:g}", "N (tokens)", "", logx=True,
                      logy=True)


# ---------------------------------------------------------------- bridge

def bridge_overhead_figure(rows):
  rows = select(rows, "bridge")
  return _grouped_bar_figure(rows, "median_ms", "torch bridge overhead",
                             "ms per call (log)", ("torch_native", "rlk_jax"),
                             _gemm_label, log=True)


def det_gemm_sweep_figure(rows):
  """Heatmaps of each competitor's speed as a fraction of cuBLAS's
  (cuBLAS time / its time) over model shape x M, one column of panels per
  layout (fwd, dA, dB)."""
  rows = select(rows, "det_gemm_sweep", lambda r: r["median_ms"])
  peer = {r["case"]: r["median_ms"] for r in rows
          if r["implementation"] == "cublas"}
  cells = collections.defaultdict(dict)  # (impl, layout) -> {(shape, m): x}
  for r in rows:
    if r["implementation"] == "cublas" or r["case"] not in peer:
      continue
    family, proj, m, k, n, layout = r["case"].split()
    shape = f"{family} {proj} {k.split('=')[1]}x{n.split('=')[1]}"
    cells[(r["implementation"], layout)][(shape, int(m.split("=")[1]))] = (
        peer[r["case"]] / r["median_ms"])
  if not cells:
    return None
  impls = _ordered(sorted({i for i, _ in cells}), first=("rlk_cuda_ffi_kernel",
                                                  "rlk_cuda_ffi", "xla_dot"))
  layouts = [l for l in ("fwd", "dA", "dB") if any(l == x for _, x in cells)]
  shapes = list(dict.fromkeys(s for c in cells.values() for s, _ in c))
  ms = sorted({m for c in cells.values() for _, m in c})
  from matplotlib.colors import TwoSlopeNorm
  from matplotlib.figure import Figure
  fig = Figure(figsize=(3.2 * len(layouts) + 3, 0.22 * len(shapes) * len(impls)
                        + 1.5), layout="constrained")
  axes = fig.subplots(len(impls), len(layouts), squeeze=False)
  norm = TwoSlopeNorm(vmin=0.3, vcenter=1.0, vmax=1.5)
  image = None
  for i, impl in enumerate(impls):
    for j, layout in enumerate(layouts):
      ax = axes[i][j]
      got = cells.get((impl, layout), {})
      grid = [[got.get((s, m), float("nan")) for m in ms] for s in shapes]
      image = ax.imshow(grid, aspect="auto", cmap="RdYlGn", norm=norm)
      ax.set_title(f"{impl} {layout}", fontsize=9)
      ax.set_xticks(range(len(ms)), [str(m) for m in ms], fontsize=6,
                    rotation=90)
      ax.set_yticks(range(len(shapes)), shapes if j == 0 else [],
                    fontsize=6)
  fig.colorbar(image, ax=axes, shrink=0.5, label="x cuBLAS speed")
  fig.suptitle("det_gemm sweep: speed as a fraction of cuBLAS's (M across) "
               + _stamp(rows), fontsize=10)
  return fig


def det_gemm_by_m_figure(rows):
  """rlk's SM90 kernel against cuBLAS by M, one panel per layout: every
  product's speed as a fraction of cuBLAS's (a dot each, spread a little
  sideways) and their geometric mean per M."""
  rows = select(rows, "det_gemm_sweep", lambda r: r["median_ms"])
  peer = {r["case"]: r["median_ms"] for r in rows
          if r["implementation"] == "cublas"}
  ours = [r for r in rows if r["implementation"] == "rlk_cuda_ffi_kernel"
          and r["case"] in peer]
  if not ours:
    return None
  by_layout = collections.defaultdict(lambda: collections.defaultdict(list))
  for r in ours:
    by_layout[r["case"].split()[-1]][int(_param(r["case"], "M"))].append(
        peer[r["case"]] / r["median_ms"])
  layouts = [l for l in ("fwd", "dA", "dB") if l in by_layout]
  fig, axes = _figure(ncols=len(layouts), width=5.0)
  for ax, layout in zip(axes, layouts):
    per_m = by_layout[layout]
    for i, m in enumerate(sorted(per_m)):
      xs = [m * 2 ** (0.25 * (j / max(len(per_m[m]) - 1, 1) - 0.5))
            for j in range(len(per_m[m]))]
      ax.scatter(xs, per_m[m], s=9, alpha=0.45, color="tab:blue",
                 label="a product" if i == 0 else None)
    ms = sorted(per_m)
    means = [math.exp(sum(map(math.log, per_m[m])) / len(per_m[m]))
             for m in ms]
    ax.plot(ms, means, "o-", color="black", label="geometric mean")
    ax.axhline(1.0, color="grey", lw=1)
    ax.axhline(0.9, color="grey", lw=1, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (rows)")
    n = sum(len(v) for v in per_m.values())
    ax.set_title(f"{layout}: {n} products", fontsize=10)
    ax.set_ylabel("x cuBLAS speed (higher is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
  fig.suptitle("det_gemm (rlk's SM90 kernel) against cuBLAS, kernel against "
               "kernel " + _stamp(rows), fontsize=10)
  return fig


def _attention_label(case: str) -> str:
  """'decode B=16 ctx=8192 H=32/8 D=128' -> 'decode B=16 ctx=8192'."""
  return re.sub(r" H=\S+ D=\d+", "", case).replace(" fwd+bwd", "\nfwd+bwd")


def attention_figure(rows):
  """Time per call of every attention competitor, training and decode
  cases (log scale: decode and training differ by 100x); the invariance
  counts are the report's notes."""
  rows = select(rows, "attention", lambda r: r["median_ms"] is not None
                and not r["case"].startswith("packed"))
  return _grouped_bar_figure(rows, "median_ms",
                             "det_attention against SDPA and cuDNN",
                             "ms per call (lower is better)",
                             ("rlk_torch", "rlk_jax"), _attention_label,
                             log=True)


FIGURES = {
    "pack_bandwidth.png": pack_bandwidth_figure,
    "det_gemm_tflops.png": det_gemm_tflops_figure,
    "det_gemm_decode.png": det_gemm_decode_figure,
    "invariance.png": invariance_figure,
    "logp_memory.png": logp_memory_figure,
    "logp_time.png": logp_time_figure,
    "logp_peers_by_n.png": logp_peers_by_n_figure,
    "bridge_overhead.png": bridge_overhead_figure,
    "det_gemm_sweep.png": det_gemm_sweep_figure,
    "det_gemm_by_m.png": det_gemm_by_m_figure,
    "attention_time.png": attention_figure,
}


def write_plots(csv_path: str, out_dir: str) -> list[str]:
  """One PNG per figure that has rows in `csv_path`; returns their paths."""
  rows = read_rows(csv_path)
  os.makedirs(out_dir, exist_ok=True)
  written = []
  for name, build in FIGURES.items():
    fig = build(rows)
    if fig is None:
      continue
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    written.append(path)
  return written


# ---------------------------------------------------------------- notebooks

def newest_results(root: str, benchmark: str) -> str | None:
  """The newest committed CSV with `benchmark` rows, in any folder under
  ``benchmarks/results/``: newest by its latest `date`, then (several runs
  share a date) by the commit time of the code that produced it, then by
  its folder's mtime."""
  found = []
  pattern = os.path.join(root, "benchmarks", "results", "**", "*.csv")
  for path in glob.glob(pattern, recursive=True):
    if not re.search(r"(^|_)results\.csv$", os.path.basename(path)):
      continue  # one-off experiment dumps, not a run's results
    relative = os.path.relpath(path, os.path.join(root, "benchmarks", "results"))
    if relative.startswith("smoke-"):
      continue  # toy CPU sizes left by a smoke run without --out
    rows = [r for r in read_rows(path) if r["benchmark"] == benchmark]
    if rows:
      found.append((max(r.get("date") or "" for r in rows),
                    max(_commit_time(root, c)
                        for c in {r.get("commit", "") for r in rows}),
                    os.path.getmtime(os.path.dirname(path)), path))
  return max(found)[3] if found else None


@functools.cache
def _commit_time(root: str, commit: str) -> int:
  """Seconds since the epoch of `commit` in the checkout at `root`; 0 when
  unknown (no git, a commit it lacks, an edited tree's "-dirty" name)."""
  if not re.fullmatch(r"[0-9a-f]{7,40}", commit):
    return 0
  done = subprocess.run(["git", "log", "-1", "--format=%ct", commit], cwd=root,
                        capture_output=True, text=True)
  return int(done.stdout.strip() or 0) if done.returncode == 0 else 0


def smoke_results(root: str, benchmarks, repeats: int = 1) -> str:
  """Runs the smoke benchmarks (CPU sizes) in a fresh interpreter; returns
  the CSV path. A subprocess, so absl flags and JAX state stay out of the
  kernel. One timed round per case: smoke times on a CPU (kernels in their
  interpreters) check the plumbing, they measure nothing."""
  out = tempfile.mkdtemp(prefix="rlk_smoke_")
  done = subprocess.run([sys.executable, "-m", "benchmarks", "--smoke",
                         "--only", ",".join(benchmarks), "--repeats",
                         str(repeats), "--out", out],
                        cwd=root, capture_output=True, text=True)
  if done.returncode:
    raise RuntimeError(f"smoke benchmarks failed ({done.returncode}):\n"
                       + done.stderr[-3000:])
  return os.path.join(out, "results.csv")


def load_results(root: str, benchmarks, smoke: bool | None = None):
  """Rows of `benchmarks` and the CSVs they came from.

  With `smoke` (default: env RLK_NOTEBOOK_SMOKE=1) a fresh smoke run;
  otherwise the newest committed results per benchmark (a run may lack
  one), and a smoke run only when there are none at all.
  """
  if smoke is None:
    smoke = os.environ.get("RLK_NOTEBOOK_SMOKE") == "1"
  chosen = {} if smoke else {b: newest_results(root, b) for b in benchmarks}
  chosen = {b: p for b, p in chosen.items() if p}
  if not chosen:
    path = smoke_results(root, benchmarks)
    chosen = dict.fromkeys(benchmarks, path)
  rows = [r for b, p in chosen.items() for r in select(read_rows(p), b)]
  return rows, list(dict.fromkeys(chosen.values()))


def text_table(rows, columns=("case", "implementation", "median_ms", "gbps",
                              "tflops", "peak_mem_mb", "note")) -> str:
  """A plain-text table: a notebook shows it without pandas."""
  if not rows:
    return "(no rows)"
  def cell(v):
    return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)
  body = [[cell(r.get(c)) for c in columns] for r in rows]
  widths = [max([len(c), *(len(b[i]) for b in body)])
            for i, c in enumerate(columns)]
  line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))
  return "\n".join([line(columns), line("-" * w for w in widths),
                    *map(line, body)])


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) != 2:
    print(__doc__.splitlines()[2].strip(), file=sys.stderr)
    return 2
  for path in write_plots(*argv):
    print(path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
