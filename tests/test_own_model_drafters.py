"""Every drafter kind of `specrl train` on one's own model: the tiny Qwen3, BPE tokenizer
with a chat template and JSONL of tests/test_own_model.py.

Each kind runs 3 GRPO steps through the command (pretrained weights through
``--drafter.path`` where the kind reads them: a draft model sharing the policy's
tokenizer, a SpecForge EAGLE-3 checkpoint); a draft model of another vocabulary or
tokenizer is refused before anything compiles; the registry builds what each section
asks for (history fallbacks, saved heads, the untrained-draft-model warning).
"""

import json

import jax
import numpy as np
import pytest
import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers, trainers

import specrl_jax as sj
from specrl_jax import cli
from specrl_jax.compile_cache import CompileCounter
from specrl_jax.config import ConfigError
from specrl_jax.rl.app import drafter_registry, train_command
from specrl_jax.rl.app.metrics import read_jsonl
from specrl_jax.rl.loop.drafter_memory import RolloutMemory
from specrl_jax.sim import DRAFTER_SPECS
from specrl_jax.speculative.drafters import save_drafter, save_specforge
from specrl_jax.speculative.drafters.history_store import HistoryConfig, HistoryStore

from test_own_model import SPECIALS, _train_argv, workspace  # noqa: F401  (the fixture)


@pytest.fixture(scope="module")
def drafter_folders(workspace):  # noqa: F811
  """A pretrained draft model sharing the policy's tokenizer, one of another vocabulary
  size, one of the same size with another tokenizer, and a SpecForge EAGLE-3 head."""
  root, hf_tokenizer = workspace["root"], workspace["hf_tokenizer"]
  policy_config = transformers.AutoConfig.from_pretrained(workspace["model"])
  small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, head_dim=8,
               tie_word_embeddings=False, max_position_embeddings=256)
  folders = {}
  for name, vocab_size in (("draft", policy_config.vocab_size),
                           ("wide_draft", policy_config.vocab_size + 10),
                           ("other_tokenizer", policy_config.vocab_size)):
    folder = root / name
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(vocab_size=vocab_size, **small)
                                  ).save_pretrained(folder)
    folders[name] = str(folder)
  hf_tokenizer.save_pretrained(folders["draft"])
  hf_tokenizer.save_pretrained(folders["wide_draft"])
  other = tokenizers.Tokenizer(models.BPE(unk_token=None))
  other.pre_tokenizer, other.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
  other.train_from_iterator(["entirely different words here"] * 4,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=SPECIALS))
  transformers.PreTrainedTokenizerFast(tokenizer_object=other, eos_token="<|im_end|>"
                                       ).save_pretrained(folders["other_tokenizer"])
  policy = sj.load_hf(workspace["model"])
  folders["eagle3"] = str(root / "eagle3_head")
  save_specforge(sj.drafters.Eagle3(policy, seed=3), folders["eagle3"])
  return folders


def _compilations(run) -> int:
  """How many programs ``run()`` builds (compiled, or loaded from a persistent cache)."""
  with CompileCounter() as counter:
    run()
  return counter.built


# kind, extra flags (a callable of the folders), whether it trains online.
RUNS = {
    "ngram": (lambda f: [], False),
    "history": (lambda f: [], False),
    "draft_model": (lambda f: [f"--drafter.path={f['draft']}", "--drafter.online=true"], True),
    "eagle3": (lambda f: [f"--drafter.path={f['eagle3']}"], True),
    "mtp": (lambda f: [], True),
}


@pytest.mark.parametrize("kind", sorted(RUNS))
def test_each_drafter_kind_runs_three_steps_through_specrl_train(
    kind, workspace, drafter_folders, capsys):  # noqa: F811
  flags, online = RUNS[kind]
  run = workspace["root"] / f"run_{kind}"
  argv = _train_argv(workspace, 3) + [f"--drafter.kind={kind}", f"--output.directory={run}",
                                      "--output.checkpoint_every=0", "--data.eval_every=0",
                                      "--drafter.history.rollout_tokens=48",
                                      "--drafter.history.max_match=8"]
  assert cli.main(argv + flags(drafter_folders)) == 0, capsys.readouterr().err
  records = read_jsonl(run / "metrics.jsonl")
  assert [r["step"] for r in records] == [0, 1, 2]
  recorded = json.loads((run / "config.json").read_text())["drafter"]
  assert recorded["kind"] == kind
  for record in records:
    # Speculative rounds ran: one acceptance rate per drafted position.
    assert len(record["per_position_acceptance"]) == 3
    assert record["acceptance_length"] >= 1 and np.isfinite(record["loss"])
    assert ("drafter/grad_norm" in record) == online
    if online:
      assert np.isfinite(record["drafter/grad_norm"])


@pytest.mark.parametrize("folder,named", [
    ("wide_draft", "vocab_size="), ("other_tokenizer", "is not the tokenizer of")])
def test_a_mismatched_draft_model_is_refused_before_anything_compiles(
    folder, named, workspace, drafter_folders, capsys):  # noqa: F811
  argv = _train_argv(workspace, 3) + [
      "--drafter.kind=draft_model", f"--drafter.path={drafter_folders[folder]}",
      f"--output.directory={workspace['root'] / ('refused_' + folder)}"]
  codes = []
  assert _compilations(lambda: codes.append(cli.main(argv))) == 0
  assert codes == [1]
  error = capsys.readouterr().err
  assert named in error and drafter_folders[folder] in error and workspace["model"] in error


