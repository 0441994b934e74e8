"""The package's import graph has no circle: every module imports only modules below it. The
launchers' bookkeeping (sweep --status, a cell's runner) imports no JAX.

The graph is read statically from the source, imports inside functions included (they run all
the same, only later), with what Python imports besides the module named:
- `from package import name` is an edge to the submodule when `name` is one, else to the package;
  relative imports are resolved against the importing module's package.
- Importing `a.b.c` runs the `__init__.py` of `a` and `a.b` first: edges to those packages too,
  except the importer's own packages (they are initialised before the importer runs, and a package
  importing its own submodules is how a package is built, not a circle).
- `olora_jax/__init__.py` maps its top-level names to modules lazily (PEP 562): it imports
  nothing itself, so it has no edges; a module that does `from olora_jax import Evaluator`
  imports what that name maps to (olora_jax.evaluate), and that is its edge.
- The method registry (`olora_jax/methods/__init__.py`) imports every module of its package when
  it lists them (`pkgutil.iter_modules(__path__)`): edges to each of them.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib.util
import itertools
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "olora_jax"


def _module_name(path: Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _packages_of(name: str) -> list[str]:
  """The packages whose `__init__.py` runs before module `name`: 'a.b.c' -> ['a', 'a.b']."""
  parts = name.split(".")
  return [".".join(parts[:i]) for i in range(1, len(parts))]


def _lazy_names() -> dict[str, str]:
  """olora_jax's top-level names (PEP 562) -> the module each imports when asked for."""
  import olora_jax  # cheap: the names load on first use

  return {name: module for name, (module, _) in olora_jax._EXPORTS.items()}


def import_graph() -> dict[str, dict[str, int]]:
  """module -> {module it imports: the line of the (first) import}, read from the source (module
  docstring)."""
  modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
  lazy = _lazy_names()
  graph: dict[str, dict[str, int]] = {name: {} for name in modules}
  for name, path in modules.items():
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
      targets = []
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative import
          base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                          + ([base] if base else []))
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules
                   else lazy.get(a.name, base) if base == PACKAGE.name else base
                   for a in node.names]
      elif (isinstance(node, ast.Call) and ast.unparse(node.func) == "pkgutil.iter_modules"
            and [ast.unparse(a) for a in node.args] == ["__path__"]):  # the method registry
        targets = [m for m in modules if m.rpartition(".")[0] == name]
      for target in targets:
        for imported in (*_packages_of(target), target):
          if imported in modules and imported != name and imported not in _packages_of(name):
            graph[name].setdefault(imported, node.lineno)
  return graph


def cycle_through(graph: dict[str, dict[str, int]], component: list[str]) -> str:
  """One circle inside a strongly connected `component`, as 'a (line 3) -> b (line 9) -> a':
  each module with the line of its import of the next."""
  start, inside = component[0], set(component)
  came_from: dict[str, str] = {}
  frontier = [start]
  while frontier:  # breadth first: the shortest way back to `start`
    reached = []
    for v in frontier:
      for w in sorted(graph[v]):
        if w in inside and w not in came_from:
          came_from[w] = v
          reached.append(w)
    if start in came_from:
      break
    frontier = reached
  path = [start]
  while len(path) == 1 or path[-1] != start:
    path.append(came_from[path[-1]])
  path.reverse()  # start -> ... -> start
  steps = (f"{v} (line {graph[v][w]})" for v, w in itertools.pairwise(path))
  return " -> ".join(steps) + f" -> {start}"


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
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


def test_the_package_has_no_import_circle():
  graph = import_graph()
  assert len(graph) > 20 and "olora_jax.trainer" in graph
  assert "olora_jax.protocol" in graph["olora_jax.trainer"]  # edges are read
  assert "olora_jax.models" in graph["olora_jax.learner.online_lora"]  # a submodule's package
  assert "olora_jax.methods.er" in graph["olora_jax.methods"]  # the registry's discovery
  found = [cycle_through(graph, component) for component in circles(graph)]
  assert not found, "import circle(s), each module with the line that imports the next:\n" + (
      "\n".join(found))


def test_a_circle_is_found():
  graph = {"a": {"b": 1}, "b": {"c": 2, "d": 3}, "c": {"a": 4}, "d": {"a": 5}, "e": {"a": 6}}
  assert circles(graph) == [["a", "b", "c", "d"]]
  assert cycle_through(graph, ["a", "b", "c", "d"]) == "a (line 1) -> b (line 2) -> c (line 4) -> a"


def test_function_level_package_and_lazy_imports_are_edges(tmp_path, monkeypatch):
  """A function's import, the package a submodule import runs, and a lazy top-level name are
  edges; a package importing its own submodule is not a circle."""
  package = tmp_path / "olora_jax"
  (package / "sub").mkdir(parents=True)
  (package / "__init__.py").write_text("")
  (package / "sub" / "__init__.py").write_text("from olora_jax.sub import leaf\n")
  (package / "sub" / "leaf.py").write_text("from . import other\n")
  (package / "sub" / "other.py").write_text("def f():\n  from olora_jax import Evaluator\n")
  (package / "evaluate.py").write_text("import olora_jax.sub.leaf\n")
  monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
  graph = import_graph()
  assert graph["olora_jax.sub"] == {"olora_jax.sub.leaf": 1}
  assert graph["olora_jax.sub.leaf"] == {"olora_jax.sub.other": 1}
  assert graph["olora_jax.sub.other"] == {"olora_jax.evaluate": 2}
  assert graph["olora_jax.evaluate"] == {"olora_jax.sub": 1, "olora_jax.sub.leaf": 1}
  assert circles(graph) == [["olora_jax.evaluate", "olora_jax.sub", "olora_jax.sub.leaf",
                             "olora_jax.sub.other"]]


