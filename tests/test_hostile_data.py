"""Datasets, rewards and tokenizer folders under careless and hostile use (issue 36,
the data half): every unusable row reported before training, answers kept as their
type, rows immutable to reward code, reward values checked, rewards in worker
processes, unreadable files named, chat templates chosen as transformers chooses
them, logged samples in sample order. No JAX compilation: every check here happens
before a step compiles (two cases run `specrl train` to its one-line error)."""

import json
import math
import time
from fractions import Fraction

import numpy as np
import pytest

import hostile_rewards
from specrl_jax import cli
from specrl_jax.config import ConfigError
from specrl_jax.models import tokenizer as builtin
from specrl_jax.models.text_tokenizer import TextTokenizer, TokenizerFormatError
from specrl_jax.rl.app import run_data
from specrl_jax.rl.app.data_section import DataSection
from specrl_jax.rl.app.experiment import experiment_config
from specrl_jax.rl.tasks import (DatasetError, DatasetTask, RewardFunctionError,
                                 raise_pending_errors, read_records, resolve_reward)
from specrl_jax.rl.tasks.dataset import split_indices
from specrl_jax.rl.tasks.python_reward import take_failures
from specrl_jax.rl.tasks.row_checks import BadRowsError
from specrl_jax.rl.tasks.rewards import exact_match, math_verify

TOKENIZER = builtin.text_tokenizer()


def _rows(count=8):
  return [{"prompt": f"what is {i}+{i}?", "answer": 2 * i} for i in range(count)]


