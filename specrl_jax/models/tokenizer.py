"""A fixed character-level tokenizer for the synthetic tasks.

Arithmetic with worked steps and countdown games need only digits, operators, lower
case words and a little punctuation, so one token per character keeps the vocabulary
under 64 and every sequence trivially inspectable. It is a real ``tokenizers.Tokenizer``
(a merge-free BPE over single characters), so it saves as tokenizer.json next to a
model and Hugging Face loads it like any other. ``text_tokenizer()`` is the same
vocabulary as the ``TextTokenizer`` RL uses for every model: pad/bos/eos roles, BOS
before plain-text prompts, no chat template.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import tokenizers
from tokenizers import decoders, models, processors

from specrl_jax.models.text_tokenizer import TextTokenizer

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

# Order fixes the ids: special tokens first, then characters. '<' and '>' are left
# out on purpose so no text can spell a special token.
SPECIAL_TOKENS = (PAD, BOS, EOS)
CHARACTERS = ("0123456789" "+-*/=()" " \n" "abcdefghijklmnopqrstuvwxyz" ":,.?!;'_[]%#")
VOCAB: dict[str, int] = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(CHARACTERS))}
VOCAB_SIZE = len(VOCAB)


class UnknownCharacterError(ValueError):
  """Text holds a character the built-in vocabulary does not cover."""


@functools.cache
def _tokenizer() -> tokenizers.Tokenizer:
  # Without merges BPE maps every character to its own id; with no unk_token it
  # would silently drop unknown characters, which encode() refuses up front.
  tokenizer = tokenizers.Tokenizer(models.BPE(vocab=dict(VOCAB), merges=[]))
  tokenizer.decoder = decoders.Fuse()  # join characters without inserted spaces
  tokenizer.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                for t in SPECIAL_TOKENS])
  return tokenizer


def builtin_tokenizer() -> tokenizers.Tokenizer:
  """A fresh copy of the built-in tokenizer (safe to mutate, e.g. enable padding)."""
  return tokenizers.Tokenizer.from_str(_tokenizer().to_str())


@functools.cache
def text_tokenizer() -> TextTokenizer:
  """The built-in vocabulary as a ``TextTokenizer`` (one shared object: tasks holding
  it compare equal, so compiled steps are reused). Saved with ``.save(path)`` it is an
  ordinary Hugging Face tokenizer folder whose encode adds BOS, as ours does."""
  tokenizer = builtin_tokenizer()
  tokenizer.post_processor = processors.TemplateProcessing(
      single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)])
  return TextTokenizer(tokenizer=tokenizer,
                       special_tokens={"bos_token": BOS, "eos_token": EOS, "pad_token": PAD},
                       bos_id=BOS_ID, eos_ids=(EOS_ID,), pad_id=PAD_ID, add_bos=True,
                       source="the built-in vocabulary")


def encode(text: str, *, add_bos: bool = False) -> list[int]:
  """Character ids of ``text`` (BOS first when ``add_bos``); no EOS is appended."""
  for position, char in enumerate(text):
    if char not in VOCAB:
      raise UnknownCharacterError(
          f"character {char!r} (U+{ord(char):04X}) at position {position} is not in the "
          f"built-in vocabulary; allowed characters: {CHARACTERS!r}")
  ids = _tokenizer().encode(text, add_special_tokens=False).ids
  return [BOS_ID, *ids] if add_bos else ids


def decode(ids: Iterable[int]) -> str:
  """Text of ``ids`` up to the first EOS (or negative id: the end marker of
  ``generate`` outputs), skipping pad and BOS."""
  kept = []
  for token in (int(i) for i in ids):
    if token == EOS_ID or token < 0:
      break
    if not token < VOCAB_SIZE:
      raise ValueError(f"token id {token} is outside the built-in vocabulary "
                       f"[0, {VOCAB_SIZE - 1}]")
    if token not in (PAD_ID, BOS_ID):
      kept.append(token)
  return _tokenizer().decode(kept, skip_special_tokens=False)
