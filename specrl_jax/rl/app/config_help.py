"""`specrl train --help`, generated from the config dataclasses: every section and field
with its type, default and a line of doc.

A field's doc is, in order: the comment on its line or the comment lines right above it
in the class body, else a ``name: ...`` (or ``name (...): ...``) entry of the class
docstring, else the first sentence of a docstring paragraph that names it in double
backquotes. A field with none of these is listed with its type and default alone.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import re
import textwrap
from collections.abc import Iterator

from specrl_jax.rl.app.overrides import to_dict


@dataclasses.dataclass(frozen=True, kw_only=True)
class FieldHelp:
  flag: str        # --section.field
  type: str        # the annotation as written
  default: str     # JSON of the default
  doc: str         # one line, "" when the class says nothing about the field


@functools.cache
def _source_comments(cls: type) -> dict[str, str]:
  """field name -> its trailing comment, or the comment block right above it."""
  try:
    lines = textwrap.dedent(inspect.getsource(cls)).splitlines()
  except (OSError, TypeError):
    return {}
  comments, above = {}, []
  for line in lines[1:]:
    stripped = line.strip()
    if stripped.startswith("#"):
      above.append(stripped.lstrip("# ").strip())
      continue
    match = re.match(r"\s+([a-z_][a-z0-9_]*)\s*:[^=]*(=.*)?$", line)
    if match and not stripped.startswith(("def ", "return")):
      code, _, trailing = line.partition("  #")
      doc = trailing.strip() or " ".join(above)
      if doc:
        comments.setdefault(match.group(1), doc)
    above = []
  return comments


_NAME = r"(?:``)?[a-z_][a-z0-9_]*(?:``)?"
# "name: text", "a / b: text" or "name (unit): text", up to "; ", ". " or the end.
_ENTRY = re.compile(rf"(?:^|(?<=[\s;.(]))({_NAME}(?: / {_NAME})*)(?: \([^)]*\))?: (.+?)"
                    r"(?=; |\. |\.$|$)")


def _docstring_entry(cls: type, name: str) -> str:
  doc = inspect.getdoc(cls) or ""
  flat = " ".join(doc.split())
  for entry in _ENTRY.finditer(flat):
    if name in (label.strip("`") for label in entry.group(1).split(" / ")):
      return entry.group(2).strip()
  for paragraph in re.split(r"\n\s*\n", doc):
    for sentence in re.split(r"(?<=\.) ", " ".join(paragraph.split())):
      if re.search(rf"``{name}``|``--[a-z_.]*\.{name}[=`]", sentence):
        return sentence.rstrip(".")
  return ""


def field_doc(cls: type, name: str) -> str:
  return _source_comments(cls).get(name) or _docstring_entry(cls, name)


def walk(config, prefix: str = "") -> Iterator[tuple[type, FieldHelp | None]]:
  """(section class, None) for each section, then (section class, FieldHelp) for each
  of its leaf fields, depth first in declaration order."""
  cls = type(config)
  yield cls, None
  nested = []
  for field in dataclasses.fields(cls):
    value = getattr(config, field.name)
    if dataclasses.is_dataclass(value):
      nested.append((value, f"{prefix}{field.name}."))
      continue
    default = json.dumps(to_dict(value) if dataclasses.is_dataclass(value) else value,
                         default=str)
    yield cls, FieldHelp(flag=f"--{prefix}{field.name}", type=str(field.type),
                         default=default, doc=field_doc(cls, field.name))
  for value, sub_prefix in nested:
    yield from walk(value, sub_prefix)


def help_text(config, width: int = 100) -> str:
  """Every section of ``config`` (its first docstring line) and every field (flag, type,
  default as JSON, one line of doc), with ``config``'s values as the defaults."""
  lines, section_of = [], {}
  for cls, item in walk(config):
    if item is None:
      continue
    section = item.flag[2:].rpartition(".")[0] or "(top level)"
    if section not in section_of:
      summary = (inspect.getdoc(cls) or "").split("\n\n")[0]
      summary = " ".join(summary.split())
      lines.append("")
      lines.append(f"[{section}] {cls.__name__}: {textwrap.shorten(summary, width - 20)}")
      section_of[section] = cls
    lines.append(f"  {item.flag}: {item.type} = {item.default}")
    if item.doc:
      lines.append(textwrap.indent(textwrap.fill(item.doc, width - 6), "      "))
  return "\n".join(lines)
