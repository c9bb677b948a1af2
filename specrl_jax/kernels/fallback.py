"""``attention="auto"`` never crashes where the reference would run: before a program
uses a Pallas kernel on an accelerator, the kernel alone is compiled at the program's
attention shapes; if that fails, the program takes the pure-JAX reference instead,
with one warning (per kernel and shape, per process) naming the kernel and the error.

The probe compiles the decode kernel with one query token and with a chain of
``PROBE_QUERY_TOKENS`` (verification), a small batch, the pool's dtype, page size and
head shapes: the parameters its block shapes and lowering depend on. An explicit
``attention="pallas"`` is never probed: asking for the kernels means failing loudly.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from specrl_jax.kernels.dispatch import resolve_attention
from specrl_jax.kernels.platform import attention_backend, lowering_platform

PROBE_QUERY_TOKENS = (1, 4)


def checked_attention(attention: str, *, num_heads: int, num_kv_heads: int, head_dim: int,
                      page_size: int, dtype: str) -> tuple[str, str | None]:
  """(the attention choice a program should use, why the kernel was dropped or None).

  "auto" becomes "reference" when its kernel fails to compile on this backend; every
  other choice, CPU, and programs being lowered for another platform are unchanged."""
  backend = attention_backend()
  if attention != "auto" or backend == "cpu" or lowering_platform() is not None:
    return attention, None
  kernel = resolve_attention("auto", backend).decode
  error = _compile_error(kernel, backend, num_heads, num_kv_heads, head_dim, page_size,
                         str(jnp.dtype(dtype)))
  return ("auto", None) if error is None else ("reference", error)


def kernel_name(kernel) -> str:
  return getattr(getattr(kernel, "func", kernel), "__name__", repr(kernel))


@functools.lru_cache(maxsize=None)
def _compile_error(kernel, backend: str, num_heads: int, num_kv_heads: int, head_dim: int,
                   page_size: int, dtype: str) -> str | None:
  """None if ``kernel`` compiles at these shapes, else "<kernel>: <error>" (warned
  once: the cache makes this run once per kernel and shape)."""
  batch, max_pages = 2, 2
  sds = jax.ShapeDtypeStruct
  pool = sds((batch * max_pages + 1, num_kv_heads, page_size, head_dim), dtype)
  try:
    for q_len in PROBE_QUERY_TOKENS:
      new = sds((batch, q_len, num_kv_heads, head_dim), dtype)
      jax.jit(kernel).lower(
          sds((batch, q_len, num_heads, head_dim), dtype), pool, pool,
          sds((batch, max_pages), jnp.int32), sds((batch,), jnp.int32), new, new,
          sds((batch, q_len, q_len), jnp.bool_)).compile()
  except Exception as error:  # noqa: BLE001 - any compile failure means: not here
    first_line = (str(error).strip().splitlines() or [""])[0][:300]
    reason = f"{kernel_name(kernel)}: {type(error).__name__}: {first_line}"
    warnings.warn(
        f'attention="auto": the Pallas kernel {reason} (compiling it on {backend} for '
        f"{num_heads} query heads, {num_kv_heads} KV heads of {head_dim}, pages of "
        f"{page_size}, {dtype}); using the pure-JAX reference attention instead, which "
        "is slower. Pass attention='pallas' to see the failure, 'reference' to silence "
        "this.", RuntimeWarning, stacklevel=2)
    return reason
  return None
