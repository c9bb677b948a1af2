"""Datasets read from disk, reward functions named on the command line, pass@k, and
the tokenizer folder's refusals."""

import itertools
import json
import math

import numpy as np
import pytest

from specrl_jax.config import ConfigError
from specrl_jax.models import tokenizer as builtin
from specrl_jax.models.text_tokenizer import TextTokenizer, TokenizerFormatError
from specrl_jax.rl.app.data_section import DataSection
from specrl_jax.rl.loop.evaluation import pass_at_k
from specrl_jax.rl.tasks import (
    DatasetError, DatasetTask, RewardFunctionError, raise_pending_errors, read_records,
    resolve_reward, split_records,
)
from specrl_jax.rl.tasks.rewards import exact_match, final_answer, format_reward, math_verify

ROWS = [{"prompt": f"what is {i}+{i}?", "answer": 2 * i, "topic": "sums"} for i in range(10)]


# ------------------------------------------------------------------ datasets

def test_jsonl_parquet_and_save_to_disk_folders_read_the_same_rows(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  jsonl = tmp_path / "rows.jsonl"
  jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
  pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "rows.parquet")
  datasets = pytest.importorskip("datasets")
  datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "folder"))
  for path in (jsonl, tmp_path / "rows.parquet", tmp_path / "folder"):
    assert read_records(path, required=["prompt", "answer"]) == ROWS


def test_unreadable_datasets_are_clear_errors(tmp_path):
  with pytest.raises(DatasetError, match="does not exist"):
    read_records(tmp_path / "missing.jsonl")
  (tmp_path / "rows.csv").write_text("a,b\n")
  with pytest.raises(DatasetError, match="unknown format"):
    read_records(tmp_path / "rows.csv")
  (tmp_path / "rows.jsonl").write_text('{"question": "x", "answer": 1}\n')
  with pytest.raises(DatasetError, match=r"no column 'prompt'.*\['question', 'answer'\]"):
    read_records(tmp_path / "rows.jsonl", required=["prompt"])
  datasets = pytest.importorskip("datasets")
  datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(
      str(tmp_path / "dict"))
  with pytest.raises(DatasetError, match=r"DatasetDict with splits \['train'\]"):
    read_records(tmp_path / "dict")


def test_the_held_out_split_is_a_seeded_fraction_apart_from_training():
  train, held = split_records(ROWS, eval_fraction=0.2, seed=3)
  assert len(held) == 2 and len(train) == 8
  assert sorted(r["answer"] for r in train + held) == [r["answer"] for r in ROWS]
  assert split_records(ROWS, eval_fraction=0.2, seed=3) == (train, held)
  assert split_records(ROWS, eval_fraction=0.2, seed=4)[1] != held
  with pytest.raises(DatasetError, match="holds out all"):
    split_records(ROWS[:1], eval_fraction=0.5, seed=0)


def test_data_section_checks_its_fields():
  with pytest.raises(ConfigError, match="DataSection.eval_every=5 is invalid"):
    DataSection(path="x.jsonl", eval_every=5)
  with pytest.raises(ConfigError, match="DataSection.eval_fraction=1.0 is invalid"):
    DataSection(eval_fraction=1.0)
  with pytest.raises(ConfigError, match="DataSection.eval_fraction=0.1 is invalid"):
    DataSection(eval_path="held.jsonl", eval_fraction=0.1)


# ------------------------------------------------------------------ rewards

def test_builtin_rewards():
  assert final_answer("so\n#### 42") == "42"
  assert final_answer(r"thus \boxed{7}. done") == "7"
  assert final_answer("<think>1</think><answer> 9 </answer>") == "9"
  assert exact_match("", "The sum:\n#### Forty two.", "forty TWO") == 1.0
  assert exact_match("", "41", 42) == 0.0
  assert format_reward("", "<think>a</think>\n<answer>b</answer>", None) == 1.0
  assert format_reward("", "<answer>b</answer>", None) == 0.0
  assert math_verify("", r"so the answer is $\boxed{\frac{1}{2}}$", "0.5") == 1.0
  assert math_verify("", r"$\boxed{3}$", "0.5") == 0.0


