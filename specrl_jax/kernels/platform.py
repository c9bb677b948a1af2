"""The backend attention is chosen for: JAX's default backend, or, inside
``lowering_for``, the platform a program is being lowered for.

``jax.export`` lowers a program for TPU or GPU on a machine that has neither, and
Pallas checks block shapes, dtypes and primitives while lowering, so most errors a
device compiler would raise on the kernels show up on CPU. For that the programs must
select the platform's kernels (not interpret mode) while they are traced: that is
what the context does. Nothing it traces can run on the CPU.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

from specrl_jax.config import check

# jax.export's platform names -> jax.default_backend()'s.
LOWERING_PLATFORMS = {"tpu": "tpu", "cuda": "gpu", "rocm": "gpu"}

_target = contextvars.ContextVar("specrl_jax_lowering_platform", default=None)


def attention_backend() -> str:
  """"tpu", "gpu" or "cpu": the backend whose attention kernels programs traced now use."""
  return _target.get() or jax.default_backend()


def lowering_platform() -> str | None:
  """The backend programs are being lowered for (inside ``lowering_for``), else None."""
  return _target.get()


@contextlib.contextmanager
def lowering_for(platform: str) -> Iterator[None]:
  """Programs traced within select the attention kernels of ``platform`` (one of
  LOWERING_PLATFORMS: jax.export's names), for ``jax.export.export(...,
  platforms=[platform])``."""
  check(platform in LOWERING_PLATFORMS, "lowering_for", "platform", platform,
        f"one of {tuple(LOWERING_PLATFORMS)}")
  # JAX's trace caches do not key on this choice: cleared on the way in, so no trace
  # made for this machine is reused, and on the way out, so nothing run here after
  # reuses a trace that calls another platform's kernels.
  jax.clear_caches()
  token = _target.set(LOWERING_PLATFORMS[platform])
  try:
    yield
  finally:
    _target.reset(token)
    jax.clear_caches()
