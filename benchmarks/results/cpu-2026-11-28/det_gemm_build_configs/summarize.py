"""Which det_gemm configs the build should compile per operand layout.

Greedy selection on every recorded per-config sweep
(benchmarks/results/**/det_gemm_configs*.csv[.gz]), both devices pooled.
Record rule: a (device, layout, m, n, k) product takes all its timings from
the most recent file that has it; files are ordered by the date of their
`...-2026-11-DD/` folder, then by path (later wins).
"""
import collections, csv, glob, gzip, json, math, os, re, sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), *[".."] * 4))
OUT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)
from rlk_jax._gemm_tuning import CANDIDATES, m_bucket  # noqa: E402

LAYOUTS = [f"{a}{b}{c}" for a in "01" for b in "01" for c in "01"]
SPLIT, SPLIT_PARTS = "split_256x192_128x256", ("cooperative_256x192",
                                               "cooperative_128x256")
RULE = ("swap_pingpong_64x32", "pingpong_64x128", "pingpong_64x64",
        "pingpong_64x32", "cooperative_128x256", "cooperative_256x192",
        "pingpong_128x128", "cooperative_128x128", "cooperative_256x128",
        "cooperative_128x192", "cooperative_128x256_cluster_1x2",
        "pingpong_64x256", SPLIT)  # det_gemm_api.cc ChoosePlan
TOL = math.log(1.02)
TABLES = {"det_gemm_sm90-nvidia-h100-80gb-hbm3.json": "NVIDIA H100 80GB HBM3",
          "det_gemm_sm90-nvidia-h200.json": "NVIDIA H200"}
# Layouts with too little data to select on: the first N rule configs in
# the greedy order of all data layouts pooled (see little_data_set).
LITTLE = ("001", "011", "101", "111", "110")
N_LITTLE = 7
# What the build compiles (cuda_ffi/build.py BUILD_CONFIGS), held to a
# whole build of under four minutes on 16 cores: the H100 device build of
# 2026-11-28 (77 objects, benchmarks/results/nvidia-h100-80gb-hbm3-2026-11-28/
# first_use_77_objects-bcce52f/build.log) took 41-68 s an object, but 88-108 s for the
# extended-atom configs (128x144/160/224/80), so those are left out and the
# greedy order (without them) is cut at BUDGET objects in the layouts with
# data; the f32-output layouts (linear_logp's products, large M) keep the
# rule's first N_F32 objects, the two rare layouts (a transposed A times a
# transposed B: second-order gradients) RARE.
EXTENDED = ("cooperative_128x144", "cooperative_128x160",
            "cooperative_128x224", "cooperative_128x80",
            "cooperative_128x144_cluster_1x2")
#
# Cut again on 2026-11-28 (tree 06d760d): on a fresh H100 machine a build
# run alone took 259 s for 59 objects (16 steps at once take 67-70 s each:
# four waves), so three waves, 48 objects, are what fits under four
# minutes with room (benchmarks/results/nvidia-h100-80gb-hbm3-2026-11-28/
# first_use-06d760d/). The first cut (59: 18, 18, 10, 3 f32, 2 rare) is in
# this file's history. The eleven objects went where the greedy paths lose
# least: 100's last four (losses 0.05, 0.33, 0.83, 1.57), 010's last two
# (1.47, 1.90), where three from each of 000 and 010 would lose 14.4; and
# the f32 and rare layouts' last (no data there; large products).
BUDGET = {"000": 18, "010": 16, "100": 6}
F32 = ("cooperative_256x192", "cooperative_128x256")
N_F32 = len(F32)
RARE = ("cooperative_128x256",)
CORE_S_PER_OBJECT = 65  # nvcc on 16 busy cores: one wave a minute


def load():
  """{(device, layout, m, n, k): (file rank, {config: ms})}, notes."""
  files = glob.glob(f"{ROOT}/benchmarks/results/**/det_gemm_configs*.csv",
                    recursive=True)
  files += glob.glob(f"{ROOT}/benchmarks/results/**/det_gemm_configs*.csv.gz",
                     recursive=True)
  date = lambda f: (re.search(r"-(2026-\d\d-\d\d)/", f) or [0, ""])[1]
  files = sorted(files, key=lambda f: (date(f), os.path.relpath(f, ROOT)))
  products, notes = {}, []
  for rank, f in enumerate(files):
    rel = os.path.relpath(f, ROOT)
    try:
      with (gzip.open if f.endswith(".gz") else open)(f, "rt") as fh:
        rows = list(csv.DictReader(fh))
    except Exception as e:  # noqa: BLE001
      notes.append(f"unreadable {rel}: {e}")
      continue
    need = {"device", "layout", "m", "n", "k", "config", "median_ms"}
    if not rows or not need <= set(rows[0]):
      notes.append(f"skipped {rel}: missing columns")
      continue
    here, bad = collections.defaultdict(dict), 0
    for r in rows:
      try:
        ms = float(r["median_ms"])
        key = (r["device"], r["layout"].strip().zfill(3), int(r["m"]),
               int(r["n"]), int(r["k"]))
        assert ms > 0 and math.isfinite(ms) and key[1] in LAYOUTS
      except (ValueError, TypeError, AssertionError):
        bad += 1
        continue
      here[key][r["config"]] = ms
    notes.append(f"{rel}: {len(here)} products, {bad} rows skipped")
    for key, t in here.items():
      products[key] = (rank, t)
  return products, files, notes