def test_reward_names_resolve_to_builtins_modules_and_files(tmp_path):
  assert resolve_reward("exact_match") == (exact_match, "exact_match")
  fn, name = resolve_reward("math:sqrt")
  assert fn is math.sqrt and name == "math:sqrt"
  (tmp_path / "mine.py").write_text("def score(prompt, completion, answer):\n  return 0.5\n")
  fn, _ = resolve_reward(f"{tmp_path / 'mine.py'}:score")
  assert fn("p", "c", 1) == 0.5
  for spec, message in (("nope", "expected one of"), ("no_such_module_x:f", "cannot be imported"),
                        ("math:no_such", "has no function 'no_such'"),
                        (f"{tmp_path / 'absent.py'}:f", "is not a Python file")):
    with pytest.raises(ConfigError, match=message):
      resolve_reward(spec)


def _task(fn, **options):
  return DatasetTask(records=tuple(ROWS), text_tokenizer=builtin.text_tokenizer(), reward_fn=fn,
                     reward_name="user:fn", **options)


def _score_batch(task, texts):
  ids = [builtin.encode(t) + [builtin.EOS_ID] for t in texts]
  width = max(map(len, ids))
  tokens = np.full((len(ids), width), -1, np.int32)
  for row, sample in enumerate(ids):
    tokens[row, :len(sample)] = sample
  targets = {"index": np.arange(len(ids), dtype=np.int32)}
  return np.asarray(task.reward(targets, tokens, np.asarray([len(i) for i in ids], np.int32)))


def test_a_dataset_reward_gets_prompt_completion_answer_and_the_other_columns():
  seen = []

  def fn(prompt, completion, answer, topic):  # no **fields: only the columns it names
    seen.append((prompt, completion, answer, topic))
    return float(completion == str(answer))

  rewards = _score_batch(_task(fn), ["0", "3", "4"])
  np.testing.assert_array_equal(rewards, [1.0, 0.0, 1.0])
  assert sorted(seen) == [("what is 0+0?", "0", 0, "sums"), ("what is 1+1?", "3", 2, "sums"),
                          ("what is 2+2?", "4", 4, "sums")]


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_reward_is_refused_naming_the_sample_and_the_function(value):
  fn = lambda prompt, completion, answer, **fields: value if completion == "bad" else 1.0
  rewards = _score_batch(_task(fn), ["ok", "bad"])
  assert np.isnan(rewards).all()  # the batch is not trained on
  with pytest.raises(RewardFunctionError,
                     match=rf"user:fn returned float {value}, not a finite real number.*sample 1"):
    raise_pending_errors()


def test_a_reward_past_its_timeout_is_reported_and_the_others_run_concurrently():
  import time
  fn = lambda prompt, completion, answer, **fields: time.sleep(0.3) or 1.0
  started = time.perf_counter()
  np.testing.assert_array_equal(_score_batch(_task(fn, threads=4), ["1"] * 4), [1.0] * 4)
  assert time.perf_counter() - started < 1.0  # four 0.3 s calls at once, not one by one
  slow = lambda prompt, completion, answer, **fields: time.sleep(5) if completion == "2" else 1.0
  _score_batch(_task(slow, timeout=0.2), ["1", "2"])
  with pytest.raises(RewardFunctionError, match="user:fn did not return within 0.2 s.*sample 1"):
    raise_pending_errors()


# ------------------------------------------------------------------ pass@k

def test_pass_at_k_is_the_chance_that_one_of_k_draws_without_replacement_is_correct():
  for n, c in [(4, 0), (4, 1), (5, 2), (6, 6)]:
    outcomes = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
      draws = list(itertools.combinations(outcomes, k))
      assert math.isclose(pass_at_k(n, c, k), sum(map(any, draws)) / len(draws))


# ------------------------------------------------------------------ tokenizer folders