def test_configs_is_part_of_the_installed_distribution(tmp_path):
  """`import configs` works outside the repository once the project is installed: the
  distribution's packages (pyproject.toml) include `configs` beside `olora_jax`. setuptools'
  build_py copies exactly what an install puts on the path (package data included) from a copy
  of the sources; a fresh interpreter in another directory imports the settings from there."""
  root = PACKAGE.parent
  src, lib, elsewhere = tmp_path / "src", tmp_path / "lib", tmp_path / "elsewhere"
  src.mkdir()
  elsewhere.mkdir()
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(root / name, src / name)
  for name in ("olora_jax", "configs"):
    shutil.copytree(root / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
  if importlib.util.find_spec("setuptools") is not None:
    subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q",
                    "build_py", f"--build-lib={lib}"], cwd=src, check=True, capture_output=True,
                   timeout=120)
  else:  # venvs of Python 3.12+ come without setuptools: pyproject's rules, applied by hand
    copy_declared_packages(src, lib)
  env = {**os.environ, "PYTHONPATH": str(lib)}  # the installed files, not the checkout
  code = ("import os, configs, olora_jax; from configs import demo; c = demo.get_config();"
          " print(configs.__file__); print(olora_jax.__file__);"
          " print(os.path.isfile(c.pretrained.path))")
  proc = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, text=True,
                        capture_output=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  configs_file, package_file, backbone_found = proc.stdout.split()
  assert Path(configs_file).parent == lib / "configs"
  assert Path(package_file).parent == lib / "olora_jax"
  assert backbone_found == "True"  # the demo's shipped backbone is package data


def copy_declared_packages(src: Path, lib: Path) -> None:
  """What setuptools' build_py puts in `lib`: the packages under `src` that pyproject.toml's
  `packages.find.include` patterns match (their .py files) and each package's `package-data`."""
  with open(src / "pyproject.toml", "rb") as f:
    setuptools_table = tomllib.load(f)["tool"]["setuptools"]
  include = setuptools_table["packages"]["find"]["include"]
  for init in src.rglob("__init__.py"):
    package = ".".join(init.parent.relative_to(src).parts)
    if any(fnmatch.fnmatchcase(package, pattern) for pattern in include):
      for module in init.parent.glob("*.py"):
        (lib / module.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(module, lib / module.relative_to(src))
  for package, patterns in setuptools_table.get("package-data", {}).items():
    for pattern in patterns:
      for data in (src / package.replace(".", "/")).glob(pattern):
        (lib / data.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(data, lib / data.relative_to(src))


def test_importing_every_module_starts_no_jax_backend():
  """No module makes a JAX array at import: that starts the XLA backend, and a multi-process run
  must call jax.distributed.initialize before it starts (an SCR constant once broke every
  `srun -n2` run with 'must be called before any JAX calls')."""
  code = ("import pkgutil, importlib, olora_jax\n"
          "from jax._src import xla_bridge\n"
          "for m in pkgutil.walk_packages(olora_jax.__path__, 'olora_jax.'):\n"
          "  importlib.import_module(m.name)\n"
          "from olora_jax import methods\n"
          "methods.specs()\n"
          "assert not xla_bridge.backends_are_initialized()\n")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]


# The libraries a run needs and a launcher's bookkeeping does not (about 1.4 s of imports).
HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax", "tensorstore")


def test_sweep_status_and_the_package_import_none_of_jax(tmp_path):
  """`sweep.py --status` (polled on a login node; `--run_cell`, every cell's runner, shares its
  imports) reads the plan and the workdirs without JAX, Flax or Orbax: `olora_jax` loads its
  top-level names on first use, and each of them still resolves to its module's object."""
  from olora_jax.sweep import cells

  root = tmp_path / "sweep"
  cells.write_plan(str(root), [{"workdir": str(root / "tiny" / "er" / "seed0"),
                                "command": ["python"], "tuning": None}])
  code = ("import sys\n"
          "from olora_jax.sweep import cli\n"
          f"assert cli.main(['--status', {str(root)!r}]) == 0\n"
          "import olora_jax\n"
          f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))\n")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  assert "seed0: not started" in done.stdout, done.stdout
  assert done.stdout.splitlines()[-1] == "[]", done.stdout  # no heavy library imported

  import olora_jax
  from olora_jax.learner import plateau
  from olora_jax.models import vit

  assert set(olora_jax.__all__) <= set(dir(olora_jax))
  assert olora_jax.VisionTransformer is vit.VisionTransformer
  assert olora_jax.init_plateau is plateau.init and olora_jax.update_plateau is plateau.update
  assert all(getattr(olora_jax, name) is not None for name in olora_jax.__all__)
  with pytest.raises(AttributeError, match="has no attribute 'nope'"):
    olora_jax.nope  # noqa: B018
