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

from benchmarks import (bench_attention, bench_bridge, bench_det_gemm, bench_det_gemm_sweep,
                        bench_det_gemm_tuning, bench_host, bench_invariance, bench_jit_steps,
                        bench_logp, bench_models_jax, bench_models_torch, bench_pack, bench_scaling,
                        bench_torch_ops,
                        harness)

OUT = flags.DEFINE_string("out", None, "Output folder (default: "
                          "benchmarks/results/<device>-<date>, or smoke-<date> "
                          "for smoke runs).")

ONLY = flags.DEFINE_list("only", None, "Run only these benchmarks.")

BENCHMARKS = {"pack": bench_pack, "det_gemm": bench_det_gemm,
              "invariance": bench_invariance, "logp": bench_logp,
              "host": bench_host, "bridge": bench_bridge,
              "scaling": bench_scaling, "torch_ops": bench_torch_ops,
              "jit_steps": bench_jit_steps,
              "det_gemm_sweep": bench_det_gemm_sweep,
              "det_gemm_tuning": bench_det_gemm_tuning,
              "attention": bench_attention, "models_torch": bench_models_torch,
              "models_jax": bench_models_jax}
# The competitor each benchmark's "x peer" column divides by: what a user
# would run instead of rlk.
PEERS = {"pack": "xla_nonzero_take", "det_gemm": "cublas", "logp": "xla_dense",
         "bridge": "rlk_jax", "scaling": "1_device", "torch_ops": "torch",
         "jit_steps": "xla_jit",
         "det_gemm_sweep": "cublas", "attention": "sdpa_flash",
         "models_torch": "torch", "models_jax": "xla"}


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
  harness.set_output_dir(out)
  csv_path = os.path.join(out, "results.csv")
  if os.path.exists(csv_path):
    os.remove(csv_path)
  sections = []
  if not smoke:
    # The SM90 library whole before anything is timed (on a fresh machine
    # its first use would build it in the background, and the rows would
    # time the fallbacks under its name).
    import cuda_ffi
    cuda_ffi.wait_until_built(log=lambda line: print(line, file=sys.stderr))
  chosen = {n: m for n, m in BENCHMARKS.items() if not ONLY.value or n in ONLY.value}
  for i, (name, module) in enumerate(chosen.items(), 1):
    print(f"[{i}/{len(chosen)}] {name} ({'smoke' if smoke else 'full'}) ...",
          file=sys.stderr, flush=True)
    start = time.perf_counter()
    rows = module.run(smoke)
    harness.write_csv(rows, csv_path)
    # A benchmark of many rows summarizes itself; the CSV has them all.
    summarize = getattr(module, "summarize", None)
    table = (summarize(rows) if summarize
             else harness.format_table(rows, peer=PEERS.get(name)))
    sections.append(f"## {name}\n\n{table}\n")
    print(f"[{i}/{len(chosen)}] {name} done in "
          f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
  header = (f"# rlk benchmark report\n\ndevice: {harness.device_name()}  \n"
            f"commit: {harness.commit()}  \ndate: {datetime.date.today()}  \n"
            f"mode: {'smoke' if smoke else 'full'}\n\n"
            "`x floor`: measured time over the byte floor (bytes moved at the "
            "copy bandwidth measured in the same run). `x peer`: time over "
            "the same case's peer (" + ", ".join(
                f"{b}: {p}" for b, p in PEERS.items()) + ").\n")
  report = header + "\n" + "\n".join(sections) + _plots(csv_path, out)
  with open(os.path.join(out, "report.md"), "w") as f:
    f.write(report)
  print(report)
  print(f"wrote {csv_path} and {os.path.join(out, 'report.md')}")


def _plots(csv_path: str, out: str) -> str:
  """The report's figures (PNG beside it), or why there are none."""
  try:
    from benchmarks import plots
    paths = plots.write_plots(csv_path, out)
  except ImportError as e:
    return f"\n## Plots\n\nnone: {e} (pip install matplotlib)\n"
  except Exception as e:  # noqa: BLE001 - the numbers above still stand
    return f"\n## Plots\n\nplotting failed: {type(e).__name__}: {e}\n"
  return "\n## Plots\n\n" + "".join(
      f"![{os.path.basename(p)}]({os.path.basename(p)})\n\n" for p in paths)


if __name__ == "__main__":
  app.run(main)
