"""Merges a table a det_gemm_sweep run wrote (a retune of some products,
det_gemm_sm90-<device>.json under the run's results) into the shipped table
of the same device, and says where the new entries came from.

  python scripts/merge_tuned_table.py RUN_TABLE --record DIR --note TEXT

The run's entries replace the shipped ones of the same keys; the others
stay. The shipped table's commit and date become the run's, and its source
gains "<note> (<record>)". Prints how many entries were added and changed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlk_jax import _gemm_tuning  # noqa: E402


def merge(run: dict, shipped: dict, *, record: str, note: str) -> tuple[int, int]:
  """Merges `run` into `shipped` in place; returns (added, changed)."""
  if run["device"] != shipped["device"]:
    raise ValueError(f"the run measured {run['device']!r}, the table is "
                     f"{shipped['device']!r}'s")
  entries = shipped["entries"]
  added = sum(key not in entries for key in run["entries"])
  changed = sum(key in entries and entries[key] != config
                for key, config in run["entries"].items())
  entries.update(run["entries"])
  shipped["commit"], shipped["date"] = run["commit"], run["date"]
  shipped["source"] += f"; {note} ({record})"
  return added, changed


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("run_table", type=pathlib.Path)
  parser.add_argument("--record", required=True,
                      help="the run's directory under benchmarks/results/")
  parser.add_argument("--note", required=True,
                      help="what was retuned, and with which candidates")
  parser.add_argument("--table_dir", type=pathlib.Path,
                      default=_gemm_tuning.TABLE_DIR)
  args = parser.parse_args(argv)
  run = json.loads(args.run_table.read_text())
  path = (args.table_dir
          / f"det_gemm_sm90-{_gemm_tuning.device_slug(run['device'])}.json")
  shipped = json.loads(path.read_text())
  added, changed = merge(run, shipped, record=args.record, note=args.note)
  path.write_text(json.dumps(shipped, indent=0, sort_keys=True) + "\n")
  print(f"{path.name}: {added} entries added, {changed} changed, "
        f"{len(shipped['entries'])} in all")
  return 0


if __name__ == "__main__":
  sys.exit(main())
