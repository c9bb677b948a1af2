"""Package faces whose names load on first access.

A face that imported its modules eagerly would make importing any one module of a
package import all of its siblings first (speculative/'s adaptive engine pulls in sim/),
and ``import specrl_jax`` pay for rl/ and sim/. Instead each public name maps to the
module that defines it and is imported when first read; the map is one line per name,
so moving a name is a one-line change.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Mapping


def lazy_face(package: str, sources: Mapping[str, str | None]
              ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
  """``(__getattr__, __dir__)`` for ``package``.

  sources: public name -> the submodule of ``package`` defining it, or None where the
    name is itself a submodule. A name must not also be a submodule's name: importing
    that submodule binds its name on the package, hiding the lazy attribute.
  """

  def __getattr__(name: str) -> Any:
    if name not in sources:
      # AttributeError (not KeyError) lets ``from package import submodule`` fall back
      # to importing the submodule.
      raise AttributeError(f"module {package!r} has no attribute {name!r}")
    module = sources[name]
    if module is None:
      value = importlib.import_module(f"{package}.{name}")
    else:
      value = getattr(importlib.import_module(f"{package}.{module}"), name)
    setattr(sys.modules[package], name, value)  # later reads skip __getattr__
    return value

  def __dir__() -> list[str]:
    return sorted(set(vars(sys.modules[package])) | set(sources))

  return __getattr__, __dir__