def test_tokenizer_folders_are_checked(tmp_path):
  with pytest.raises(TokenizerFormatError, match="has no tokenizer.json"):
    TextTokenizer.from_pretrained(tmp_path)
  builtin.text_tokenizer().save(tmp_path)
  loaded = TextTokenizer.from_pretrained(tmp_path)
  assert (loaded.bos_id, loaded.eos_ids, loaded.pad_id) == (1, (2,), 0)
  # No chat template: plain text with BOS first, as the built-in encoding has it.
  assert loaded.encode_prompt("12+3=") == builtin.encode("12+3=", add_bos=True)
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<end>"}))
  with pytest.raises(TokenizerFormatError, match=r"eos_token='<end>' is not a token"):
    TextTokenizer.from_pretrained(tmp_path)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {**config, "chat_template": "{% for m in messages %}"}))
  with pytest.raises(TokenizerFormatError, match="chat template does not parse"):
    TextTokenizer.from_pretrained(tmp_path).encode_prompt("1")
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 999]}))
  with pytest.raises(TokenizerFormatError, match="eos_token_id 999 is invalid"):
    TextTokenizer.from_pretrained(tmp_path)


def test_a_builtin_vocabulary_task_refuses_another_tokenizer(tmp_path):
  from specrl_jax.rl.tasks import Arithmetic
  other = TextTokenizer(tokenizer=builtin.builtin_tokenizer(), eos_ids=(1,), source="other")
  with pytest.raises(ConfigError, match="task 'arithmetic' encodes with the built-in vocabulary"):
    Arithmetic().check_tokenizer(other)
  Arithmetic().check_tokenizer(builtin.text_tokenizer())


def test_the_builtin_vocabulary_saves_as_a_folder_transformers_encodes_alike(tmp_path):
  transformers = pytest.importorskip("transformers")
  builtin.text_tokenizer().save(tmp_path)
  hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
  assert hf("12+3=")["input_ids"] == builtin.encode("12+3=", add_bos=True)
  assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (1, 2, 0)


def test_a_run_recorded_before_the_data_fields_existed_still_resumes(tmp_path):
  import dataclasses

  from specrl_jax.rl.app import run_directory
  from specrl_jax.rl.app.experiment import ExperimentConfig, to_dict
  old = to_dict(ExperimentConfig())
  del old["data"], old["policy"]["path"]
  run_directory.write_json(str(tmp_path / run_directory.CONFIG), old)
  defaults = to_dict(ExperimentConfig())
  run_directory.check_resumable(str(tmp_path), [3], to_dict(ExperimentConfig()), defaults)
  changed = dataclasses.replace(ExperimentConfig(), data=DataSection(path="rows.jsonl"))
  with pytest.raises(ConfigError, match=r"data.path: '' -> 'rows.jsonl'"):
    run_directory.check_resumable(str(tmp_path), [3], to_dict(changed), defaults)


def test_decoding_stops_at_eos_and_skips_ids_past_the_tokenizers_vocabulary():
  tok = builtin.text_tokenizer()
  ids = builtin.encode("12") + [builtin.VOCAB_SIZE + 5] + builtin.encode("3")
  assert tok.decode(ids + [builtin.EOS_ID] + builtin.encode("9")) == "123"
  assert tok.decode(ids + [-1, 4]) == "123"


def test_a_model_folder_whose_tokenizer_outgrows_its_embeddings_is_refused(tmp_path):
  from specrl_jax.rl.app import run_data
  from specrl_jax.rl.app.experiment import experiment_config
  builtin.text_tokenizer().save(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10}))
  config = experiment_config("dataset", [f"--policy.path={tmp_path}"])
  with pytest.raises(ConfigError, match=r"has 60 tokens but .*vocab_size=10"):
    run_data.policy_tokenizer(config)


