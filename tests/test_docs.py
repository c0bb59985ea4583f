"""The docs hold up: README.md's Python blocks run on a CPU, relative links in
the markdown resolve, README.md stays short, and every benchmark run folder
says at its top what it measured, on which device, when and at which commit.

CPU only and fast (a few seconds): nothing here needs a GPU.
"""

import os
import pathlib
import re
import urllib.parse

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
EXPERIMENTS = RESULTS / "experiments"

# A README block fenced as ```python no-run is only compiled (a syntax
# check), not run: for the rare snippet that needs a GPU, a model or data the
# README cannot build in a few lines. Every other ```python block must run as
# is, in a fresh namespace, on a CPU, in a few seconds.
NO_RUN = "python no-run"

# A stated goal: README.md is the front page, details live in docs/.
README_MAX_LINES = 200

# ---------------------------------------------------------------- markdown

_FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})(.*)$")


def _fences(path: pathlib.Path):
  """(opening fence's line, closing fence's line, info string, source) of
  every fenced code block, 1-based lines."""
  lines = path.read_text(encoding="utf-8").splitlines()
  blocks, i = [], 0
  while i < len(lines):
    opening = _FENCE.match(lines[i])
    if not opening or (opening[2][0] == "`" and "`" in opening[3]):
      i += 1
      continue
    indent, fence, info = len(opening[1]), opening[2], opening[3].strip()
    closing = re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
    start, body = i + 1, []
    i += 1
    while i < len(lines) and not closing.match(lines[i]):
      line = lines[i]
      strip = len(line) - len(line.lstrip(" "))
      body.append(line[min(indent, strip):])
      i += 1
    i += 1  # the closing fence (or the end of the file: CommonMark closes it)
    blocks.append((start, i, info, "\n".join(body) + "\n"))
  return blocks


def prose_lines(path: pathlib.Path):
  """The file's lines with fenced code blocks blanked (line numbers kept)."""
  lines = path.read_text(encoding="utf-8").splitlines()
  for start, end, _, _ in _fences(path):
    for k in range(start - 1, min(end, len(lines))):
      lines[k] = ""
  return lines


def github_slug(heading: str) -> str:
  """The anchor GitHub gives a heading: its text lowercased, punctuation
  other than '-' and '_' dropped, spaces to '-' (markup reduced to text)."""
  text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: text
  text = re.sub(r"<[^>]+>", "", text).strip().lower()  # inline HTML
  text = "".join(c for c in text if c.isalnum() or c in "-_ ")
  return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set:
  """Every anchor a link may name in `path`: its ATX headings' slugs
  (repeats get -1, -2, ... as on GitHub) and explicit HTML ids."""
  found, seen = set(), {}
  for line in prose_lines(path):
    heading = re.match(r"^ {0,3}#{1,6}(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$", line)
    if heading:
      slug = github_slug(heading[1] or "")
      found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
      seen[slug] = seen.get(slug, 0) + 1
    found.update(re.findall(r"<a\s[^>]*(?:name|id)=\"([^\"]+)\"", line))
  return found


_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")


def relative_links(path: pathlib.Path):
  """(line, target) of each link in `path` that is not an absolute URL
  (http:, https:, mailto:, ...): inline, image and reference-definition
  links, outside code blocks and code spans."""
  for number, line in enumerate(prose_lines(path), start=1):
    line = _INLINE_CODE.sub("", line)
    targets = _LINK.findall(line) + _REFERENCE.findall(line)
    for target in targets:
      if target and not re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", target):
        yield number, target


def broken(path: pathlib.Path, target: str):
  """Why `target`, linked from `path`, does not resolve; None when it does."""
  path = path.resolve()
  file_part, _, anchor = target.partition("#")
  file_part = urllib.parse.unquote(file_part)
  if not file_part:
    resolved = path
  elif file_part.startswith("/"):  # GitHub: relative to the repository root
    resolved = ROOT / file_part.lstrip("/")
  else:
    resolved = path.parent / file_part
  resolved = pathlib.Path(os.path.normpath(resolved))
  if resolved != ROOT and ROOT not in resolved.parents:
    return "points outside the repository"
  if not resolved.exists():
    return "no such file or directory"
  anchor = urllib.parse.unquote(anchor)
  if anchor and resolved.is_file() and resolved.suffix == ".md":
    if anchor not in anchors(resolved):
      return f"no heading in {resolved.relative_to(ROOT)} has the anchor #{anchor}"
  return None


# ---------------------------------------------------------------- README code

def _readme_python_blocks():
  return [(start, info, source) for start, _, info, source in _fences(README)
          if info.split()[:1] == ["python"]]


