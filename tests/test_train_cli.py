"""`specrl train`'s command line: --print-config, a --help generated from the config
dataclasses, --model with a space, and the plan a run prints before it starts."""

import json

import jax
import pytest
from flax import nnx

import specrl_jax as sj
from specrl_jax.config import ConfigError
from specrl_jax.rl.app import config_help, experiment, run_plan, train_argv, train_command
from specrl_jax.rl.app.overrides import to_dict


def test_print_config_prints_the_resolved_config_as_json_and_exits(tmp_path, capsys):
  directory = tmp_path / "never"
  assert train_command.main(["--preset=tiny", "--rl.steps=7", "--print-config",
                             f"--output.directory={directory}"]) == 0
  printed = json.loads(capsys.readouterr().out)
  assert printed["rl"]["steps"] == 7
  assert printed == json.loads(json.dumps(to_dict(experiment.experiment_config(
      "tiny", ["--rl.steps=7", f"--output.directory={directory}"]))))
  assert not directory.exists()  # nothing ran


@pytest.mark.parametrize("preset", sorted(experiment.PRESETS))
def test_help_lists_every_field_with_its_type_default_and_doc(preset):
  config = experiment.PRESETS[preset]
  text = config_help.help_text(config)
  fields = [item for _, item in config_help.walk(config) if item is not None]
  assert len(fields) > 100
  for item in fields:
    assert f"  {item.flag}: {item.type} = {item.default}\n" in text + "\n", item.flag
  # DrafterSection's fields (and its history section) belong to the drafter registry.
  drafter_own = lambda flag: flag.startswith("--drafter.") and not flag.startswith(
      "--drafter.model.")
  undocumented = [i.flag for i in fields if not i.doc and not drafter_own(i.flag)]
  assert undocumented == []
  assert f"--rl.steps: int = {config.rl.steps}" in text
  assert "[learner.loss] GRPOConfig" in text


def test_help_shows_the_defaults_of_the_command_line_it_is_given(capsys):
  assert train_command.main(["--preset=dataset", "--rl.steps=3", "--help"]) == 0
  out = capsys.readouterr().out
  assert "--rl.steps: int = 3\n" in out
  assert "--learner.learning_rate: float = 1e-06\n" in out


def test_model_with_a_space_is_the_same_as_with_an_equals_sign():
  spaced = train_argv.parse_argv(["--model", "some/folder", "--dataset", "rows.jsonl",
                                  "--reward", "exact_match"])
  equals = train_argv.parse_argv(["--model=some/folder", "--dataset=rows.jsonl",
                                  "--reward=exact_match"])
  assert spaced == equals
  assert spaced.policy.path == "some/folder" and spaced.data.path == "rows.jsonl"


@pytest.mark.parametrize("argv", [["--model"], ["--model", "--dataset=rows.jsonl"]])
def test_a_short_flag_without_its_value_is_refused_naming_it(argv):
  with pytest.raises(ConfigError, match="--model needs a value"):
    train_argv.parse_argv(argv)


def test_the_plan_shows_what_the_dataset_preset_sets_silently():
  lines = run_plan.plan_lines(
      experiment.PRESETS["dataset"], vocab_size=60, reward="exact_match", devices=1,
      rows=run_plan.DataRows(source="dataset rows.jsonl", train=90, held_out=10),
      max_new_tokens=256)
  text = "\n".join(lines)
  for expected in ("rate 1e-06", "100 GRPO steps", "at most 256 new tokens",
                   "90 rows to train on, 10 held out", "reward:   exact_match",
                   "drafter:  history", "output:   runs/dataset", "vocabulary 60"):
    assert expected in text, expected


def test_a_session_plans_its_model_data_drafter_and_mesh(tmp_path):
  config = experiment.experiment_config("tiny", [f"--output.directory={tmp_path}"])
  lines = train_command.Session(config, log=lambda _: None).plan()
  text = "\n".join(lines)
  model = sj.Transformer(config.policy.model_config(), rngs=nnx.Rngs(0))
  count = sum(leaf.size for leaf in jax.tree.leaves(nnx.state(model)))
  assert run_plan.parameter_count(config.policy.model_config()) == count
  assert "task arithmetic: 64 rows to train on, none held out" in text
  assert "draft_model: a fresh 1-layer 32-wide model" in text
  assert "distilled from the policy for 10 steps, trained online" in text
  assert f"(data, fsdp, tensor) = (1, 1, 1): 1 of {jax.device_count()} cpu devices" in text
  assert f"output:   {tmp_path}" in text