def test_sft_examples_are_the_templated_prompt_then_solution_and_eos():
  from specrl_jax.rl.loop.sft import sft_examples
  from specrl_jax.rl.tasks import Problem
  tok = TextTokenizer(tokenizer=builtin.builtin_tokenizer(), eos_ids=(builtin.EOS_ID,),
                      chat_template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}="
                                    "{% endfor %}",
                      special_tokens={"bos_token": "<bos>"}, pad_id=builtin.PAD_ID)
  tokens, mask = sft_examples([Problem(prompt="1+2", solution="3", targets={})], 8, tok)
  expected = builtin.encode("1+2=3", add_bos=True) + [builtin.EOS_ID, builtin.PAD_ID]
  assert tokens[0].tolist() == expected
  assert mask[0].tolist() == [False] * 5 + [True, True, False]


def test_samples_go_to_the_jsonl_and_tensorboard_as_text(tmp_path):
  import os

  from specrl_jax.rl.app.metrics import MetricsWriter, read_jsonl
  sample = {"prompt": "what is 2+2?", "completion": "four-ish 4", "reward": 1.0}
  with MetricsWriter(tmp_path) as writer:
    writer.write(0, {"reward_mean": 1.0, "samples": [sample],
                     "data": {"epoch": 0, "rows": [3, 1]}})
  assert read_jsonl(tmp_path / "metrics.jsonl") == [
      {"step": 0, "reward_mean": 1.0, "samples": [sample], "data": {"epoch": 0, "rows": [3, 1]}}]
  folder = tmp_path / "tensorboard"
  events = b"".join((folder / name).read_bytes() for name in os.listdir(folder))
  assert b"four-ish 4" in events and b"samples/0" in events


def test_a_builtin_vocabulary_policy_saved_as_a_folder_trains_on_the_builtin_tasks(tmp_path):
  from flax import nnx

  import specrl_jax as sj
  from specrl_jax.rl.app import train_command
  model = sj.Transformer(sj.ModelConfig(vocab_size=builtin.VOCAB_SIZE, hidden_size=16,
                                        intermediate_size=32, num_layers=1, num_heads=2,
                                        num_kv_heads=1, head_dim=8), rngs=nnx.Rngs(0))
  sj.save_hf(model, tmp_path, tokenizer=builtin.text_tokenizer())
  config = train_command.parse_argv(["--preset=tiny", f"--policy.path={tmp_path}",
                                     "--drafter.kind=none"])
  session = train_command.Session(config, log=lambda message: None)
  assert session.text_tokenizer.eos_ids == (builtin.EOS_ID,)
  assert session.prompt_set.prompts[0] == builtin.encode(
      session.prompt_set.problems[0].prompt, add_bos=True)
  config = json.loads((tmp_path / "config.json").read_text())
  assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)


def test_a_row_without_prompt_text_is_a_clear_error():
  rows = ROWS[:2] + [{"prompt": None, "answer": 1, "topic": "sums"}]
  task = DatasetTask(records=tuple(rows), text_tokenizer=builtin.text_tokenizer(),
                     reward_fn=exact_match)
  with pytest.raises(DatasetError, match=r"row 2: column 'prompt' holds NoneType None"):
    task.problems()
  with pytest.raises(DatasetError, match=r"answer_field='solution' is not a column.*'topic'"):
    DatasetTask(records=tuple(ROWS), text_tokenizer=builtin.text_tokenizer(),
                reward_fn=exact_match, answer_field="solution")


def test_a_conversational_prompt_column_is_rendered_as_its_messages():
  tok = TextTokenizer(tokenizer=builtin.builtin_tokenizer(), eos_ids=(builtin.EOS_ID,),
                      chat_template="{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};"
                                    "{% endfor %}{% if add_generation_prompt %}a:{% endif %}",
                      pad_id=builtin.PAD_ID)
  conversation = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"},
                  {"role": "user", "content": "2+2"}]
  seen = []
  task = DatasetTask(records=({"prompt": conversation, "answer": 4},), text_tokenizer=tok,
                     reward_fn=lambda prompt, completion, answer: seen.append(prompt) or 1.0,
                     system_prompt="be brief")
  problem = task.problem(0)
  assert problem.prompt == "2+2"
  assert problem.prompt_ids(tok) == builtin.encode("s:be brief;u:1+1;a:2;u:2+2;a:")
  assert task.score("4", {"index": 0}) == 1.0 and seen == [conversation]