def test_readme_has_python_examples():
  assert _readme_python_blocks(), "README.md has no ```python block"


@pytest.mark.parametrize(
    "start,info,source", _readme_python_blocks(),
    ids=[str(start) for start, _, _ in _readme_python_blocks()])
def test_readme_python_block_runs(start, info, source, monkeypatch):
  """A README ```python block runs as is in a fresh namespace (on a CPU rlk
  falls back to its reference and Pallas-interpreter implementations);
  a ```python no-run block only compiles. The test id is the fence's line."""
  code = compile(source, f"README.md:{start}", "exec")
  if info == NO_RUN:
    return
  monkeypatch.chdir(ROOT)
  exec(code, {"__name__": "readme_block"})


def test_readme_length():
  lines = README.read_text(encoding="utf-8").splitlines()
  assert len(lines) <= README_MAX_LINES, (
      f"README.md has {len(lines)} lines, the goal is at most "
      f"{README_MAX_LINES}: move details to docs/")


def _section(title: str) -> list[str]:
  """The prose lines under README's `## title`, up to the next heading."""
  lines = prose_lines(README)
  start = lines.index(f"## {title}") + 1
  end = next((i for i in range(start, len(lines))
              if lines[i].startswith("#")), len(lines))
  return [l for l in lines[start:end] if l.strip()]


def test_readme_opens_with_three_plain_lines_then_its_two_commands():
  lines = README.read_text(encoding="utf-8").splitlines()
  assert lines[0] == "# rlk" and lines[1] == ""
  opening = lines[2:lines.index("", 2)]
  assert len(opening) == 3, opening
  assert not any(c.isdigit() for c in "".join(opening)), (
      "the opening states no figures (they live under Results)")
  commands = [source for _, _, info, source in _fences(README)
              if info == "bash"]
  assert [c.split()[:2] for c in commands[:2]] == [
      ["bash", "scripts/bench.sh"], ["bash", "scripts/test.sh"]]


def test_readme_results_and_limitations_read_one_line_each():
  results = [l for l in _section("Results") if l.startswith("- ")]
  assert len(results) >= 6
  for line in results:
    assert "(benchmarks/results/" in line, f"no run linked: {line[:60]}"
    assert len(line) <= 400, f"a results line runs long: {line[:60]}"
  assert any(l.startswith("![") and ".png)" in l for l in _section("Results"))
  limits = _section("Limitations")
  assert limits and all(l.startswith("- ") and len(l) <= 250 for l in limits), (
      [l[:60] for l in limits if not l.startswith("- ") or len(l) > 250])


# ---------------------------------------------------------------- links

def _markdown_files():
  files = [README, *sorted((ROOT / "docs").glob("*.md")),
           *sorted(RESULTS.glob("**/README.md"))]
  return [f for f in files if not _ignored(f)]


def _ignored(path: pathlib.Path) -> bool:
  relative = path.relative_to(ROOT).parts
  return relative[:2] == ("benchmarks", "results") and any(
      part.startswith("smoke-") for part in relative[2:3])


