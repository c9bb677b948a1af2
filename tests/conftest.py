"""Test-wide JAX setup: eight simulated CPU devices for the sharding tests, and the
tiny models many engine tests share.

Must run before JAX initialises a backend, hence environment variables at import.
"""
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No persistent compilation cache unless a test asks for one: `specrl train` would
# otherwise open one beside each test's output directory, shared between tests. (A
# suite-wide cache was tried: serializing the async pipeline's program with heads split
# over "tensor" crashed a worker inside JAX's cache write, so it stays off.)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "")


import jax  # noqa: E402
import pytest  # noqa: E402

from specrl_jax import drafters, testing  # noqa: E402
from specrl_jax.config import ModelConfig  # noqa: E402

# The tiny target the engine tests decode with: a 12-token vocabulary keeps the joint
# distribution of a few tokens enumerable, four query heads over two KV heads keep
# grouped-query attention in every path.
TINY_TARGET = ModelConfig(vocab_size=12, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)


@pytest.fixture(scope="session")
def target():
  """A peaked random target (sampling at temperature 1 is far from uniform)."""
  return testing.peaked_random_model(TINY_TARGET, seed=0)


@pytest.fixture(scope="session")
def noisy_drafter(target):
  """A draft model close to the target but not equal to it: drafts are accepted often
  and rejected often, so every branch of verification runs."""
  return drafters.DraftModel(testing.perturbed_model(target, seed=2, noise=0.3))


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """Drops each module's compiled programs when it ends: a worker that keeps every
  program of the suite runs into the kernel's limit on memory maps (LLVM then fails to
  allocate while compiling, which crashed a worker once)."""
  yield
  jax.clear_caches()

