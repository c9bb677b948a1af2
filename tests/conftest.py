"""Test-wide JAX setup: eight simulated CPU devices for the sharding tests, the tiny
models many engine tests share, and the tiny GRPO setup the RL loop tests share.

Must run before JAX initialises a backend, hence environment variables at import.
"""
import gc
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No persistent compilation cache unless a test asks for one: `specrl train` would
# otherwise open one beside each test's output directory, shared between tests. (A
# suite-wide cache was tried: serializing the async pipeline's program with heads split
# over "tensor" crashed a worker inside JAX's cache write, so it stays off.)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "")
# Compiling is most of the suite's time (XLA:CPU's backend: 55 of the 66 s of
# test_adaptive's two slowest tests). Without LLVM's optimisations and with one codegen
# module per program (no split to run on cores the other worker uses) that pair takes
# 37 s, and a 20,000-sample chi-square test 38 s instead of 40 (slower to run, faster to
# compile). XLA:CPU's newer fusion emitters cost more to compile than they save on
# these tiny programs: without them an adaptive greedy-identity case took 15.6 s
# instead of 24.8 (CPU seconds 34 -> 18) and a chain chi-square case 15.7 s instead of
# 19.1, one process alone on the two cores. The subprocesses the tests start inherit
# the flags; benchmarks never run so. XLA's constant folding evaluates reductions over
# the verification masks broadcast to every slot on the host, one element at a time
# (seconds at the chi-square tests' 4096 slots); without it a 4096-slot tree program
# compiled in 5.0 / 6.2 s instead of 8.9 / 7.4 (two interleaved pairs), and ran as fast.
os.environ["XLA_FLAGS"] = " ".join([
    os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0",
    "--xla_cpu_parallel_codegen_split_count=1", "--xla_cpu_use_fusion_emitters=false",
    "--xla_disable_hlo_passes=constant_folding"]).strip()


import jax  # noqa: E402
import pytest  # noqa: E402

from specrl_jax import drafters, rl, testing  # noqa: E402
from specrl_jax.config import ModelConfig, SamplingParams  # noqa: E402
from specrl_jax.models import tokenizer  # noqa: E402
from specrl_jax.rl import tasks  # noqa: E402
from specrl_jax.sampling import programs  # noqa: E402

# The tiny target the engine tests decode with: a 12-token vocabulary keeps the joint
# distribution of a few tokens enumerable, four query heads over two KV heads keep
# grouped-query attention in every path.
TINY_TARGET = ModelConfig(vocab_size=12, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)


# The tiny GRPO setup of the RL loop tests (sync, async, in-loop controller): one-digit
# addition, a 2-layer policy over the built-in vocabulary, sampled rollouts to the task's
# longest answer, a constant learning rate and truncated importance sampling.
RL_TASK = tasks.Arithmetic(min_digits=1, max_digits=1)
RL_POLICY = ModelConfig(vocab_size=tokenizer.VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                        num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)
RL_SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=RL_TASK.max_response_tokens,
                             stop_token_ids=(tokenizer.EOS_ID,))
RL_LEARNER = rl.LearnerConfig(learning_rate=1e-3, schedule="constant",
                              loss=rl.GRPOConfig(tis_cap=2.0))
RL_PROMPTS = tasks.make_prompt_set(RL_TASK, 16, seed=0)


@pytest.fixture(scope="session")
def target():
  """A peaked random target (sampling at temperature 1 is far from uniform)."""
  return testing.peaked_random_model(TINY_TARGET, seed=0)


@pytest.fixture(scope="session")
def noisy_drafter(target):
  """A draft model close to the target but not equal to it: drafts are accepted often
  and rejected often, so every branch of verification runs."""
  return drafters.DraftModel(testing.perturbed_model(target, seed=2, noise=0.3))


# The files that take longest, longest first: `make test` hands whole files to the
# workers (xdist's loadfile, so a file's programs and module fixtures are built once, not
# once per worker) in collection order, and a long file dealt last would run alone.
_LONGEST_FIRST = ("test_scale.py", "test_speculative.py", "test_compaction.py",
                  "test_faults.py", "test_adaptive.py", "test_adaptive_compaction.py",
                  "test_learner_precision.py", "test_distributed.py",
                  "test_learned_drafters.py", "test_inloop_exactness.py", "test_lowering.py",
                  "test_history_drafter.py", "test_colabs.py", "test_rl_sync.py")


def pytest_collection_modifyitems(items):
  rank = {name: index for index, name in enumerate(_LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: others as found


# The kernel refuses a process more than vm.max_map_count (65,530 here) memory maps, and
# each compiled XLA:CPU program holds about 1,150. The engine's program caches keep
# programs past a module's end (jax.clear_caches does not reach them), and a worker
# reached 64,481 maps before LLVM failed to allocate while compiling and the worker died
# of a fatal signal. So every cache is dropped after any test that leaves the worker past
# this many maps, as well as at the end of each module.
_MAX_MAPS = 25_000


def _drop_compiled_programs():
  jax.clear_caches()
  programs.clear_program_caches()  # the engine's own caches, which clear_caches misses
  gc.collect()  # the executables go when nothing refers to them


@pytest.fixture(autouse=True)
def _stay_under_the_memory_map_limit():
  yield
  if programs.memory_maps()[0] > _MAX_MAPS:
    _drop_compiled_programs()


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """Drops each module's compiled programs when it ends (see _MAX_MAPS)."""
  yield
  _drop_compiled_programs()