@pytest.mark.parametrize("path", _markdown_files(),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
  """Every relative link (`[text](path)`, `[text](path#anchor)`,
  `[text](#anchor)`) names an existing file or folder of the repository, and
  an anchor into a markdown file names one of its headings (GitHub's slug)."""
  problems = [f"{path.relative_to(ROOT)}:{line}: ({target}) {why}"
              for line, target in relative_links(path)
              if (why := broken(path, target))]
  assert not problems, "broken links:\n" + "\n".join(problems)


# ---------------------------------------------------------------- results

# The layout of benchmarks/results/:
#   <device>-<YYYY-MM-DD>/             the device-date folder of a day's runs
#   <device>-<YYYY-MM-DD>/<run>/       a recorded run (CSV, report, logs)
#   experiments/<name>/                scratch probes, indexed in experiments/README.md
#   smoke-*/                           local smoke runs, ignored by git
# A run folder is each <run>/, each experiments/<name>/, and a device-date
# folder itself when it directly holds files other than README.md (the runs
# recorded before run subfolders were used: CSVs and reports side by side).
# Folders inside a run folder (part1/, ...) are parts of that run.
_DEVICE_DATE = re.compile(r"^(?P<device>.+)-(?P<date>\d{4}-\d{2}-\d{2})$")


def _device_date_folders():
  return sorted(p for p in RESULTS.iterdir() if p.is_dir()
                and p != EXPERIMENTS and not p.name.startswith("smoke-"))


def _run_folders():
  runs = []
  for folder in _device_date_folders():
    if any(p.is_file() and p.name != "README.md" for p in folder.iterdir()):
      runs.append(folder)
    runs.extend(sorted(p for p in folder.iterdir() if p.is_dir()))
  return runs


def _experiment_folders():
  return sorted(p for p in EXPERIMENTS.iterdir() if p.is_dir())


def _first_line(folder: pathlib.Path) -> str:
  readme = folder / "README.md"
  assert readme.is_file(), f"{folder.relative_to(ROOT)}/ has no README.md"
  lines = readme.read_text(encoding="utf-8").splitlines()
  first = lines[0] if lines else ""
  assert re.match(r"^# \S", first), (
      f"{readme.relative_to(ROOT)}: the first line must be a '# ' heading "
      f"saying what was measured, on which device, the date and the commit; "
      f"it is {first!r}")
  return first


def test_results_layout():
  """benchmarks/results/ holds only device-date folders and experiments/:
  scratch goes under experiments/, not beside the recorded runs."""
  assert EXPERIMENTS.is_dir()
  strays = [p.name for p in _device_date_folders()
            if not _DEVICE_DATE.match(p.name)]
  assert not strays, (f"not <device>-<YYYY-MM-DD> folders in "
                      f"benchmarks/results/: {strays}; experiments go under "
                      f"benchmarks/results/experiments/")


def _device_word(device: str) -> str:
  """The word a heading must name for a device folder: "h100" for
  nvidia-h100-80gb-hbm3, "h200" for 2x-nvidia-h200, "cpu" for cpu."""
  words = re.findall(r"(?<![a-z0-9])(?:cpu|[a-z]+\d+[a-z]*)(?![a-z0-9])", device)
  return words[0] if words else device


@pytest.mark.parametrize("folder", _run_folders(),
                         ids=lambda p: str(p.relative_to(RESULTS)))
def test_run_folder_says_what_it_measured(folder):
  """A recorded run's README.md starts with a '# ' heading naming what was
  measured, the device, the date (the device-date folder's) and the commit."""
  first = _first_line(folder)
  day = folder if folder.parent == RESULTS else folder.parent
  match = _DEVICE_DATE.match(day.name)
  assert match, f"{day.relative_to(ROOT)} is not a <device>-<date> folder"
  where = f"{(folder / 'README.md').relative_to(ROOT)}: {first!r}"
  assert match["date"] in first, f"{where} does not name the date {match['date']}"
  assert re.search(r"(?<![0-9A-Za-z])[0-9a-f]{7,40}(?![0-9A-Za-z])", first), (
      f"{where} names no commit")
  device = _device_word(match["device"])
  assert device in first.lower(), f"{where} does not name the device ({device})"


@pytest.mark.parametrize("folder", _experiment_folders(),
                         ids=lambda p: p.name)
def test_experiment_folder_says_what_it_probed(folder):
  _first_line(folder)


def test_experiments_index_lists_every_folder():
  """experiments/README.md: a '# ' heading and one line linking each
  experiment folder; no line links a folder that is not there."""
  index = EXPERIMENTS / "README.md"
  assert index.is_file(), "benchmarks/results/experiments/README.md is missing"
  text = index.read_text(encoding="utf-8")
  assert text.startswith("# ")
  linked = {urllib.parse.unquote(target).strip("/").removeprefix("./")
            for _, target in relative_links(index)}
  names = {p.name for p in _experiment_folders()}
  assert not names - linked, (
      f"experiments/README.md has no entry (a link) for {sorted(names - linked)}")
  for name in names:
    entries = [line for line in text.splitlines() if f"]({name}" in line]
    assert len(entries) == 1, f"{name}: {len(entries)} index lines, want one"


def test_experiments_never_shadow_recorded_runs():
  """The notebooks load the newest recorded results per benchmark
  (benchmarks.plots.newest_results); an experiment's CSV must never be the
  one they pick."""
  import csv

  from benchmarks import plots
  benchmarks = set()
  for path in EXPERIMENTS.glob("**/*.csv"):
    with open(path, newline="") as f:
      benchmarks.update(row.get("benchmark") or "" for row in csv.DictReader(f))
  benchmarks.discard("")
  for benchmark in sorted(benchmarks):
    newest = plots.newest_results(str(ROOT), benchmark)
    assert newest is None or EXPERIMENTS not in pathlib.Path(newest).parents, (
        f"the notebooks would load {benchmark} rows from the experiment "
        f"{newest}: name it other than results.csv / *_results.csv, or make "
        f"newest_results skip experiments/")
