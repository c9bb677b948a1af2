"""Every compiled program a user runs lowers for TPU and for GPU, with the Pallas kernels
selected (not interpret mode), at the shapes of real presets, on one device and on a
(1, 1, 4) mesh that splits the heads: what can be verified without either device.

``jax.export`` lowers a program for another platform on this CPU-only machine, and
Pallas checks block shapes, dtypes and primitives while lowering (Mosaic's verifier for
TPU, the Triton lowering for GPU), so many errors a device compiler would raise show
up here. What lowering cannot show (the device compilers' own passes, run time,
numerics) needs a device: ``experiments/device_check.sh``.

Models keep the presets' attention shapes (qwen3-0.6b: 16 query heads over 8 KV heads
of 128; llama-3.2-1b: 32 over 8 of 64; bfloat16) and pages of 16, 64 and 128 tokens,
with one or two layers and a small vocabulary and hidden size, which the kernels'
shapes do not depend on. Each program is lowered once per platform and mesh; the
lowered modules are shared by the tests that read them.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax.sharding import NamedSharding, PartitionSpec as P

import specrl_jax as sj
from specrl_jax import parallel, rl
from specrl_jax.config import PRESETS
from specrl_jax.kernels import lowering_for, paged_attention_gpu, paged_attention_tpu
from specrl_jax.models import tokenizer
from specrl_jax.parallel.mesh import BATCH_AXES
from specrl_jax.rl import tasks
from specrl_jax.rl.loop import async_pipeline, lora as rl_lora, online_drafters, sync
from specrl_jax.rl.loop import rollout as rl_rollout
from specrl_jax.sampling import rollout as sampling_rollout, sharded
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.sampling.layout import pack
from specrl_jax.speculative.drafters import offline
from specrl_jax.speculative.rollout import rounds_of, speculation

PLATFORMS = ("tpu", "cuda")
# What each platform's Pallas kernel lowers to.
KERNEL_CALL = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}
DISABLED_CHECKS = {"tpu": (),
                   "cuda": (jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton"),)}
MESHES = {"one_device": None, "tensor4": (1, 1, 4)}


def small(preset: str, num_layers: int = 1) -> sj.ModelConfig:
  """``preset``'s attention (heads, KV heads, head dim, dtypes, qk-norm, rope) with a
  small vocabulary, hidden size and MLP, and ``num_layers`` layers."""
  return PRESETS[preset].replace(vocab_size=256, hidden_size=128, intermediate_size=256,
                                 num_layers=num_layers)


def export(jitted, args, platform: str) -> jax.export.Exported:
  """``jitted`` traced with ``platform``'s kernels and lowered for it."""
  with lowering_for(platform):
    return jax.export.export(jitted, platforms=[platform],
                             disabled_checks=DISABLED_CHECKS[platform])(*args)


def assert_runs_the_kernel(exported: jax.export.Exported, platform: str, devices: int):
  assert exported.platforms == (platform,)
  assert exported.nr_devices == devices
  assert KERNEL_CALL[platform] in exported.mlir_module()


# --- the kernels alone, at every preset shape ----------------------------------------

def kernel_args(*, heads, kv_heads, head_dim, page_size, q_len, dtype, batch=4, max_pages=8):
  sds = jax.ShapeDtypeStruct
  pool = (batch * max_pages + 1, kv_heads, page_size, head_dim)
  return (sds((batch, q_len, heads, head_dim), dtype), sds(pool, dtype), sds(pool, dtype),
          sds((batch, max_pages), jnp.int32), sds((batch,), jnp.int32),
          sds((batch, q_len, kv_heads, head_dim), dtype),
          sds((batch, q_len, kv_heads, head_dim), dtype), sds((batch, q_len, q_len), bool))


KERNEL_SHAPES = list(itertools.product((64, 128), (2, 4), (16, 64, 128), (1, 5),
                                       ("bfloat16", "float32")))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_the_kernels_lower_at_every_preset_shape(platform):
  """head_dim 64 / 128, 2 or 4 query heads per KV head, pages of 16 / 64 / 128, one
  query token (plain decode) or five (a chain), bf16 and f32: 48 shapes."""
  kernel = {"tpu": paged_attention_tpu, "cuda": paged_attention_gpu}[platform]
  for head_dim, groups, page_size, q_len, dtype in KERNEL_SHAPES:
    args = kernel_args(heads=8 * groups, kv_heads=8, head_dim=head_dim, page_size=page_size,
                       q_len=q_len, dtype=jnp.dtype(dtype))
    assert_runs_the_kernel(export(jax.jit(kernel), args, platform), platform, devices=1)


