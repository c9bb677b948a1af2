"""The decode loop's menu of round kinds (sampling.decode_loop.RoundMenu), compiled: a
kind's rounds run in a loop of their own that updates the page pool in place, so the
pool is copied only when the kind changes, never per round. A lax.switch between the
kinds inside every round copies the whole pool each round (XLA gives a conditional's
result a buffer apart from its operand): on the 38M pair that cost a k = 3 round 12-14%.
The check reads the compiled HLO: no loop whose iterations run a model (a dot) copies a
page-shaped buffer, counting what it calls but not its nested loops."""

import dataclasses
import functools
import re

import jax
import numpy as np
from flax import nnx

import specrl_jax as sj
from specrl_jax.sampling.rollout import rollout, widths_of
from specrl_jax.speculative import generate as engine_programs
from specrl_jax.speculative.inloop import InLoopState
from specrl_jax.speculative.inloop_hook import InLoopSpeculation
from specrl_jax.speculative.inloop_rollout import in_loop_config, in_loop_hook

PAGES = "97,2,4,8"  # [pages, kv heads, page size, head dim] of the model below
CALL = re.compile(r"(to_apply|calls|body|condition|true_computation|false_computation|"
                  r"branch_computations)=(\{[^}]*\}|%[\w.\-]+)")


def _computations(text: str) -> dict[str, list[str]]:
  comps, name = {}, None
  for line in text.splitlines():
    if line and not line.startswith(" ") and line.rstrip().endswith("{"):
      name = line.split(" ")[1] if line.startswith("ENTRY") else line.split(" ")[0]
      comps[name] = []
    elif name is not None and line.startswith(" "):
      comps[name].append(line)
  return comps


def _callees(lines: list[str]) -> list[tuple[str, str]]:
  return [(kind, name.strip()) for line in lines for kind, names in CALL.findall(line)
          for name in names.strip("{}").split(",") if name.strip()]


def loops_copying_pages_per_round(text: str, page_shape: str) -> list[str]:
  """The while loops whose every iteration runs a model and copies page-shaped buffers
  (what an iteration runs: its body and what that calls, short of nested loops)."""
  comps = _computations(text)
  bodies = {name for lines in comps.values() for kind, name in _callees(lines) if kind == "body"}
  found = []
  for body in sorted(bodies):
    seen, todo = set(), [body]
    while todo:
      name = todo.pop()
      if name not in seen:
        seen.add(name)
        todo += [callee for kind, callee in _callees(comps.get(name, []))
                 if kind not in ("body", "condition")]
    lines = [line for name in seen for line in comps.get(name, [])]
    copies = sum(bool(re.search(rf"= f32\[{page_shape}\]\S* copy\(", line)) for line in lines)
    if copies and any(" dot(" in line for line in lines):
      found.append(f"{body}: {copies} page copies")
  return found


@dataclasses.dataclass(frozen=True, kw_only=True)
class SwitchEveryRound(InLoopSpeculation):
  """The same menu run as one round function that switches between the kinds."""

  def loop(self, model, params, state, sampling):
    state, menu, on_admit = super().loop(model, params, state, sampling)
    return state, lambda s: jax.lax.switch(menu.choose(s), menu.rounds, s), on_admit


def _compiled_in_loop_rollout(hook_type) -> str:
  config = sj.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8)
  model = sj.Transformer(config, rngs=nnx.Rngs(0))
  drafter = sj.drafters.DraftModel(sj.Transformer(config.replace(num_layers=1),
                                                  rngs=nnx.Rngs(1)))
  spec = sj.SpecConfig(num_draft_tokens=2, adaptive=True)
  sampling = sj.SamplingParams(temperature=1.0, max_new_tokens=8)
  inputs, layout, bound, _, draft_mode = engine_programs.prepare(
      config, [[1, 2, 3], [4, 5]], sampling, sj.EngineConfig(num_pages=97, page_size=4),
      drafter, spec)
  hook = in_loop_hook(bound, spec, draft_mode, widths_of(layout))
  hook = hook_type(**{f.name: getattr(hook, f.name) for f in dataclasses.fields(hook)})
  controller = InLoopState.initial(in_loop_config(spec),
                                   np.ones((3, len(hook.widths)), np.float32))
  graphdef, params = nnx.split(model)
  program = jax.jit(functools.partial(rollout, graphdef, sampling=sampling, layout=layout,
                                      rounds=hook))
  return program.lower(params, (bound.params(), controller), *inputs,
                       jax.random.key(0)).compile().as_text()


def test_a_menus_rounds_update_the_page_pool_in_place_and_a_switch_per_round_would_not():
  menu = _compiled_in_loop_rollout(InLoopSpeculation)
  assert re.search(rf"f32\[{PAGES}\]", menu)  # the page arrays are where we look
  assert loops_copying_pages_per_round(menu, PAGES) == []
  assert loops_copying_pages_per_round(_compiled_in_loop_rollout(SwitchEveryRound), PAGES)
