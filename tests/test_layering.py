"""The package's layering holds in its import graph: plain sampling, the KV cache and
the models know nothing of speculation or RL, speculation knows nothing of RL, and
inside RL the application (commands, configs, run directories) sits on the loops
(rollout, learner, sync and async) which sit on the algorithm (advantages, objectives);
tasks and rewards know none of the three."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "specrl_jax"

# (layer, layers it must not import), by subpackage of specrl_jax.
RULES = (
    ("sampling", ("speculative", "rl")),
    ("kv", ("speculative", "rl")),
    ("models", ("speculative", "rl")),
    ("speculative", ("rl",)),
    ("rl.algo", ("rl.loop", "rl.app", "rl.tasks")),
    ("rl.loop", ("rl.app",)),
    ("rl.tasks", ("rl.algo", "rl.loop", "rl.app")),
)


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path) -> set[str]:
  """Every specrl_jax module ``path`` imports, at any depth of the file (imports inside
  functions count: they run too), with relative imports resolved."""
  name = module_name(path)
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = package.split(".")
        base = base[:len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
      else:
        source = node.module or ""
      found.add(source)
      # ``from specrl_jax.x import y`` may import the module specrl_jax.x.y.
      found.update(f"{source}.{alias.name}" for alias in node.names
                   if is_module(f"{source}.{alias.name}"))
  return {m for m in found if m == "specrl_jax" or m.startswith("specrl_jax.")}


def is_module(name: str) -> bool:
  path = PACKAGE.parent.joinpath(*name.split("."))
  return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def import_graph() -> dict[str, set[str]]:
  return {module_name(path): imports_of(path) for path in sorted(PACKAGE.rglob("*.py"))}


def in_layer(module: str, layer: str) -> bool:
  prefix = f"specrl_jax.{layer}"
  return module == prefix or module.startswith(prefix + ".")


def test_the_graph_is_read_with_relative_imports_resolved():
  graph = import_graph()
  assert "specrl_jax.sampling.engine" in graph
  assert any(in_layer(m, "kv") for m in graph["specrl_jax.sampling.engine"])


@pytest.mark.parametrize("layer,forbidden", RULES)
def test_a_layer_imports_nothing_above_it(layer, forbidden):
  graph = import_graph()
  violations = sorted(
      f"{module} imports {imported}"
      for module, imported_modules in graph.items() if in_layer(module, layer)
      for imported in imported_modules if any(in_layer(imported, f) for f in forbidden))
  assert not violations, "\n".join(violations)


def long_functions(layer: str, limit: int) -> list[str]:
  found = []
  for path in sorted((PACKAGE / layer.replace(".", "/")).rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        length = node.end_lineno - node.lineno + 1
        if length > limit:
          found.append(f"{module_name(path)}.{node.name}: {length} lines")
  return found


def test_rl_files_stay_under_400_lines_and_app_functions_under_60():
  """Small modules and short functions keep the RL stack readable: a file that grows
  past 400 lines does two things, an application function past 60 has several jobs."""
  too_long = [f"{module_name(path)}: {len(path.read_text().splitlines())} lines"
              for path in sorted((PACKAGE / "rl").rglob("*.py"))
              if len(path.read_text().splitlines()) > 400]
  assert not too_long, "\n".join(too_long)
  assert not long_functions("rl.app", 60), "\n".join(long_functions("rl.app", 60))


# Private attributes that JAX's jitted functions carry (``jax.jit(f)._cache_size()``):
# read on a function this module defined itself they are still JAX's, not ours.
JAX_PRIVATE_ATTRIBUTES = ("_cache_size", "_clear_cache", "_fun", "_cache_miss", "_src")


def is_private(name: str) -> bool:
  return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def package_of(module: str) -> str:
  path = PACKAGE.parent.joinpath(*module.split("."))
  return module if (path / "__init__.py").is_file() else module.rpartition(".")[0]


def private_uses(path: pathlib.Path) -> list[str]:
  return private_uses_in(path.read_text(), module_name(path), path.name == "__init__.py")


def private_uses_in(source_text: str, name: str, is_package: bool = False) -> list[str]:
  """Where module ``name`` (its source ``source_text``) uses a private name of another package: ``from a.b import _c``
  (or any import through a private module such as ``jax._src``) with a.b outside the
  importing module's own package, ``name._c`` on a name bound by an import of another
  package, and JAX's private attributes anywhere."""
  own = package_of(name)
  package = name if is_package else name.rpartition(".")[0]
  imported = {}  # local name -> the package it was imported from
  found = []
  tree = ast.parse(source_text)
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        source = alias.name
        imported[alias.asname or source.partition(".")[0]] = source
        if any(map(is_private, source.split("."))):
          found.append(f"line {node.lineno}: import {source}")
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = package.split(".")
        base = base[:len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
      else:
        source = node.module or ""
      foreign = not source.startswith("specrl_jax") or package_of(source) != own
      for alias in node.names:
        imported[alias.asname or alias.name] = source
        if foreign and (is_private(alias.name) or any(map(is_private, source.split(".")))):
          found.append(f"line {node.lineno}: from {source} import {alias.name}")
  for node in ast.walk(tree):
    if not isinstance(node, ast.Attribute) or not is_private(node.attr):
      continue
    root = node.value
    while isinstance(root, ast.Attribute):
      root = root.value
    source = imported.get(root.id) if isinstance(root, ast.Name) else None
    foreign = source is not None and (not source.startswith("specrl_jax")
                                      or package_of(source) != own)
    if foreign or node.attr in JAX_PRIVATE_ATTRIBUTES:
      found.append(f"line {node.lineno}: {ast.unparse(node)}")
  return found


# The standard library's documented functions whose names happen to start with "_".
PUBLIC_WITH_UNDERSCORE = ("os._exit",)


def test_no_module_uses_a_private_name_of_another_package():
  violations = sorted(
      f"{module_name(path)} {use}" for path in sorted(PACKAGE.rglob("*.py"))
      for use in private_uses(path) if not use.endswith(PUBLIC_WITH_UNDERSCORE))
  assert not violations, "\n".join(violations)


@pytest.mark.parametrize("source,caught", [
    ("from specrl_jax.sampling.rollout import _start\n", True),
    ("from specrl_jax.sampling import rollout\nrollout._start(1)\n", True),
    ("import specrl_jax.sampling.rollout as r\nr._start(1)\n", True),
    ("from specrl_jax.sampling.rollout import start\nstart._cache_size()\n", True),
    ("from jax._src import xla_bridge\n", True),
    ("import jax\njax._src.xla_bridge.backends_are_initialized()\n", True),
    ("from specrl_jax.speculative.rollout import _helper\n", False),  # own package
    ("from specrl_jax.sampling.rollout import start\nstart(1)\n", False),
    ("class A:\n  def f(self):\n    return self._x\n", False),
])
def test_the_private_name_check_catches_each_form(source, caught):
  assert bool(private_uses_in(source, "specrl_jax.speculative.probe")) == caught
