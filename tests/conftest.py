"""Test-wide JAX setup: eight simulated CPU devices for the sharding tests.

Must run before JAX initialises a backend, hence environment variables at import.
"""
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No persistent compilation cache unless a test asks for one: `specrl train` would
# otherwise open one beside each test's output directory, shared between tests.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "")


import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """Drops each module's compiled programs when it ends: a worker that keeps every
  program of the suite runs into the kernel's limit on memory maps (LLVM then fails to
  allocate while compiling, which crashed a worker once)."""
  yield
  jax.clear_caches()
