"""The main job: every benchmark, side by side with its peers, into a report.

    python -m benchmarks [--smoke] [--out DIR]

On a GPU it runs the real sizes; with no GPU the smoke sizes (no flags
needed). Writes ``benchmarks/results/<device>-<date>/`` (``--out`` overrides)
with ``results.csv`` and ``report.md``, and prints the table.
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import time

from absl import app, flags

from benchmarks import (bench_bridge, bench_det_gemm, bench_host, bench_logp,
                        bench_pack, harness)

OUT = flags.DEFINE_string("out", None, "Output folder (default: "
                          "benchmarks/results/<device>-<date>, or smoke-<date> "
                          "for smoke runs).")

ONLY = flags.DEFINE_list("only", None, "Run only these benchmarks.")

BENCHMARKS = {"pack": bench_pack, "det_gemm": bench_det_gemm,
              "logp": bench_logp, "host": bench_host, "bridge": bench_bridge}


def _default_out(smoke: bool) -> str:
  device = re.sub(r"[^A-Za-z0-9]+", "-", harness.device_name()).strip("-").lower()
  date = datetime.date.today().isoformat()
  name = f"smoke-{device}-{date}" if smoke else f"{device}-{date}"
  return os.path.join(os.path.dirname(__file__), "results", name)


def main(argv):
  del argv
  smoke = harness.smoke_mode()
  out = OUT.value or _default_out(smoke)
  os.makedirs(out, exist_ok=True)
  csv_path = os.path.join(out, "results.csv")
  if os.path.exists(csv_path):
    os.remove(csv_path)
  sections = []
  chosen = {n: m for n, m in BENCHMARKS.items() if not ONLY.value or n in ONLY.value}
  for i, (name, module) in enumerate(chosen.items(), 1):
    print(f"[{i}/{len(chosen)}] {name} ({'smoke' if smoke else 'full'}) ...",
          file=sys.stderr, flush=True)
    start = time.perf_counter()
    rows = module.run(smoke)
    harness.write_csv(rows, csv_path)
    table = harness.format_table(rows)
    sections.append(f"## {name}\n\n{table}\n")
    print(f"[{i}/{len(chosen)}] {name} done in "
          f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
  header = (f"# rlk benchmark report\n\ndevice: {harness.device_name()}  \n"
            f"commit: {harness.commit()}  \ndate: {datetime.date.today()}  \n"
            f"mode: {'smoke' if smoke else 'full'}\n\n"
            "`x floor`: measured time over the byte floor (bytes moved at the "
            "copy bandwidth measured in the same run).\n")
  report = header + "\n" + "\n".join(sections)
  with open(os.path.join(out, "report.md"), "w") as f:
    f.write(report)
  print(report)
  print(f"wrote {csv_path} and {os.path.join(out, 'report.md')}")


if __name__ == "__main__":
  app.run(main)