def kept_configs(objects):
  return set(objects) | ({SPLIT} if set(SPLIT_PARTS) <= set(objects) else set())


def errors(prods, objects):
  """Per product ln(best kept / best of all) (inf where no kept config ran)."""
  kept = kept_configs(objects)
  out = []
  for t in prods:
    ks = [v for c, v in t.items() if c in kept]
    out.append(math.log(min(ks) / min(t.values())) if ks else math.inf)
  return out


def loss(errs):
  return sum(max(0.0, e - TOL) for e in errs), sum(e <= TOL for e in errs)


def greedy(prods, start=(), allowed=CANDIDATES):
  """Objects added in order; a move is one config, or the split (its missing
  parts added together, its gain counted per object added)."""
  objects = list(start)
  if SPLIT in objects:
    objects = [c for c in objects if c != SPLIT] + [
        p for p in SPLIT_PARTS if p not in objects]
  cur = loss(errors(prods, objects))
  while cur[0] > 0:
    best = None
    for c in allowed:
      add = ([p for p in SPLIT_PARTS if p not in objects] if c == SPLIT
             else [c] if c not in objects else [])
      if not add:
        continue
      new = loss(errors(prods, objects + add))
      score = ((cur[0] - new[0]) / len(add), new[1] - cur[1])
      if score[0] > 1e-12 and (best is None or score > best[0]):
        best = (score, add, new)
    if best is None:
      break
    objects += best[1]
    cur = best[2]
  return objects


def order_names(objects):
  """Greedy order with the split named right after its second part."""
  out = []
  for c in objects:
    out.append(c)
    if c in SPLIT_PARTS and set(SPLIT_PARTS) <= set(out):
      out.append(SPLIT)
  return out


def fastest(t, kept):
  ks = {c: v for c, v in t.items() if c in kept}
  return min(ks, key=lambda c: (ks[c], CANDIDATES.index(c))) if ks else None


def cost_lines(prods, objects):
  errs = [e for e in errors(prods, objects)]
  fin = [e for e in errs if math.isfinite(e)]
  gm = math.exp(sum(fin) / len(fin)) if fin else 1.0
  return (f"  cost: geomean {gm:.4f}x, max {math.exp(max(fin)):.4f}x, "
          f">1%: {sum(e > math.log(1.01) for e in fin)}, "
          f">2%: {sum(e > TOL for e in fin)}, no kept config timed: "
          f"{len(errs) - len(fin)} of {len(errs)}")


def table_replacements(products, sets, out):
  result = {}
  for name, device in TABLES.items():
    entries = json.load(open(f"{ROOT}/rlk_jax/tuned/{name}"))["entries"]
    rep, dropped = {}, collections.Counter()
    for key, cfg in sorted(entries.items()):
      layout, mb, n, k = key.split()
      kept = kept_configs(sets[layout])
      if cfg in kept:
        continue
      dropped[layout] += 1
      cands = [(abs(p[2] - int(mb)), -rank, t)
               for p, (rank, t) in products.items()
               if p[0] == device and p[1] == layout and p[3] == int(n)
               and p[4] == int(k) and m_bucket(p[2]) == int(mb)]
      r = fastest(min(cands, key=lambda c: c[:2])[2], kept) if cands else None
      rep[key] = r or "no data"
      out.append(f"  {key}: {cfg} -> {rep[key]}")
    out.insert(len(out) - len(rep), f"{name}: {len(entries)} entries, "
               f"{len(rep)} on a dropped config (by layout: {dict(dropped)}), "
               f"{sum(v == 'no data' for v in rep.values())} without data")
    result[name] = rep
  return result