# --- generation programs -------------------------------------------------------------

SAMPLING = sj.SamplingParams(temperature=1.0, max_new_tokens=8)
# (preset, page size) per mesh: between them head dims 128 and 64, pages 128 and 64;
# plain decoding also lowers with pages of 16.
GENERATION = {"one_device": ("qwen3-0.6b", 128), "tensor4": ("llama-3.2-1b", 64)}
SPECS = {"chain": sj.SpecConfig(num_draft_tokens=3),
         "tree": sj.SpecConfig(tree=(2, 2, 1))}


def mesh_of(name):
  shape = MESHES[name]
  return None if shape is None else parallel.make_mesh(
      shape, devices=jax.devices()[:int(np.prod(shape))])


class Generation:
  """A target, a draft model and the packed inputs of one program's call, laid out as
  ``sj.generate`` lays them out on ``mesh``."""

  def __init__(self, mesh_name: str, page_size: int | None = None):
    preset, default_page = GENERATION[mesh_name]
    config = small(preset)
    self.mesh = mesh_of(mesh_name)
    self.devices = 1 if self.mesh is None else self.mesh.size
    self.config = config
    self.graphdef, self.params = nnx.split(sj.Transformer(config, rngs=nnx.Rngs(0)))
    self.draft = sj.drafters.DraftModel(sj.Transformer(config, rngs=nnx.Rngs(1)))
    self.page_size = page_size or default_page
    self.prompts = [[1, 2, 3, 4, 5]] * 4 + [[7, 8, 9]] * 4

  def args(self, spec=None, engine: EngineConfig | None = None):
    """(static keyword arguments, arguments) of the sampling programs."""
    engine = engine or EngineConfig(page_size=self.page_size, num_slots=8, attention="pallas")
    drafter = self.draft if spec is not None else None
    rounds = rounds_of(*speculation(self.config, SAMPLING, drafter, spec))
    inputs, layout = pack(self.config, self.prompts, SAMPLING, engine, rounds=rounds,
                          tensor_shards=1 if self.mesh is None else self.mesh.shape["tensor"])
    layout = sharded.layout_on_mesh(layout, self.mesh)
    params, hook_params = self.params, rounds.params() if rounds is not None else ()
    rng = jax.random.key(0)
    if self.mesh is not None:
      params = sharded.place_weights(params, self.mesh)
      hook_params, _ = sharded.place_drafter(hook_params, params, self.mesh)
      inputs, rng = sharded.replicate(self.mesh, (inputs, rng))
    static = dict(sampling=SAMPLING, layout=layout, rounds=rounds)
    return static, (params, hook_params, *inputs, rng)

  def lower(self, function, static, args, platform):
    return export(jax.jit(functools.partial(function, self.graphdef, **static)), args, platform)


@pytest.fixture(scope="module", params=list(MESHES))
def generation(request):
  return Generation(request.param)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("kind", ["plain", "chain", "tree"])
def test_whole_rollouts_lower_with_the_kernels(kind, platform, generation):
  static, args = generation.args(SPECS.get(kind))
  exported = generation.lower(sampling_rollout.rollout, static, args, platform)
  assert_runs_the_kernel(exported, platform, generation.devices)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_plain_decoding_lowers_with_pages_of_16(platform):
  generation = Generation("one_device", page_size=16)
  static, args = generation.args()
  exported = generation.lower(sampling_rollout.rollout, static, args, platform)
  assert_runs_the_kernel(exported, platform, 1)


def stage_programs(generation, static, args, platform):
  """The prefill and every compaction stage's program, each traced on the abstract
  state the one before returns."""
  params, hook_params, *inputs, rng = args
  lowered = [generation.lower(sampling_rollout.start_rollout, static, args, platform)]
  with lowering_for(platform):
    state, prompts = jax.eval_shape(
        functools.partial(sampling_rollout.start_rollout, generation.graphdef, **static),
        *args)
  for stage in range(len(sampling_rollout.widths_of(static["layout"]))):
    stage_static = dict(static, stage=stage)
    stage_args = (params, hook_params, state, prompts)
    lowered.append(generation.lower(sampling_rollout.run_stage, stage_static, stage_args,
                                    platform))
    with lowering_for(platform):
      state = jax.eval_shape(
          functools.partial(sampling_rollout.run_stage, generation.graphdef, **stage_static),
          *stage_args)
  return lowered


