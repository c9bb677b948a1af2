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
