"""No import cycles among the project's modules.

Every import counts, at module level or inside a function (a deferred
import that closes a cycle still ties the two modules into one), and
``from package import name`` counts as importing ``package.name`` where
that is a module. A call's path through the code should go down the layers
without coming back (#51)."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("rlk_jax", "rlk_torch_bridge", "pallas_kernels", "triton_kernels",
            "cuda_ffi", "benchmarks", "examples")


def modules(root: pathlib.Path, packages) -> dict[str, pathlib.Path]:
  """Dotted name -> file of every module of `packages` under `root`
  (records under benchmarks/results are data, not modules)."""
  found = {}
  for package in packages:
    for path in sorted((root / package).rglob("*.py")):
      if "results" in path.relative_to(root).parts:
        continue
      parts = path.relative_to(root).with_suffix("").parts
      if parts[-1] == "__init__":
        parts = parts[:-1]
      found[".".join(parts)] = path
  return found


def imports_of(name: str, path: pathlib.Path, known) -> set[str]:
  """The project modules `name` imports anywhere in its file."""
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
        base = ".".join(up + ([node.module] if node.module else []))
      subs = [f"{base}.{a.name}" for a in node.names
              if f"{base}.{a.name}" in known]
      out.update(subs)
      if len(subs) < len(node.names):
        out.add(base)
  return {m for m in out if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def import_graph(root, packages) -> dict[str, set[str]]:
  known = modules(root, packages)
  return {name: imports_of(name, path, known) for name, path in known.items()}


def test_the_projects_modules_import_no_cycle():
  graph = import_graph(ROOT, PACKAGES)
  assert len(graph) > 50 and any(graph.values())
  assert cycles(graph) == []


@pytest.mark.parametrize("deferred", [False, True])
def test_a_cycle_is_found_also_through_a_deferred_or_relative_import(
    tmp_path, deferred):
  pkg = tmp_path / "pkg"
  (pkg / "sub").mkdir(parents=True)
  (pkg / "__init__.py").write_text("from pkg import a\n")
  (pkg / "a.py").write_text("from .sub import b\n")
  (pkg / "sub" / "__init__.py").write_text("")
  (pkg / "sub" / "b.py").write_text(
      "def f():\n  from pkg import a\n" if deferred else "from .. import a\n")
  (pkg / "c.py").write_text("import pkg.a\n")
  graph = import_graph(tmp_path, ("pkg",))
  assert graph["pkg.sub.b"] == {"pkg.a"}
  assert cycles(graph) == [["pkg.a", "pkg.sub.b"]]


# What each package may import of the project's others: the layers of
# docs/design.md's map, from cuda_ffi (no project import) up to the
# benchmarks and examples, which use everything.
MAY_IMPORT = {
    "cuda_ffi": set(),
    "pallas_kernels": set(),
    "triton_kernels": {"cuda_ffi"},
    "rlk_jax": {"cuda_ffi", "pallas_kernels", "triton_kernels"},
    "rlk_torch_bridge": {"cuda_ffi", "pallas_kernels", "triton_kernels",
                         "rlk_jax"},
    "benchmarks": set(PACKAGES) - {"benchmarks"},
    "examples": set(PACKAGES) - {"examples"},
}
# torch is the bridge's: the JAX side never imports it (triton_kernels'
# torch launchers import it inside their functions, on torch's call).
NO_TORCH = ("cuda_ffi", "pallas_kernels", "rlk_jax")


def package_imports(root, packages) -> set[tuple[str, str, str]]:
  """(importing module, imported package, imported module) for every
  import that crosses packages."""
  graph = import_graph(root, packages)
  return {(name, dep.split(".")[0], dep) for name, deps in graph.items()
          for dep in deps if dep.split(".")[0] != name.split(".")[0]}


def above_layer(crossings, may_import) -> list[tuple[str, str]]:
  """(module, imported module) of each crossing its package may not make."""
  return sorted((name, dep) for name, p, dep in crossings
                if p not in may_import[name.split(".")[0]])


def test_each_package_imports_only_the_layers_below_it():
  assert set(MAY_IMPORT) == set(PACKAGES)
  crossings = package_imports(ROOT, PACKAGES)
  assert any(p == "cuda_ffi" for _, p, _ in crossings)
  assert above_layer(crossings, MAY_IMPORT) == []


def test_the_jax_side_never_imports_torch():
  found = []
  for package in NO_TORCH:
    for path in sorted((ROOT / package).rglob("*.py")):
      for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom)
                 else [])
        found += [f"{path.relative_to(ROOT)}: {n}" for n in names
                  if n.split(".")[0] == "torch"]
  assert found == []


def test_a_package_importing_above_its_layer_is_found(tmp_path):
  for package, body in (("low", "def f():\n  import high.mod\n"),
                        ("high", "")):
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "mod.py").write_text(body)
  crossings = package_imports(tmp_path, ("low", "high"))
  assert crossings == {("low.mod", "high", "high.mod")}
  assert above_layer(crossings, {"low": set(), "high": {"low"}}) == [
      ("low.mod", "high.mod")]
  assert above_layer(crossings, {"low": {"high"}, "high": set()}) == []


# The torch bridge's own layers (docs/design.md's map): the public API and
# the batch-invariant mode, then one module per operator (schema, fake
# kernel, autograd, the choice of implementation), then the routes that
# launch a chosen implementation (SM90, Triton, the C++ extension, DLPack
# to JAX), then the plumbing every layer shares. A module imports its own
# layer or those below: a call goes down and never climbs back.
BRIDGE_LAYERS = (
    ("__init__", "functions", "logp", "attention", "nn", "tensor_parallel",
     "batch_invariant", "sdpa", "transformers_attention",
     "transformers_generate", "_aten_route", "_fallthroughs"),
    ("_gemm_op", "_tree_gemm", "_logp_op", "_vocab_logp", "_pack_op",
     "_attention_op", "_cache_step", "_row_mean_op", "_grouped_mm_op"),
    ("_gemm_routes", "_sm90", "_sm90_logp", "_sm90_attention",
     "_triton_native", "_triton_attention", "_attention_rows", "_row_routes",
     "_cuda_pack",
     "_packinfo", "_cpp_extension", "_in_situ", "_dlpack"),
    ("_library", "_checks", "_torch_stream", "_process_group", "_tables"),
)


def climbs(graph, package, layers) -> list[tuple[str, str]]:
  """(module, imported module) of each import of `package` that climbs to
  a layer above the importer's."""
  tier = {f"{package}.{m}" if m != "__init__" else package: i
          for i, names in enumerate(layers) for m in names}
  return sorted((name, dep) for name, deps in graph.items() if name in tier
                for dep in deps if dep in tier and tier[dep] < tier[name])


def test_the_bridge_calls_down_its_layers():
  graph = import_graph(ROOT, PACKAGES)
  bridge = {n for n in graph if n.split(".")[0] == "rlk_torch_bridge"}
  named = {f"rlk_torch_bridge.{m}" if m != "__init__" else "rlk_torch_bridge"
           for names in BRIDGE_LAYERS for m in names}
  assert bridge == named  # a new module is placed in a layer
  assert climbs(graph, "rlk_torch_bridge", BRIDGE_LAYERS) == []


def test_a_climb_between_layers_is_found():
  graph = {"p.top": {"p.low"}, "p.low": set(), "p.mid": {"p.top"}}
  assert climbs(graph, "p", (("top",), ("mid",), ("low",))) == [
      ("p.mid", "p.top")]