@pytest.mark.parametrize("platform", PLATFORMS)
def test_compaction_stages_lower_with_the_kernels(platform, generation):
  engine = EngineConfig(page_size=generation.page_size, num_slots=8, attention="pallas",
                        compaction=True, compaction_min_width=2)
  static, args = generation.args(engine=engine)
  prefill, *stages = stage_programs(generation, static, args, platform)
  assert len(stages) == 3  # widths 8, 4 and 2
  # Prefill attends through jax.nn.dot_product_attention, the stages through the kernel.
  assert prefill.platforms == (platform,) and prefill.nr_devices == generation.devices
  for exported in stages:
    assert_runs_the_kernel(exported, platform, generation.devices)


def rounds_up_to(graphdef, params, hook_params, state, prompts, max_rounds, **static):
  return sampling_rollout.continue_rollout(graphdef, params, hook_params, state, prompts,
                                           max_rounds=max_rounds, **static)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_adaptive_batches_of_rounds_lower_with_the_kernels(platform, generation):
  """The adaptive engine's program: rounds of a chosen draft length, their count
  traced (0 drafts is plain decoding's program, lowered above)."""
  static, args = generation.args(sj.SpecConfig(num_draft_tokens=2))
  params, hook_params, *_ = args
  with lowering_for(platform):
    state, prompts = jax.eval_shape(
        functools.partial(sampling_rollout.start_rollout, generation.graphdef, **static),
        *args)
  exported = generation.lower(rounds_up_to, static,
                              (params, hook_params, state, prompts, jnp.int32(4)), platform)
  assert_runs_the_kernel(exported, platform, generation.devices)


# --- RL programs ---------------------------------------------------------------------

TASK = tasks.Arithmetic(min_digits=1, max_digits=1)
RL_SAMPLING = sj.SamplingParams(temperature=1.0, max_new_tokens=TASK.max_response_tokens,
                                stop_token_ids=(tokenizer.EOS_ID,))
ROLLOUT = rl_rollout.RolloutConfig(group_size=2, prompts_per_step=2, sampling=RL_SAMPLING)
PROMPTS = tasks.make_prompt_set(TASK, 2, seed=0)
PROMPT_WIDTH = PROMPTS.tokens_PxT.shape[1]
LEARNER = rl.LearnerConfig(learning_rate=1e-3, schedule="constant")
# Remat of every block, LoRA adapters on a frozen base, a KL term to a frozen reference.
HEAVY_LEARNER = rl.LearnerConfig(learning_rate=1e-3, schedule="constant", remat="full",
                                 lora=rl_lora.LoRAConfig(rank=4),
                                 loss=rl.GRPOConfig(beta=0.04))
RL_ENGINE = EngineConfig(page_size=64, attention="pallas")
RL_MESHES = {"one_device": ((1, 1, 1), (1, 1, 1)), "tensor4": ((1, 1, 4), (1, 1, 4))}


def rl_models():
  policy = small("llama-3.2-1b").replace(vocab_size=tokenizer.VOCAB_SIZE)
  graphdef, params = nnx.split(sj.Transformer(policy, rngs=nnx.Rngs(0)))
  draft = sj.drafters.DraftModel(sj.Transformer(policy, rngs=nnx.Rngs(1)))
  return policy, graphdef, params, online_drafters.online_drafter(draft, sampling=RL_SAMPLING)


def meshes_for(name):
  """(rollout mesh, train mesh) on disjoint devices."""
  rollout_shape, train_shape = RL_MESHES[name]
  devices = jax.devices()
  first = int(np.prod(rollout_shape))
  return (parallel.make_mesh(rollout_shape, devices=devices[:first]),
          parallel.make_mesh(train_shape, devices=devices[first:first + int(np.prod(train_shape))]))