def _write(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def _section(path, **fields):
  return DataSection(path=path, max_prompt_tokens=fields.pop("max_prompt_tokens", 32), **fields)


def _task(rows, fn, **options):
  return DatasetTask(records=tuple(rows), text_tokenizer=TOKENIZER, reward_fn=fn,
                     reward_name="user:fn", **options)


def _batch(texts, rows=None):
  """(targets, tokens, lengths) of completions ``texts`` to rows ``rows`` (default 0..)."""
  ids = [builtin.encode(t) + [builtin.EOS_ID] for t in texts]
  tokens = np.full((len(ids), max(map(len, ids))), -1, np.int32)
  for row, sample in enumerate(ids):
    tokens[row, :len(sample)] = sample
  rows = list(range(len(texts))) if rows is None else rows
  return ({"index": np.asarray(rows, np.int32)}, tokens,
          np.asarray([len(i) for i in ids], np.int32))


def _host_rewards(task, texts, rows=None):
  return np.asarray(task._host(*_batch(texts, rows)))


# ------------------------------------------------------------------ unusable rows

def _hostile_rows():
  rows = _rows(8)
  rows[2] = {"prompt": "what is " + "1+" * 40 + "1?", "answer": 41}    # too long
  rows[3] = {"prompt": "What is 3+3?", "answer": 6}                    # 'W': no token
  rows[5] = {"prompt": None, "answer": 10}                             # no prompt
  rows[6] = {"prompt": "what is 6+6?", "answer": None}                 # no answer
  return rows


def test_every_unusable_row_is_refused_before_training_naming_the_rows_why_and_the_fix(tmp_path):
  path = _write(tmp_path / "train.jsonl", _hostile_rows())
  with pytest.raises(BadRowsError) as caught:
    _section(path).make(TOKENIZER)
  message = str(caught.value)
  assert "\n" not in message
  assert f"dataset {path!r}: 4 of 8 rows cannot be used" in message
  assert "row 2: its prompt has 91 tokens > max_prompt_tokens=32" in message
  assert "row 3: its prompt cannot be encoded: character 'W'" in message
  assert "row 5: column 'prompt' holds NoneType None" in message
  assert "row 6: its answer (field 'answer') is missing or null" in message
  assert "the longest has 91 tokens): raise it to 96" in message
  assert "--data.on_bad_rows=skip" in message


def test_skipping_reports_the_rows_counts_them_and_keeps_the_held_out_split(tmp_path):
  rows = _hostile_rows()
  path = _write(tmp_path / "train.jsonl", rows)
  logged = []
  train, held = _section(path, on_bad_rows="skip", eval_fraction=0.25).make(
      TOKENIZER, log=logged.append)
  assert len(logged) == 1 and "4 of 8 rows cannot be used" in logged[0]
  assert "left out" in logged[0]
  # The split is drawn over the file's rows: skipping never moves a row across it.
  train_rows, held_rows = split_indices(8, eval_fraction=0.25, seed=0)
  usable = {0, 1, 4, 7}
  assert list(train.records) == [rows[i] for i in train_rows if i in usable]
  assert list(held.records) == [rows[i] for i in held_rows if i in usable]
  assert train.skipped_rows == held.skipped_rows == 4
  from specrl_jax.rl.app.run_data import step_records  # noqa: F401 (the metric's writer)
  assert _metric_records(train)["data_skipped_rows"] == 4


def _metric_records(task):
  from specrl_jax.rl.tasks import encode_problems
  config = experiment_config("tiny", [])
  prompts = encode_problems(task.problems(), max_prompt_tokens=32, text_tokenizer=TOKENIZER)
  return run_data.step_records(config, task, None, prompts, [0], 0, None, None)


def test_a_dataset_whose_every_row_is_too_long_names_the_file_field_and_limit(tmp_path):
  rows = [{"question": "what is " + "1+" * 30 + f"{i}?", "answer": i} for i in range(3)]
  path = _write(tmp_path / "long.jsonl", rows)
  with pytest.raises(BadRowsError, match=r"long.jsonl': 3 of 3 rows cannot be used.*3 "
                     r"prompt\(s\) of field 'question' are longer than "
                     r"--data.max_prompt_tokens=32 \(the longest has 71 tokens\): raise it to 80"):
    _section(path, prompt_field="question").make(TOKENIZER)
  with pytest.raises(BadRowsError, match="no usable row is left to train on"):
    _section(path, prompt_field="question", on_bad_rows="skip").make(TOKENIZER,
                                                                      log=lambda _: None)


def test_unusable_held_out_rows_are_reported_naming_the_held_out_file(tmp_path):
  train = _write(tmp_path / "train.jsonl", _rows(4))
  held = _write(tmp_path / "held.jsonl", [{"prompt": "what is 1+1?", "answer": None}] + _rows(2))
  with pytest.raises(BadRowsError, match=r"held.jsonl': 1 of 3 rows cannot be used.*row 0: its "
                     "answer"):
    _section(train, eval_path=held).make(TOKENIZER)
  logged = []
  _, held_task = _section(train, eval_path=held, on_bad_rows="skip").make(
      TOKENIZER, log=logged.append)
  assert len(held_task.records) == 2 and "held.jsonl" in logged[0]


def test_the_data_options_are_command_line_flags_checked_before_any_work():
  config = experiment_config("dataset", ["--data.on_bad_rows=skip", "--data.reward_workers=2",
                                         "--data.reward_memory_mb=256"])
  assert (config.data.on_bad_rows, config.data.workers, config.data.reward_memory_mb) == (
      "skip", 2, 256)
  with pytest.raises(ConfigError, match=r"on_bad_rows='drop' is invalid.*\('error', 'skip'\)"):
    experiment_config("dataset", ["--data.on_bad_rows=drop"])
  with pytest.raises(ConfigError, match="reward_workers=-1 is invalid"):
    experiment_config("dataset", ["--data.reward_workers=-1"])


def test_a_null_sft_solution_is_an_unusable_row_never_the_text_none(tmp_path):
  rows = [{**r, "solution": f"{r['answer']}"} for r in _rows(3)]
  rows[1]["solution"] = None
  path = _write(tmp_path / "sft.jsonl", rows)
  with pytest.raises(BadRowsError, match=r"row 1: column 'solution' holds NoneType None"):
    _section(path, solution_field="solution").make(TOKENIZER)
  task = _task(rows, exact_match, solution_field="solution")
  assert task.problem(0).solution == "0"
  with pytest.raises(DatasetError, match="expected the worked solution's text"):
    task.problem(1)


def test_a_dataset_task_given_to_a_run_directly_is_checked_too():
  task = _task(_hostile_rows(), exact_match, max_prompt_length=32)
  config = experiment_config("tiny", [])
  with pytest.raises(BadRowsError, match="the task's records.: 4 of 8 rows"):
    run_data.run_tasks(config, TOKENIZER, task)


# ------------------------------------------------------------------ answers keep their type

def test_a_list_answer_is_the_accepted_answers_of_the_builtin_rewards():
  assert exact_match("", "#### 7", ["seven", "7"]) == 1.0
  assert exact_match("", "#### 8", ["seven", "7"]) == 0.0
  assert exact_match("", "#### 7", 7.0) == 1.0  # a float column: 7.0 reads as 7
  assert math_verify("", r"$\boxed{0.5}$", ["1/3", r"\frac{1}{2}"]) == 1.0
  assert math_verify("", r"$\boxed{0.25}$", ["1/3", r"\frac{1}{2}"]) == 0.0


@pytest.mark.parametrize("reward", [exact_match, math_verify])
def test_a_null_answer_is_refused_by_the_builtin_rewards_never_compared_as_none(reward):
  with pytest.raises(TypeError, match="got the answer NoneType None"):
    reward("", "None", None)
  with pytest.raises(TypeError, match="got the answer NoneType None"):
    reward("", "None", ["1", None])


def test_a_list_answer_reaches_the_reward_as_a_list(tmp_path):
  rows = [{"prompt": "what is 3+4?", "answer": ["7", "seven"]}]
  train, _ = _section(_write(tmp_path / "a.jsonl", rows)).make(TOKENIZER)
  assert train.score("seven", {"index": 0}) == 1.0 and train.score("7", {"index": 0}) == 1.0


# ------------------------------------------------------------------ rewards

def test_a_reward_that_mutates_its_arguments_changes_neither_the_rows_nor_the_log():
  conversation = [{"role": "user", "content": "what is 1+1?"}]
  rows = [{"prompt": conversation, "answer": ["2", "two"], "tags": {"level": 1}}]
  seen = []

  def mutating(prompt, completion, answer, tags):
    seen.append((list(answer), len(prompt)))
    answer.pop(0)
    prompt.append({"role": "assistant", "content": "hacked"})
    tags["level"] = 99
    return 1.0

  task = _task(rows, mutating)
  _host_rewards(task, ["2", "2"], rows=[0, 0])
  task.score("2", {"index": 0})
  assert seen == [(["2", "two"], 1)] * 3
  assert task.records == ({"prompt": [{"role": "user", "content": "what is 1+1?"}],
                           "answer": ["2", "two"], "tags": {"level": 1}},)
  assert [s["prompt"] for s in task.take_samples()] == ["what is 1+1?"] * 2


async def _async_reward(prompt, completion, answer):
  return 0.25


@pytest.mark.parametrize("value, expected", [
    (True, 1.0), (np.float32(0.5), 0.5), (np.int64(2), 2.0), (np.bool_(False), 0.0),
    (Fraction(1, 4), 0.25), (3, 3.0)])
def test_real_numbers_bools_and_numpy_scalars_are_accepted_rewards(value, expected):
  task = _task(_rows(1), lambda prompt, completion, answer: value)
  assert task.score("0", {"index": 0}) == expected
  assert _task(_rows(1), _async_reward).score("0", {"index": 0}) == 0.25  # awaited


@pytest.mark.parametrize("value, shown", [
    (None, "NoneType None"), ("1.0", "str '1.0'"), ([1.0], r"list \[1.0\]"),
    (np.array([1.0]), r"ndarray array\(\[1.\]\)"), (1j, "complex 1j"),
    (10 ** 400, "int 1000000"), (math.nan, "float nan"), (-math.inf, "float -inf")])
def test_a_returned_value_that_is_no_finite_real_is_refused_naming_sample_type_and_value(
    value, shown):
  fn = lambda prompt, completion, answer: value if completion == "1" else 0.0
  rewards = _host_rewards(_task(_rows(2), fn), ["0", "1"])
  assert np.isnan(rewards).all()  # the batch is not trained on
  with pytest.raises(RewardFunctionError, match=rf"user:fn returned {shown}.*not a finite real "
                     r"number \(float, int, bool or a numpy real scalar\).*sample 1"):
    raise_pending_errors()


@pytest.mark.parametrize("source, line, what", [
    ("def score(:\n  pass\n", 1, "raised SyntaxError"),
    ("import os\nimport no_such_package_xyz\n", 2,
     "imports 'no_such_package_xyz', which is not installed"),
    ("import sys\nsys.exit(0)\n", 2, r"called sys.exit\(0\) while being imported"),
])
def test_a_reward_module_that_fails_to_import_is_refused_with_its_file_and_line(
    tmp_path, source, line, what):
  path = tmp_path / "rewards.py"
  path.write_text(source)
  with pytest.raises(ConfigError, match=rf"failed to import at {path} line {line}: it {what}"):
    resolve_reward(f"{path}:score")


def test_a_column_named_like_a_reward_argument_is_refused_when_the_task_is_made(tmp_path):
  rows = [{**r, "completion": "x"} for r in _rows(2)]
  with pytest.raises(DatasetError, match=r"column 'completion' collides with the argument "
                     r"'completion' of the reward function exact_match"):
    _section(_write(tmp_path / "c.jsonl", rows)).make(TOKENIZER)
  # With the prompt read from another column, a column "prompt" would be passed twice;
  # a reward whose arguments have other names takes it as a keyword.
  rows = [{"prompt": "p", "question": r["prompt"], "answer": r["answer"]} for r in _rows(2)]
  with pytest.raises(DatasetError, match="column 'prompt' collides"):
    _task(rows, exact_match, prompt_field="question")
  task = _task(rows, lambda text, completion, answer, prompt: float(prompt == "p"),
               prompt_field="question")
  assert task.score("x", {"index": 0}) == 1.0


def test_logged_samples_are_in_sample_order_not_thread_completion_order():
  def slow_first(prompt, completion, answer):
    time.sleep(0.05 * (6 - int(completion)))  # sample 0 finishes last
    return float(completion)

  task = _task(_rows(6), slow_first, threads=6)
  _host_rewards(task, [str(i) for i in range(6)])
  assert [s["completion"] for s in task.take_samples()] == ["2", "3", "4", "5"]
  assert task.take_samples() == []
  # Two rollout shards' calls in either order, and a batch scored ahead (row 5): the
  # step's log takes its own rows' first samples in the step's order.
  fast = _task(_rows(6), lambda prompt, completion, answer: 1.0)
  _host_rewards(fast, ["3", "3", "1", "1"], rows=[3, 3, 1, 1])
  _host_rewards(fast, ["5"], rows=[5])
  _host_rewards(fast, ["4", "0", "0"], rows=[4, 0, 0])
  taken = fast.take_samples(rows=[0, 3, 4, 1])
  assert [(s["prompt"], s["completion"]) for s in taken] == [
      ("what is 0+0?", "0"), ("what is 0+0?", "0"), ("what is 3+3?", "3"), ("what is 3+3?", "3")]
  assert [s["completion"] for s in fast.take_samples(rows=[5, 2])] == ["5"]
  task.score_texts([0], ["1"])  # evaluation is not logged as training samples
  assert task.take_samples() == []


# ------------------------------------------------------------------ reward workers

def test_math_verify_runs_in_worker_processes_by_default_and_others_in_threads():
  assert DataSection(reward="math_verify").workers == 4
  assert DataSection(reward="math_verify", reward_workers=0).workers == 0
  assert DataSection(reward="exact_match").workers == 0
  with pytest.raises(ConfigError, match="reward_memory_mb=64 is invalid"):
    DataSection(reward="exact_match", reward_memory_mb=64)
  assert DataSection(reward="exact_match", reward_workers=2, reward_memory_mb=64).workers == 2


@pytest.mark.parametrize("fn, problem", [
    (hostile_rewards.dataset_dies_on_bad, r"killed its worker process \(exit code 7"),
    pytest.param(hostile_rewards.dataset_hangs_on_bad, r"did not return within 1.0 s \(its "
                 "worker process was killed", marks=pytest.mark.slow(
                     reason="each worker imports JAX (~5 s); the dies case scores a failed sample "
                            "0 the same way and test_faults.py::test_reward_workers_isolate_a_"
                            "hostile_function kills a hung worker")),
])
def test_a_reward_worker_that_dies_or_hangs_scores_zero_for_its_sample_and_is_reported(
    fn, problem):
  task = _task(_rows(3), fn, workers=2, timeout=1.0)
  rewards = _host_rewards(task, ["ok", "bad", "ok"])
  np.testing.assert_array_equal(rewards, [1.0, 0.0, 1.0])
  raise_pending_errors()  # nothing pending: the run goes on
  (line,) = take_failures()
  assert "user:fn" in line and "on sample 1" in line and "'bad'" in line
  assert __import__("re").search(problem, line) and line.endswith("it scored 0.0")
  np.testing.assert_array_equal(_host_rewards(task, ["ok"]), [1.0])  # a fresh worker
  # A value that is no reward is a bug of the function, not of one sample: the batch fails.
  assert np.isnan(_host_rewards(task, ["ok", "none"])).all()
  with pytest.raises(RewardFunctionError, match=r"user:fn returned NoneType None, not a finite "
                     r"real number .* \(in a worker process\) on sample 1"):
    raise_pending_errors()


def test_math_verify_on_a_tower_of_powers_times_out_in_its_worker(tmp_path):
  rows = [{"prompt": "what is 9*9?", "answer": "81"}]
  train, _ = _section(_write(tmp_path / "m.jsonl", rows), reward="math_verify",
                      reward_timeout=2.0, reward_workers=1).make(TOKENIZER)
  started = time.perf_counter()
  rewards = train._score_all([(r"\boxed{9^{9^{9^{9}}}}", {"index": 0})])
  assert rewards == [0.0] and time.perf_counter() - started < 60
  (line,) = take_failures()
  assert "did not return within 2.0 s" in line


# ------------------------------------------------------------------ files

def test_an_empty_dataset_is_named_empty(tmp_path):
  (tmp_path / "blank.jsonl").write_text("\n\n  \n")
  with pytest.raises(DatasetError, match=r"'.*blank.jsonl' is empty: it has no rows"):
    read_records(tmp_path / "blank.jsonl", required=["question"])
  (tmp_path / "empty.json").write_text("[]")
  with pytest.raises(DatasetError, match="is empty"):
    read_records(tmp_path / "empty.json")


def test_an_answer_column_of_texts_and_lists_is_read_row_by_row(tmp_path):
  rows = [{"prompt": "a", "answer": ["7", "seven"]}, {"prompt": "b", "answer": "8"}]
  assert read_records(_write(tmp_path / "mixed.jsonl", rows)) == rows
  (tmp_path / "list.jsonl").write_text('{"prompt": "a"}\n[1, 2]\n')
  with pytest.raises(DatasetError, match=r"list.jsonl': line 2 is list '\[1, 2\]'; expected an "
                     "object"):
    read_records(tmp_path / "list.jsonl")


def test_a_json_file_holding_one_array_of_rows_is_read(tmp_path):
  rows = [{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": [2, 3], "extra": "x"}]
  (tmp_path / "rows.json").write_text(json.dumps(rows, indent=2))
  assert read_records(tmp_path / "rows.json", required=["prompt"]) == [
      {"prompt": "a", "answer": 1, "extra": None}, rows[1]]
  (tmp_path / "bad.json").write_text('[{"prompt": "a"}, 3]')
  with pytest.raises(DatasetError, match=r"row 1 \(counting from 0\) is int '3'; expected an "
                     "object"):
    read_records(tmp_path / "bad.json")


def test_a_row_of_3_mb_is_read_and_a_broken_line_is_named(tmp_path):
  rows = [{"prompt": "x" * 3_000_000, "answer": 1}, {"prompt": "y", "answer": 2}]
  assert read_records(_write(tmp_path / "huge.jsonl", rows)) == rows
  (tmp_path / "broken.jsonl").write_text(json.dumps(rows[1]) + "\n\n" + "x" * 2_000_000 + "\n")
  with pytest.raises(DatasetError, match=r"broken.jsonl' line 3 is not valid JSON \(Expecting "
                     "value: line 1 column 1"):
    read_records(tmp_path / "broken.jsonl")


# ------------------------------------------------------------------ chat templates

TEMPLATE_A = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
              "{% if add_generation_prompt %}a:{% endif %}")
TEMPLATE_B = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}={% endfor %}"
TEMPLATE_C = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"


def _folder(tmp_path, config_template=None, jinja=None, extra=None):
  TOKENIZER.save(tmp_path)
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  if config_template is not None:
    config["chat_template"] = config_template
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  if jinja is not None:
    (tmp_path / "chat_template.jinja").write_text(jinja)
  for name, text in (extra or {}).items():
    (tmp_path / "additional_chat_templates").mkdir(exist_ok=True)
    (tmp_path / "additional_chat_templates" / f"{name}.jinja").write_text(text)
  return tmp_path


CASES = {
    "jinja file only": dict(jinja=TEMPLATE_A),
    "tokenizer_config only": dict(config_template=TEMPLATE_B),
    "jinja file over a different tokenizer_config": dict(jinja=TEMPLATE_A,
                                                         config_template=TEMPLATE_B),
    "named templates with a default": dict(config_template=[
        {"name": "tool_use", "template": TEMPLATE_C}, {"name": "default", "template": TEMPLATE_A}]),
    "jinja default beside additional templates": dict(jinja=TEMPLATE_B,
                                                      extra={"rag": TEMPLATE_C}),
    "additional templates replace tokenizer_config": dict(config_template=TEMPLATE_A,
                                                          extra={"default": TEMPLATE_C}),
    "no template": dict(),
}
REFUSED = {
    "named templates without a default": dict(config_template=[
        {"name": "tool_use", "template": TEMPLATE_C}, {"name": "chat", "template": TEMPLATE_A}]),
    "additional templates without a default": dict(config_template=TEMPLATE_A,
                                                   extra={"rag": TEMPLATE_C, "x": TEMPLATE_B}),
}


def _hf_ids(hf, messages):
  ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
  return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_chat_template_is_chosen_as_transformers_chooses_it(tmp_path, case):
  transformers = pytest.importorskip("transformers")
  folder = _folder(tmp_path, **CASES[case])
  ours = TextTokenizer.from_pretrained(folder)
  hf = transformers.AutoTokenizer.from_pretrained(folder)
  messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2?"}]
  if case == "no template":  # transformers refuses; a base model reads the plain text
    with pytest.raises(ValueError, match="chat_template is not set"):
      hf.apply_chat_template(messages)
    assert ours.encode_messages(messages) == builtin.encode("be brief\n\n1+2?", add_bos=True)
    return
  assert ours.encode_messages(messages) == _hf_ids(hf, messages)


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_several_named_chat_templates_without_a_default_are_refused_as_transformers_does(
    tmp_path, case):
  transformers = pytest.importorskip("transformers")
  folder = _folder(tmp_path, **REFUSED[case])
  with pytest.raises(ValueError, match="multiple chat templates with no default"):
    transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
        [{"role": "user", "content": "1"}])
  with pytest.raises(TokenizerFormatError, match=r"several named chat templates .* none named "
                     "'default'"):
    TextTokenizer.from_pretrained(folder)