def _config(workspace, *flags):  # noqa: F811
  return train_command.parse_argv(_train_argv(workspace, 3)[1:] + list(flags))


def test_the_registry_builds_history_with_a_learned_fallback_that_trains_online(workspace):  # noqa: F811
  config = _config(workspace, "--drafter.kind=history", "--drafter.fallback=mtp")
  policy = sj.load_hf(workspace["model"])
  sampling = sj.SamplingParams(temperature=1.0, max_new_tokens=4)
  drafter, online = drafter_registry.build_drafter(config, policy, None, sampling=sampling)
  assert isinstance(drafter, sj.drafters.History)
  assert isinstance(drafter.fallback, sj.drafters.MTP)
  assert online.drafter is drafter
  assert jax.tree.structure(online.trainable) == jax.tree.structure(drafter.fallback.weights)
  params = online.rollout_params(online.trainable)
  assert set(params) == {"bank", "fallback"}


def test_a_saved_mtp_head_is_loaded_from_drafter_path(workspace, tmp_path):  # noqa: F811
  policy = sj.load_hf(workspace["model"])
  saved = sj.drafters.MTP(policy, seed=7)
  save_drafter(tmp_path / "mtp", saved)
  config = _config(workspace, "--drafter.kind=mtp", f"--drafter.path={tmp_path / 'mtp'}")
  drafter_registry.check_files(config)
  sampling = sj.SamplingParams(temperature=1.0, max_new_tokens=4)
  drafter, _ = drafter_registry.build_drafter(config, policy, None, sampling=sampling)
  same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), drafter.weights, saved.weights)
  assert all(jax.tree.leaves(same))
  # An EAGLE-3 kind refuses it, naming what the folder holds.
  with pytest.raises(ConfigError, match="holds a MTP head"):
    drafter_registry.check_files(_config(workspace, "--drafter.kind=eagle3",
                                         f"--drafter.path={tmp_path / 'mtp'}"))


def test_an_untrained_draft_model_is_refused_or_warned_about_never_silent(workspace):  # noqa: F811
  with pytest.raises(ConfigError, match="untrained network"):
    _config(workspace, "--drafter.kind=draft_model", "--drafter.online=false")
  config = _config(workspace, "--drafter.kind=draft_model")  # online, no distillation
  policy = sj.load_hf(workspace["model"])
  draft = drafter_registry.draft_network(config, policy.config.vocab_size)
  lines = []
  drafter, online = drafter_registry.build_drafter(
      config, policy, draft, sampling=sj.SamplingParams(max_new_tokens=4), log=lines.append)
  assert online is not None and any("starts untrained" in line for line in lines)
  with pytest.raises(ConfigError, match="worked solutions"):
    _config(workspace, "--drafter.kind=draft_model", "--warm_start.distill_steps=5")


def test_registry_options_are_checked_with_the_field_and_what_is_allowed(workspace):  # noqa: F811
  for flags, message in (
      (["--drafter.kind=medusa"], "expected one of"),
      (["--drafter.kind=ngram", "--drafter.path=/x"], "it reads no pretrained weights"),
      (["--drafter.kind=ngram", "--drafter.fallback=mtp"], "'none' unless kind='history'"),
      (["--drafter.kind=history", "--drafter.fallback=history"], "DrafterSection.fallback"),
      (["--drafter.model.path=/x"], "--drafter.path=HF_FOLDER")):
    with pytest.raises(ConfigError, match=message):
      _config(workspace, *flags)


def test_every_registered_kind_names_a_simulator_spec_or_none():
  for kind in drafter_registry.DRAFTERS.values():
    assert kind.simulator is None or kind.simulator in DRAFTER_SPECS
  assert drafter_registry.DRAFTERS["none"].simulator is None


def test_the_memory_remembers_each_rows_response_after_its_prompt():
  store = HistoryStore(HistoryConfig(max_prompts=4, rollouts_per_prompt=2, rollout_tokens=16,
                                     max_match=4))
  prompts_PxT = np.array([[5, 6, 7, 0], [8, 9, 0, 0]], np.int32)
  lengths_P = np.array([3, 2], np.int32)
  # Rows: prompt then response then padding, two samples per prompt.
  tokens_RxC = np.array([[5, 6, 7, 1, 2, 0], [5, 6, 7, 3, 0, 0],
                         [8, 9, 4, 4, 4, 0], [8, 9, 2, 0, 0, 0]], np.int32)
  lengths_R = np.array([2, 1, 3, 1], np.int32)
  RolloutMemory(store=store).observe(prompts_PxT, lengths_P, tokens_RxC, lengths_R, 2)
  assert store.responses([5, 6, 7]) == [[1, 2], [3]]
  assert store.responses([8, 9]) == [[4, 4, 4], [2]]


def test_the_simulator_costs_every_registered_kind_by_name():
  from specrl_jax.sim import drafter_spec, get_model
  target = get_model("qwen3-8b")
  for kind in drafter_registry.DRAFTERS.values():
    if kind.simulator is not None:
      option = ":qwen3-0.6b" if kind.simulator == "draft_model" else ""
      assert drafter_spec(kind.simulator + option, target).kind == kind.simulator
  assert drafter_spec("draft:qwen3-0.6b", target).kind == "draft_model"  # the older spelling
  assert drafter_spec("history", target).step_network is None
  with pytest.raises(ConfigError, match="one of"):
    drafter_spec("medusa", target)
