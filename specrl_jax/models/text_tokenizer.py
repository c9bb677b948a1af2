"""A model's own tokenizer, read from its Hugging Face folder, for prompts, stop
tokens and decoding, without transformers at run time.

    tok = TextTokenizer.from_pretrained("path/to/model")
    ids = tok.encode_prompt("What is 2+2?", system="Answer briefly.")
    text = tok.decode(response_ids)

The folder's tokenizer.json is read with ``tokenizers``; chat_template.jinja (else
tokenizer_config.json) gives the chat template, chosen as transformers chooses it
(``chat_template``); tokenizer_config.json the bos/eos/pad tokens;
generation_config.json's eos_token_id (an int or a list) adds stop ids. A prompt is rendered as transformers'
``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`` renders
it (the same sandboxed jinja2 environment) and encoded without adding special tokens,
as ``apply_chat_template(..., tokenize=True)`` does: the template writes bos itself.
Without a chat template a prompt is its plain text, encoded with the tokenizer's own
special tokens (its post-processor) and bos first when the config asks for it.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import tokenizers

from specrl_jax.config import ConfigError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CONFIG_FILE = "config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# The names transformers hands a chat template as variables (special_tokens_map).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


class TokenizerFormatError(ConfigError):
  """A tokenizer folder is missing a file or holds an invalid one."""


class UnknownTextError(ValueError):
  """Text holds a character the tokenizer has no token for (it would be dropped)."""


def _read_json(path: str) -> dict[str, Any]:
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except json.JSONDecodeError as error:
    raise TokenizerFormatError(f"{path} is not valid JSON: {error}") from None
  if not isinstance(data, dict):
    raise TokenizerFormatError(f"{path} holds {type(data).__name__}; expected a JSON object")
  return data


def _token_text(value: Any, name: str, path: str) -> str | None:
  """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, dict) and isinstance(value.get("content"), str):
    return value["content"]
  raise TokenizerFormatError(f"{path}: {name}={value!r} is invalid: expected a token string "
                             "or an object with a 'content' string")


@functools.cache
def _compile_template(template: str):
  """The template compiled in the environment transformers renders chat templates in."""
  import jinja2
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Not jinja's own tojson, which escapes HTML characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  def strftime_now(format):
    return datetime.datetime.now().strftime(format)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=dict,
                     namespace=jinja2.utils.Namespace)
  try:
    return env.from_string(template)
  except jinja2.exceptions.TemplateSyntaxError as error:
    raise TokenizerFormatError(f"the chat template does not parse: {error}") from None


def _read_text(path: str) -> str:
  with open(path, encoding="utf-8") as f:
    return f.read()


