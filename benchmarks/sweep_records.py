"""Reading a det_gemm_sweep run's results.csv back: the summarize.py
scripts of the records under benchmarks/results/ share these."""

from __future__ import annotations

import collections
import csv
import re
import statistics


def ratios(path) -> dict[str, tuple[float, str | None]]:
  """{case: (cuBLAS time / rlk time, config)} of a sweep's results.csv."""
  t, config = collections.defaultdict(dict), {}
  for r in csv.DictReader(open(path)):
    if r["benchmark"] == "det_gemm_sweep" and r["median_ms"]:
      t[r["case"]][r["implementation"]] = float(r["median_ms"])
      found = re.search(r"config (\S+)", r["note"])
      if found:
        config[r["case"]] = found[1]
  return {c: (d["cublas"] / d["rlk_cuda_ffi_kernel"], config.get(c))
          for c, d in t.items() if {"cublas", "rlk_cuda_ffi_kernel"} <= set(d)}


def m_of(case: str) -> int:
  return int(re.search(r"M=(\d+)", case)[1])


def per_m(r) -> str:
  """A run's geomean ratio per M, as one line."""
  by_m = collections.defaultdict(list)
  for c, (x, _) in r.items():
    by_m[m_of(c)].append(x)
  return ", ".join(f"M={m} {statistics.geometric_mean(xs):.3f}"
                   for m, xs in sorted(by_m.items()))


def below(r, floor: float = 0.90, min_m: int = 256):
  """[(ratio, case, config)] of the products at M >= min_m under floor."""
  return sorted((x, c, cfg) for c, (x, cfg) in r.items()
                if x < floor and m_of(c) >= min_m)


def same_config_ratios(current, paths) -> dict[str, list[float]]:
  """{case: every ratio the runs at `paths` measured for it with the config
  it has in `current`} (a ratios() dict): one product's measurements across
  runs and machines, for a median that a single run's noise cannot move."""
  out = collections.defaultdict(list)
  for path in paths:
    for c, (x, config) in ratios(path).items():
      if c in current and config == current[c][1]:
        out[c].append(x)
  return dict(out)
