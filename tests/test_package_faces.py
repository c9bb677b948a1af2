"""Package faces: each subpackage's ``__all__`` resolves, ``sj.rl`` and friends load on
first access, and ``import specrl_jax`` stays free of the RL stack."""

import importlib
import subprocess
import sys
import types

import pytest

import specrl_jax as sj

SUBPACKAGES = ("kv", "models", "sampling", "speculative", "speculative.drafters",
               "parallel", "rl", "sim", "testing")
# Names a face exports on purpose as submodules.
SUBMODULE_EXPORTS = {("models", "tokenizer"), ("parallel", "distributed")}


def test_lazy_top_level_subpackages_resolve():
  assert callable(sj.rl.grpo_loss)
  assert callable(sj.sim.simulate_rollout)
  assert callable(sj.testing.chi_square)
  assert callable(sj.parallel.make_mesh)
  assert {"rl", "sim", "testing", "parallel"} <= set(dir(sj))


@pytest.mark.parametrize("subpackage", SUBPACKAGES)
def test_every_exported_name_resolves(subpackage):
  package = importlib.import_module(f"specrl_jax.{subpackage}")
  assert package.__all__, f"specrl_jax.{subpackage} exports nothing"
  for name in package.__all__:
    value = getattr(package, name)
    # A lazy name shadowed by a submodule of the same name would resolve to the module.
    if isinstance(value, types.ModuleType):
      assert (subpackage, name) in SUBMODULE_EXPORTS, f"specrl_jax.{subpackage}.{name}"


def test_unknown_name_is_an_attribute_error():
  with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
    sj.nonexistent  # noqa: B018
  with pytest.raises(AttributeError):
    importlib.import_module("specrl_jax.sampling").nonexistent  # noqa: B018


def test_import_loads_neither_rl_nor_the_simulator():
  # A fresh interpreter: this one has imported rl already.
  code = ("import sys, specrl_jax; "
          "print(sorted(m for m in sys.modules if m.startswith(('specrl_jax.rl', "
          "'specrl_jax.sim', 'specrl_jax.testing'))))")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
  assert result.stdout.strip() == "[]"