def main():
  products, files, notes = load()
  out = ["Record rule: each (device, layout, m, n, k) product takes every "
         "config's median_ms from the most recent file holding it (files "
         "ordered by the folder date -2026-11-DD/, then by path).",
         f"{len(files)} files:"] + ["  " + n for n in notes]
  by_layout = collections.defaultdict(list)
  for key, (_, t) in sorted(products.items()):
    by_layout[key[1]].append(t)
  sets, rule_sets = {}, {}
  for layout in LAYOUTS:
    prods = by_layout[layout]
    devs = collections.Counter(k[0] for k in products if k[1] == layout)
    out.append(f"\n== layout {layout}: {len(prods)} products {dict(devs)}")
    if layout in LITTLE:
      continue
    allowed = [c for c in CANDIDATES if not (layout[1] == "1" and
                                             c == "pingpong_64x320")
               and c not in EXTENDED]
    objs = greedy(prods, allowed=allowed)
    sets[layout] = objs
    kept = kept_configs(objs)
    wins_all = collections.Counter(fastest(t, set(t)) for t in prods)
    wins_kept = collections.Counter(fastest(t, kept) for t in prods)
    out.append(f"greedy: {len(objs)} objects, kept (final wins):")
    out += [f"  {c:40s} {wins_kept[c]:4d}" for c in order_names(objs)]
    out.append(cost_lines(prods, objs))
    out.append("greedy path (objects, added, loss, products >2%, geomean):")
    for i in range(1, len(objs) + 1):
      errs = errors(prods, objs[:i])
      fin = [e for e in errs if math.isfinite(e)]
      out.append(f"  {i:2d} {objs[i - 1]:38s} {loss(errs)[0]:8.3f} "
                 f"{sum(e > TOL for e in errs):4d} "
                 f"{math.exp(sum(fin) / max(len(fin), 1)):.4f}")
    out.append("dropped (wins among all configs, largest gain over best kept):")
    for c in sorted(set(wins_all) | {c for t in prods for c in t},
                    key=lambda c: (-wins_all[c], c)):
      if c in kept:
        continue
      gains = [min(v for x, v in t.items() if x in kept) / t[c]
               for t in prods if c in t and any(x in kept for x in t)]
      out.append(f"  {c:40s} {wins_all[c]:4d}  "
                 f"{(max(gains) - 1) * 100 if gains else 0:5.1f}%")
    robjs = greedy(prods, start=RULE, allowed=allowed)
    rule_sets[layout] = robjs
    extra = [c for c in robjs if c not in RULE]
    out.append(f"with the rule's configs kept: {len(robjs)} objects "
               f"(rule 12 + {len(extra)}: {', '.join(extra) or 'none'})")
    out.append(cost_lines(prods, robjs))
  # Little-data layouts: the rule's configs in greedy order on every data
  # layout pooled; the first N_LITTLE objects (the split comes free with its
  # two parts).
  pooled = [t for l in LAYOUTS if l not in LITTLE for t in by_layout[l]]
  order = greedy(pooled, allowed=[c for c in RULE])
  little = order[:N_LITTLE]
  out.append(f"\n== little-data layouts {', '.join(LITTLE)}: rule configs in "
             f"greedy order on all {len(pooled)} data products pooled: "
             f"{', '.join(order_names(order))}")
  out.append(f"proposed (first {N_LITTLE} objects): "
             f"{', '.join(order_names(little))}")
  out.append("on the pooled data products:" + cost_lines(pooled, little)[7:])
  out.append("on the pooled data, all 12 rule objects:"
             + cost_lines(pooled, order)[7:])
  for layout in LITTLE:
    sets[layout] = little
    if by_layout[layout]:
      out.append(f"layout {layout} own products:"
                 + cost_lines(by_layout[layout], little)[7:])
  out.append("\n== the build's sets (BUDGET objects of the greedy order; "
             f"{N_F32} in the f32 layouts, {len(RARE)} in 110/111)")
  for layout in LAYOUTS:
    if layout in BUDGET:
      sets[layout] = sets[layout][:BUDGET[layout]]
    elif layout in ("110", "111"):
      sets[layout] = list(RARE)
    else:
      sets[layout] = list(F32)
    prods = by_layout[layout] if layout in BUDGET else pooled
    out.append(f"{layout} ({len(sets[layout])} objects, cost on "
               f"{'its own' if layout in BUDGET else 'the pooled'} products):"
               f"{cost_lines(prods, sets[layout])[7:]}")
    out.append("  " + ", ".join(order_names(sets[layout])))
  n_obj = sum(len(v) for v in sets.values())
  n_rule = sum(len(rule_sets.get(l, sets[l])) for l in LAYOUTS)
  out.append(f"\n== build: {n_obj} objects (per layout: "
             f"{ {l: len(sets[l]) for l in LAYOUTS} }); "
             f"{math.ceil(n_obj / 16)} waves of 16 at {CORE_S_PER_OBJECT} s: "
             f"{math.ceil(n_obj / 16) * CORE_S_PER_OBJECT / 60:.1f} min "
             f"(full build 288: {288 * CORE_S_PER_OBJECT / 16 / 60:.1f} min)")
  out.append(f"variant with the rule's configs in every data layout: {n_rule} "
             f"objects, {n_rule * CORE_S_PER_OBJECT / 16 / 60:.1f} min; and all 12 rule "
             f"objects in the little-data layouts too: "
             f"{n_rule + 5 * (12 - N_LITTLE)} objects, "
             f"{(n_rule + 5 * (12 - N_LITTLE)) * CORE_S_PER_OBJECT / 16 / 60:.1f} min")
  out.append("\n== shipped tables: entries on a dropped config -> fastest "
             "kept config on the matching product (same device, layout, n, "
             "k, m_bucket; closest m, then most recent)")
  reps = table_replacements(products, sets, out)
  json.dump({l: order_names(sets[l]) for l in LAYOUTS},
            open(f"{OUT}/build_configs.json", "w"), indent=1)
  json.dump(reps, open(f"{OUT}/table_replacements.json", "w"), indent=1,
            sort_keys=True)
  text = "\n".join(out) + "\n"
  open(f"{OUT}/summary.txt", "w").write(text)
  print(text, end="")


if __name__ == "__main__":
  main()
