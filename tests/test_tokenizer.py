"""The built-in character tokenizer: fixed ids, exact round trips, loud failures."""

import re

import pytest
import tokenizers

from specrl_jax.models import tokenizer as tok

TEXTS = [
    "",
    "7",
    "what is 12*(3+4)?\n3+4=7\n12*7=84\nanswer: 84",
    "numbers: 3, 7, 25, 50. target: 96\n50-25=25\n25*3=75 ... 75+7=82; no!",
    "  spaces   and\n\nnewlines  ",
    "[a_b] 10% #1 'quoted' / 4 - 2",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip_one_token_per_character(text):
  ids = tok.encode(text)
  assert len(ids) == len(text)
  assert tok.decode(ids) == text
  assert tok.decode(tok.encode(text, add_bos=True)) == text


def test_special_ids_come_first_and_vocab_is_small():
  assert (tok.PAD_ID, tok.BOS_ID, tok.EOS_ID) == (0, 1, 2)
  tokenizer = tok.builtin_tokenizer()
  assert [tokenizer.id_to_token(i) for i in range(3)] == ["<pad>", "<bos>", "<eos>"]
  assert tokenizer.get_vocab_size() == tok.VOCAB_SIZE < 64
  assert sorted(tokenizer.get_vocab().values()) == list(range(tok.VOCAB_SIZE))


def test_every_character_class_the_tasks_need_is_in_the_vocabulary():
  required = "0123456789+-*/=() \nabcdefghijklmnopqrstuvwxyz:,.?"
  assert tok.decode(tok.encode(required)) == required


def test_add_bos_prepends_bos_and_nothing_appends_eos():
  assert tok.encode("1+1", add_bos=True) == [tok.BOS_ID] + tok.encode("1+1")
  assert tok.EOS_ID not in tok.encode("1+1", add_bos=True)


def test_decode_stops_at_eos_or_end_marker_and_skips_pad_and_bos():
  body = tok.encode("2+2=4")
  assert tok.decode([tok.BOS_ID, *body, tok.EOS_ID, *tok.encode("junk")]) == "2+2=4"
  assert tok.decode([*body, -1, -1]) == "2+2=4"  # generate() pads ends with -1
  assert tok.decode([tok.PAD_ID, *body, tok.PAD_ID]) == "2+2=4"


@pytest.mark.parametrize("text,char", [("12X3", "X"), ("caf\u00e9", "\u00e9"), ("a<eos>", "<"),
                                       ("tab\there", "\t")])
def test_unknown_character_is_an_error_naming_it(text, char):
  with pytest.raises(tok.UnknownCharacterError, match=re.escape(repr(char))):
    tok.encode(text)


def test_decode_rejects_ids_outside_the_vocabulary():
  with pytest.raises(ValueError, match=f"token id {tok.VOCAB_SIZE} is outside"):
    tok.decode([3, tok.VOCAB_SIZE])


def test_tokenizers_object_matches_encode_and_survives_save_and_load(tmp_path):
  tokenizer = tok.builtin_tokenizer()
  file = str(tmp_path / "tokenizer.json")
  tokenizer.save(file)
  reloaded = tokenizers.Tokenizer.from_file(file)
  for text in TEXTS:
    assert reloaded.encode(text, add_special_tokens=False).ids == tok.encode(text)
    assert reloaded.decode(tok.encode(text)) == text
  assert reloaded.decode([tok.BOS_ID, *tok.encode("ok"), tok.EOS_ID]) == "ok"


def test_builtin_tokenizer_returns_independent_copies():
  first = tok.builtin_tokenizer()
  first.enable_padding(pad_id=tok.PAD_ID, pad_token="<pad>", length=8)
  assert len(tok.builtin_tokenizer().encode("12").ids) == 2
  assert tok.encode("12") == [tok.VOCAB["1"], tok.VOCAB["2"]]