# ------------------------------------------------------------------ through `specrl train`

def test_specrl_train_refuses_rows_too_long_in_one_line_before_any_work(tmp_path, capsys):
  rows = [{"prompt": "what is " + "1+" * 30 + "1?", "answer": 31}] * 2
  path = _write(tmp_path / "long.jsonl", rows)
  code = cli.main(["train", "--preset=tiny", f"--dataset={path}", "--data.max_prompt_tokens=16",
                   "--warm_start.sft_steps=0", "--drafter.kind=none",
                   f"--output.directory={tmp_path / 'run'}"])
  err = capsys.readouterr().err
  assert code == 1 and len(err.strip().splitlines()) == 1
  assert "BadRowsError" in err and "2 of 2 rows cannot be used" in err
  assert "raise it to 80" in err
  assert not (tmp_path / "run").exists()


def test_specrl_train_refuses_a_reward_module_that_exits_at_import(tmp_path, capsys):
  (tmp_path / "r.py").write_text("import sys\nsys.exit(0)\n")
  path = _write(tmp_path / "rows.jsonl", _rows(2))
  code = cli.main(["train", "--preset=tiny", f"--dataset={path}",
                   f"--reward={tmp_path / 'r.py'}:score", "--warm_start.sft_steps=0",
                   "--drafter.kind=none", f"--output.directory={tmp_path / 'run'}"])
  err = capsys.readouterr().err
  assert code == 1 and len(err.strip().splitlines()) == 1
  assert f"failed to import at {tmp_path / 'r.py'} line 2: it called sys.exit(0)" in err
