"""The in-loop controller's rollout: the decode program with ``InLoopSpeculation`` as
its round hook, for callers that compile it into a larger step (the RL rollout)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from specrl_jax.config import SamplingParams, SpecConfig
from specrl_jax.models.transformer import Transformer
from specrl_jax.sampling import rollout as engine
from specrl_jax.sampling.engine import DecodeState, EngineConfig
from specrl_jax.sampling.generate import decode
from specrl_jax.sampling.inputs import check_arguments
from specrl_jax.sampling.layout import Layout
from specrl_jax.sampling.results import GenerateOutput
from specrl_jax.sampling.rollout import generate_whole, widths_of
from specrl_jax.speculative.drafters.base import Drafter
from specrl_jax.speculative.inloop import InLoopConfig, InLoopState
from specrl_jax.speculative.inloop_hook import InLoopSpeculation
from specrl_jax.speculative.rollout import rounds_of, speculation


def in_loop_config(spec: SpecConfig) -> InLoopConfig:
  """The in-loop menu of an adaptive spec: plain, chains 1..num_draft_tokens and its
  ``adaptive_trees``."""
  return InLoopConfig(k_max=spec.num_draft_tokens, trees=tuple(spec.adaptive_trees))


def in_loop_hook(drafter: Drafter | None, spec: SpecConfig | None, draft_mode: str | None,
                 widths: tuple[int, ...]) -> InLoopSpeculation | None:
  """The round hook of an adaptive spec (None unless ``spec.adaptive``)."""
  if drafter is None or spec is None or not spec.adaptive:
    return None
  return InLoopSpeculation(drafter=drafter, config=in_loop_config(spec),
                           draft_mode=draft_mode, widths=widths)


def in_loop_rollout(graphdef, params, hook_params: tuple, tokens_UxT, lengths_U,
                    prompt_of_request_R, last_request_U, rng, *, sampling: SamplingParams,
                    layout: Layout, hook: InLoopSpeculation
                    ) -> tuple[DecodeState, InLoopState]:
  """The whole rollout (prefill + every stage), traceable. hook_params: (drafter
  params, the carried InLoopState). Returns the final state (its ``drafter`` the
  drafter's own) and the controller's state after it (not faded: see
  ``inloop.fade``)."""
  final = engine.rollout(graphdef, params, hook_params, tokens_UxT, lengths_U,
                         prompt_of_request_R, last_request_U, rng, sampling=sampling,
                         layout=layout, rounds=hook)
  drafter_state, controller = final.drafter
  return final.replace(drafter=drafter_state), controller


def generate_in_loop(model: Transformer, prompts: Sequence[Sequence[int]], *,
                     sampling: SamplingParams, rng: jax.Array, drafter: Drafter,
                     spec: SpecConfig, controller: InLoopState,
                     engine: EngineConfig = EngineConfig()
                     ) -> tuple[GenerateOutput, InLoopState]:
  """``sj.generate`` with the in-loop controller (one device): the output (with
  ``stats["compaction"]`` timing each width's program when the engine compacts) and
  the controller's state after it (not faded). Calibration times each shape with it
  (``InLoopState.force``)."""
  prompts, rng = check_arguments(model.config, prompts, sampling=sampling, rng=rng,
                                 drafter=drafter, spec=spec)
  if not spec.adaptive:
    raise ValueError("generate_in_loop needs SpecConfig(adaptive=True, ...): the in-loop "
                     "controller chooses among its chains and adaptive_trees.")
  # Device arrays whatever the caller carries (the state handed back is host data):
  # compiled programs are kept per argument placement, and host arrays would compile
  # every width's program a second time.
  controller = jax.tree.map(jnp.asarray, controller)
  bound, _, draft_mode = speculation(model.config, sampling, drafter, spec)
  longest = rounds_of(*speculation(model.config, sampling, drafter, spec))
  after = {}

  def decode_fn(graphdef, params, hook_params, inputs, rng, layout, placement):
    hook = in_loop_hook(bound, spec, draft_mode, widths_of(layout))
    if controller.cost_SxW.shape[1] != len(hook.widths):
      raise ValueError(f"controller.cost_SxW has {controller.cost_SxW.shape[1]} widths; this "
                       f"rollout decodes in {len(hook.widths)}: {hook.widths}.")
    output = generate_whole(graphdef, params, inputs, rng, sampling=sampling, layout=layout,
                            rounds=hook, hook_params=(hook_params, controller))
    after["controller"] = output.stats.pop("controller")
    return output

  output = decode(model, prompts, rng, sampling=sampling, engine=engine, mesh=None,
                  rounds=longest, decode_fn=decode_fn)
  return output, after["controller"]