def chat_template(path: str, config: Mapping[str, Any]) -> str | None:
  """The chat template of folder ``path`` as transformers (5.x) chooses it for
  ``apply_chat_template`` without a template argument: the files chat_template.jinja
  (named "default") and additional_chat_templates/NAME.jinja, when there are any,
  replace tokenizer_config.json's ``chat_template`` (a string, or a list of
  {"name", "template"}); of several named templates the one named "default" is used,
  and several without a "default" are refused, as transformers refuses them. None:
  no template (prompts are plain text)."""
  templates: dict[str, Any] = {}
  if os.path.isfile(os.path.join(path, CHAT_TEMPLATE_FILE)):
    templates["default"] = _read_text(os.path.join(path, CHAT_TEMPLATE_FILE))
  extra = os.path.join(path, CHAT_TEMPLATE_DIR)
  if os.path.isdir(extra):
    for name in sorted(os.listdir(extra)):
      if name.endswith(".jinja"):
        templates[name.removesuffix(".jinja")] = _read_text(os.path.join(extra, name))
  source = f"{path}'s {CHAT_TEMPLATE_FILE} and {CHAT_TEMPLATE_DIR}/"
  if templates:
    template = templates if set(templates) != {"default"} else templates["default"]
  else:
    template = config.get("chat_template")
    source = os.path.join(path, TOKENIZER_CONFIG_FILE)
    if isinstance(template, list):
      if not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in template):
        raise TokenizerFormatError(f"{source}: chat_template is a list whose entries are not "
                                   'all {"name": ..., "template": ...}')
      template = {t["name"]: t.get("template") for t in template}
  if isinstance(template, dict):
    if "default" not in template:
      raise TokenizerFormatError(
          f"{source} hold several named chat templates {sorted(template)} and none named "
          "'default': transformers refuses to choose one (apply_chat_template raises "
          "'multiple chat templates with no default'); name the one to use 'default'")
    template = template["default"]
  if template is not None and not isinstance(template, str):
    raise TokenizerFormatError(f"{source}: the chat template is {type(template).__name__}; "
                               "expected a string")
  return template


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class TextTokenizer:
  """A tokenizer with the roles RL needs. Compared by identity (it is a static
  argument of compiled steps through the tasks that hold it).

  tokenizer: the ``tokenizers.Tokenizer``; chat_template: jinja source or None;
  special_tokens: the template's variables (bos_token, eos_token, ...);
  bos_id / pad_id: None when the tokenizer has none; eos_ids: the stop tokens (at
  least one); add_bos: plain-text prompts start with bos (no template).
  """
  tokenizer: tokenizers.Tokenizer
  chat_template: str | None = None
  special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)
  bos_id: int | None = None
  eos_ids: tuple[int, ...] = ()
  pad_id: int | None = None
  add_bos: bool = False
  source: str = "<memory>"

  def __post_init__(self):
    if not self.eos_ids:
      raise TokenizerFormatError(
          f"tokenizer from {self.source} has no end-of-sequence token: set eos_token in "
          f"{TOKENIZER_CONFIG_FILE} or eos_token_id in {GENERATION_CONFIG_FILE}")

  # ------------------------------------------------------------------ loading

  @classmethod
  def from_pretrained(cls, path: str | os.PathLike) -> "TextTokenizer":
    """The tokenizer of a Hugging Face folder (see the module docstring)."""
    path = os.fspath(path)
    file = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(file):
      raise TokenizerFormatError(
          f"{path} has no {TOKENIZER_FILE}: a fast (tokenizers) tokenizer is needed; save one "
          "with transformers' tokenizer.save_pretrained(path)")
    try:
      tokenizer = tokenizers.Tokenizer.from_file(file)
    except Exception as error:  # tokenizers raises its own exception type
      raise TokenizerFormatError(f"{file} does not load: {error}") from None
    config_file = os.path.join(path, TOKENIZER_CONFIG_FILE)
    config = _read_json(config_file) if os.path.isfile(config_file) else {}
    template = chat_template(path, config)
    special = {}
    for name in SPECIAL_TOKEN_NAMES:
      text = _token_text(config.get(name), name, config_file)
      if text is not None:
        special[name] = text
    ids = {}
    for name, text in special.items():
      token_id = tokenizer.token_to_id(text)
      if token_id is None:
        raise TokenizerFormatError(f"{config_file}: {name}={text!r} is not a token of "
                                   f"{file} (a vocabulary of {tokenizer.get_vocab_size()})")
      ids[name] = token_id
    eos_ids = [ids["eos_token"]] if "eos_token" in ids else []
    for name in (GENERATION_CONFIG_FILE, CONFIG_FILE):
      extra = os.path.join(path, name)
      value = _read_json(extra).get("eos_token_id") if os.path.isfile(extra) else None
      values = value if isinstance(value, list) else [] if value is None else [value]
      for v in values:
        if not (isinstance(v, int) and 0 <= v < tokenizer.get_vocab_size()):
          raise TokenizerFormatError(f"{extra}: eos_token_id {v!r} is invalid: expected token "
                                     f"ids in [0, {tokenizer.get_vocab_size() - 1}]")
      eos_ids += [v for v in values if v not in eos_ids]
      if values:
        break  # generation_config.json is what generate() reads; config.json a fallback
    return cls(tokenizer=tokenizer, chat_template=template, special_tokens=special,
               bos_id=ids.get("bos_token"), eos_ids=tuple(eos_ids), pad_id=ids.get("pad_token"),
               add_bos=bool(config.get("add_bos_token", False)) and "bos_token" in ids,
               source=path)

  # ------------------------------------------------------------------ encoding

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size()

  @property
  def padding_id(self) -> int:
    """The id prompts are padded with (never read: padded positions are masked)."""
    return self.pad_id if self.pad_id is not None else self.eos_ids[0]

  def messages(self, prompt: str, system: str | None = None) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}]

  def render_prompt(self, messages: Sequence[Mapping[str, Any]]) -> str:
    """The chat template's text with the generation prompt (as transformers renders
    it with add_generation_prompt=True); without a template, the messages' contents
    joined by blank lines."""
    if self.chat_template is None:
      return "\n\n".join(str(m["content"]) for m in messages)
    template = _compile_template(self.chat_template)
    import jinja2
    try:
      return template.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                             add_generation_prompt=True, **self.special_tokens)
    except jinja2.exceptions.TemplateError as error:
      raise TokenizerFormatError(f"the chat template of {self.source} failed: {error}") from None

  @functools.cached_property
  def _alphabet(self) -> frozenset[str] | None:
    """The characters a merge-based model can encode, when it drops all others: BPE
    with neither an unknown token nor byte fallback nor a byte-level pre-tokenizer
    (None otherwise: then every character has some encoding)."""
    spec = json.loads(self.tokenizer.to_str())
    model = spec.get("model") or {}
    if (model.get("type") != "BPE" or model.get("unk_token") is not None
        or model.get("byte_fallback") or "ByteLevel" in json.dumps(spec.get("pre_tokenizer"))):
      return None
    added = {t.content for t in self.tokenizer.get_added_tokens_decoder().values()}
    return frozenset("".join(token for token in self.tokenizer.get_vocab(with_added_tokens=False)
                             if token not in added))

  def _check_characters(self, text: str) -> None:
    alphabet = self._alphabet
    if alphabet is None:
      return
    added = sorted((t.content for t in self.tokenizer.get_added_tokens_decoder().values()),
                   key=len, reverse=True)
    spans = ([m.span() for m in re.finditer("|".join(map(re.escape, added)), text)]
             if added else [])
    inside = bytearray(len(text))
    for start, end in spans:
      inside[start:end] = b"\x01" * (end - start)
    for position, char in enumerate(text):
      if not inside[position] and not char.isspace() and char not in alphabet:
        raise UnknownTextError(
            f"character {char!r} (U+{ord(char):04X}) at position {position} has no token in "
            f"the tokenizer of {self.source} (it would be dropped)")

  def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Ids of ``text``; a character the tokenizer would silently drop (no token and
    no unknown token covers it) is refused with UnknownTextError."""
    self._check_characters(text)
    return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

  def encode_prompt(self, prompt: str, *, system: str | None = None) -> list[int]:
    """The prompt's ids as the policy sees them (template, or plain text + bos)."""
    return self.encode_messages(self.messages(prompt, system))

  def encode_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """A conversation's ids before the assistant's turn (template, or plain text + bos)."""
    if self.chat_template is not None:
      return self.encode(self.render_prompt(messages))
    ids = self.encode(self.render_prompt(messages), add_special_tokens=True)
    if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
      ids = [self.bos_id, *ids]
    return ids

  def decode(self, ids: Iterable[int]) -> str:
    """Text of ``ids`` up to the first stop token or negative id (the end marker of
    ``generate`` outputs), special tokens skipped. Ids past the tokenizer's vocabulary
    (a model's embedding table is often padded beyond it) decode to nothing."""
    kept = []
    stops = set(self.eos_ids)
    size = self.vocab_size
    for token in (int(i) for i in ids):
      if token < 0 or token in stops:
        break
      if token < size:
        kept.append(token)
    return self.tokenizer.decode(kept, skip_special_tokens=True)

  # ------------------------------------------------------------------ saving

  def save(self, path: str | os.PathLike) -> None:
    """Writes tokenizer.json and tokenizer_config.json (loadable by transformers'
    AutoTokenizer and by ``from_pretrained``)."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    self.tokenizer.save(os.path.join(path, TOKENIZER_FILE))
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                              **dict(self.special_tokens)}
    if self.add_bos:
      config["add_bos_token"] = True
    if self.chat_template is not None:
      config["chat_template"] = self.chat_template
    with open(os.path.join(path, TOKENIZER_CONFIG_FILE), "w", encoding="utf-8") as f:
      json.dump(config, f, indent=2, ensure_ascii=False)
    with open(os.path.join(path, GENERATION_CONFIG_FILE), "w", encoding="utf-8") as f:
      json.dump({"eos_token_id": list(self.eos_ids)}, f, indent=2)
