"""GRPO on one's own model and data: a tiny Qwen3 saved by transformers with a BPE
tokenizer and chat template, a JSONL of word problems, a reward in a user module.

`specrl train` runs 3 steps and resumes to 5 continuing the data order, `specrl eval`
prints pass@k; the prompts are exactly what `apply_chat_template` encodes and the
rollouts stop at the tokenizer's eos ids (from generation_config.json).
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
from specrl_jax.models.text_tokenizer import TextTokenizer
from specrl_jax.rl.app import train_command
from specrl_jax.rl.app.metrics import read_jsonl
from specrl_jax.rl.tasks import step_indices

NAMES = ("José", "ZOË", "Łukasz", "Ana", "Mr. O'Brien", "Søren", "Chloé", "Bjørn")
THINGS = ("apples", "books", "coins", "stamps")
# A Qwen-style template that also reads bos_token and calls raise_exception, so the
# test checks the variables and globals transformers gives a template.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
SYSTEM = "Answer with a number. ¡Sé breve!"
REWARD_MODULE = '''
import re

def score(prompt, completion, answer, **fields):
    assert fields["difficulty"] in ("easy", "hard"), fields  # other columns arrive
    numbers = re.findall(r"[0-9]+", completion)
    # A lenient reward, so that an untrained policy scores sometimes.
    return 1.0 if numbers else 0.0
'''
ROWS = 64
PROMPTS_PER_STEP = 4
MAX_RESPONSE = 12


def _problems() -> list[dict]:
  rng = np.random.default_rng(0)
  rows = []
  for i in range(ROWS):
    a, b = (int(x) for x in rng.integers(1, 50, 2))
    name, thing = NAMES[i % len(NAMES)], THINGS[i % len(THINGS)]
    rows.append({"question": f"{name} HAS {a} {thing}, then gets {b} more! How many {thing} "
                             f"now? (#{i})",
                 "answer": a + b, "difficulty": "easy" if a + b < 50 else "hard"})
  return rows


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
  root = tmp_path_factory.mktemp("own_model")
  rows = _problems()
  data = root / "problems.jsonl"
  data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                  encoding="utf-8")
  (root / "user_rewards.py").write_text(REWARD_MODULE)

  bpe = tokenizers.Tokenizer(models.BPE(unk_token=None))
  bpe.pre_tokenizer = pre_tokenizers.Metaspace()
  bpe.decoder = decoders.Metaspace()
  corpus = [r["question"] for r in rows] + [SYSTEM, "user assistant system 0123456789"]
  bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=160, special_tokens=SPECIALS))
  hf_tokenizer = transformers.PreTrainedTokenizerFast(
      tokenizer_object=bpe, bos_token="<s>", eos_token="<|im_end|>",
      pad_token="<|endoftext|>")
  hf_tokenizer.chat_template = CHAT_TEMPLATE
  model_dir = root / "qwen3"
  hf_tokenizer.save_pretrained(model_dir)
  vocab = bpe.get_vocab_size()
  config = transformers.Qwen3Config(
      vocab_size=vocab + 6,  # embeddings padded past the tokenizer, as real models do
      hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
      max_position_embeddings=256)
  transformers.Qwen3ForCausalLM(config).save_pretrained(model_dir)
  eos_ids = [bpe.token_to_id("<|im_end|>"), bpe.token_to_id("<|endoftext|>")]
  (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
  return {"root": root, "data": str(data), "model": str(model_dir), "rows": rows,
          "hf_tokenizer": hf_tokenizer, "eos_ids": tuple(eos_ids),
          "reward": f"{root / 'user_rewards.py'}:score"}


def _train_argv(ws, steps):
  return ["train", f"--model={ws['model']}", f"--dataset={ws['data']}",
          f"--reward={ws['reward']}", "--data.prompt_field=question",
          f"--data.system_prompt={SYSTEM}", "--data.eval_fraction=0.125",
          "--data.eval_every=5", "--data.eval_k=2", "--data.eval_max_prompts=4",
          f"--data.max_response_tokens={MAX_RESPONSE}", "--data.max_prompt_tokens=96",
          f"--rl.steps={steps}", f"--rl.prompts_per_step={PROMPTS_PER_STEP}",
          "--rl.group_size=2", "--learner.learning_rate=1e-3", "--drafter.kind=none",
          "--output.progress=false", "--output.tensorboard=false", "--output.plots=false",
          f"--output.directory={ws['root'] / 'run'}", "--output.checkpoint_every=1"]


def test_the_prompts_are_what_apply_chat_template_encodes(workspace):
  config = train_command.parse_argv(_train_argv(workspace, 3)[1:])
  session = train_command.Session(config, log=lambda message: None)
  hf = workspace["hf_tokenizer"]
  assert len(session.prompt_set) == ROWS - ROWS // 8  # the held-out eighth is apart
  for problem, ids in zip(session.prompt_set.problems, session.prompt_set.prompts):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": problem.prompt}]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert session.text_tokenizer.render_prompt(messages) == text
    expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert ids == list(expected)
  assert session.rollout_config.sampling.stop_token_ids == workspace["eos_ids"]


def test_rollouts_stop_at_the_tokenizers_eos_ids(workspace):
  tok = TextTokenizer.from_pretrained(workspace["model"])
  assert tok.eos_ids == workspace["eos_ids"]
  policy = sj.load_hf(workspace["model"])
  prompt = tok.encode_prompt("Ana HAS 3 apples!", system=SYSTEM)
  sampling = sj.SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=tok.eos_ids)
  out = sj.generate(policy, [prompt] * 64, sampling=sampling, rng=jax.random.key(0))
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  stopped = lengths < 24
  assert stopped.any(), "the seed was chosen so that some samples stop"
  for row, n in zip(tokens[stopped], lengths[stopped]):
    assert row[n - 1] in tok.eos_ids and not np.isin(row[:n - 1], tok.eos_ids).any()
    assert (row[n:] == -1).all()


def test_train_three_steps_resume_to_five_then_eval_prints_pass_at_k(workspace, capsys):
  assert cli.main(_train_argv(workspace, 3)) == 0
  assert cli.main(_train_argv(workspace, 5)) == 0  # resumes from the step-3 checkpoint
  out = capsys.readouterr().out
  assert "resumed from checkpoint step 3" in out
  run = workspace["root"] / "run"
  records = read_jsonl(run / "metrics.jsonl")
  assert [r["step"] for r in records] == [0, 1, 2, 3, 4]

  # The data order is one pure function of the step: epochs without replacement.
  config = train_command.parse_argv(_train_argv(workspace, 5)[1:])
  session = train_command.Session(config, log=lambda message: None)
  rows_of = session.prompt_set.targets["index"]
  for record in records:
    expected = rows_of[step_indices(len(session.prompt_set), record["step"], PROMPTS_PER_STEP,
                                    config.rl.seed)]
    assert record["data"]["rows"] == [int(r) for r in expected]
  seen = [row for record in records for row in record["data"]["rows"]]
  assert len(set(seen)) == len(seen) == 5 * PROMPTS_PER_STEP  # none twice in an epoch
  held_out = {r["question"] for r in session.eval_task.records}
  assert not held_out & {session.task.records[i]["question"] for i in seen}

  for record in records:
    assert {"prompt", "completion", "reward"} <= set(record["samples"][0])
    assert all(np.isfinite(record["reward_mean"]) for record in records)
  # Some rollouts ended at one of the tokenizer's eos ids before the token budget.
  assert any(record["truncated_fraction"] < 1 for record in records)
  assert 0 <= records[-1]["eval_pass@1"] <= records[-1]["eval_pass@2"] <= 1
  assert "eval_pass@1" not in records[2]  # every 5 steps

  assert cli.main(["eval", f"--checkpoint={run}", "--k=4", "--max_prompts=4"]) == 0
  result = json.loads(capsys.readouterr().out)
  assert result["step"] == 5 and result["num_prompts"] == 4
  passes = [result[f"pass@{j}"] for j in range(1, 5)]
  assert passes == sorted(passes) and 0 <= passes[0] and passes[-1] <= 1
  assert 0 <= result["reward_mean"] <= 1


def test_eval_of_a_hugging_face_folder_reads_every_row_of_the_dataset(workspace, capsys):
  assert cli.main(["eval", f"--checkpoint={workspace['model']}", f"--dataset={workspace['data']}",
                   f"--reward={workspace['reward']}", "--data.prompt_field=question",
                   "--data.max_response_tokens=8", "--k=2", "--max_prompts=3"]) == 0
  result = json.loads(capsys.readouterr().out)
  assert result["step"] is None and result["num_prompts"] == 3
  assert 0 <= result["pass@1"] <= result["pass@2"] <= 1
  assert cli.main(["eval", f"--checkpoint={workspace['model']}"]) == 1
  assert "no dataset: give --dataset=FILE" in capsys.readouterr().err