def sync_program(mesh, learner):
  policy, graphdef, params, online = rl_models()
  state = rl.init_train_state(params, learner, mesh, rng=jax.random.key(0),
                              with_reference=learner.loss.beta > 0,
                              drafter_params=online.trainable)
  program = sync.build_program(
      graphdef, policy, TASK, learner, ROLLOUT, mesh, state, prompt_width=PROMPT_WIDTH,
      online=online, spec=sj.SpecConfig(num_draft_tokens=2), engine=RL_ENGINE)
  prompts = sync.prompts_on_mesh(PROMPTS.take([0, 1]), mesh)
  return program, (state, prompts, jax.device_put(jax.random.key(0), program.replicated))


# One device: the plain learner. Split heads: remat, LoRA and the KL term too.
SYNC_LEARNERS = {"one_device": LEARNER, "tensor4": HEAVY_LEARNER}


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("mesh_name", list(RL_MESHES))
def test_the_sync_rl_step_with_an_online_drafter_lowers_with_the_kernels(mesh_name, platform):
  """Speculative rollout -> rewards -> log-probs -> GRPO update (on the (1, 1, 4) mesh
  with remat, LoRA and KL) and the online draft model's loss: one program."""
  mesh, _ = meshes_for(mesh_name)
  program, args = sync_program(mesh, SYNC_LEARNERS[mesh_name])
  assert_runs_the_kernel(export(program.rl_step, args, platform), platform, mesh.size)


@pytest.fixture(scope="module")
def pipeline():
  """Rollouts on a (1, 1, 4) mesh, training on another (the sync step above covers
  one device: the same rollout and learn step, jitted together)."""
  rollout_mesh, train_mesh = meshes_for("tensor4")
  policy, graphdef, params, online = rl_models()
  state = rl.init_train_state(params, LEARNER, train_mesh, rng=jax.random.key(0),
                              drafter_params=online.trainable)
  pipe = async_pipeline.AsyncPipeline(
      graphdef, policy, TASK, LEARNER, ROLLOUT, rollout_mesh=rollout_mesh,
      train_mesh=train_mesh, state=state, prompt_width=PROMPT_WIDTH, max_policy_lag=1,
      online=online, spec=sj.SpecConfig(num_draft_tokens=2), engine=RL_ENGINE)
  pushed = pipe.push_weights(state)
  prompts = jax.device_put(PROMPTS.take([0, 1]), NamedSharding(rollout_mesh, P(BATCH_AXES)))
  rng = jax.device_put(jax.random.key(0), NamedSharding(rollout_mesh, P()))
  return pipe, state, (*pushed, prompts, rng, 0)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_async_rollout_and_train_steps_lower(platform, pipeline):
  pipe, state, rollout_args = pipeline
  rollout_exported = export(pipe.rollout_program, rollout_args, platform)
  assert_runs_the_kernel(rollout_exported, platform, pipe.rollout_mesh.size)
  trajectories = jax.eval_shape(pipe.rollout_program, *rollout_args)
  rows = NamedSharding(pipe.train_mesh, P(BATCH_AXES))
  whole = NamedSharding(pipe.train_mesh, P())
  on_train_mesh = lambda sharding: lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                   sharding=sharding)
  trajectories = jax.tree.map(on_train_mesh(whole), trajectories).replace(
      batch=jax.tree.map(on_train_mesh(rows), trajectories.batch))
  train_exported = export(pipe.train_program, (state, trajectories), platform)
  assert train_exported.platforms == (platform,)
  assert train_exported.nr_devices == pipe.train_mesh.size


# --- drafter training ----------------------------------------------------------------

@pytest.mark.parametrize("platform", PLATFORMS)
def test_offline_drafter_training_lowers(platform):
  """One AdamW step of an MTP head on a frozen target (``train_offline``'s program);
  online training is in the sync and async steps above."""
  target = sj.Transformer(small("qwen3-0.6b", num_layers=2), rngs=nnx.Rngs(0))
  drafter = sj.drafters.MTP(target, seed=1)
  graphdef, target_params = nnx.split(target)
  config = offline.DrafterTrainingConfig(num_updates=1, batch_size=2, unroll_steps=2)
  update = offline.make_update(drafter, graphdef, config)
  trainable, shared = drafter.weights["trainable"], drafter.weights["shared"]
  tokens = jnp.zeros((2, 32), jnp.int32)
  args = (trainable, jax.eval_shape(config.optimizer().init, trainable), shared, target_params,
          tokens,
          jnp.ones((2, 32), bool))
  exported = export(update, args, platform)
  assert exported.platforms == (platform,)
