"""Prefill: write every distinct prompt's KV into pages once, in one batched forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specrl_jax.config import SamplingParams
from specrl_jax.kv import pool as page_pool
from specrl_jax.kv.paged import PagedKV, page_size_of
from specrl_jax.models.transformer import Transformer
from specrl_jax.sampling.engine import Prompts
from specrl_jax.sampling.warp import warped_log_probs

Array = jax.Array


def prefill(model: Transformer, pool: page_pool.PagePool, kv: PagedKV, tokens_UxT: Array,
            lengths_U: Array, prompt_of_request_R: Array, last_request_U: Array,
            sampling: SamplingParams, drafter_prefill=None,
            hidden_layers: tuple[int, ...] = ()
            ) -> tuple[page_pool.PagePool, PagedKV, Prompts]:
  """Allocates pages for each prompt, runs the causal forward writing K/V into them and
  keeps the warped distribution of the first response token.

  ``kv`` supplies the (empty) page arrays; its page table is replaced for this call.
  ``drafter_prefill(prefill_kv, target_output) -> prefill_kv`` lets a drafter write its
  own layers of the same pages; ``hidden_layers`` are the target layers whose outputs
  it reads.
  """
  num_prompts, length = tokens_UxT.shape
  page_size = page_size_of(kv.k_pages[0])
  max_prompt_pages = -(-length // page_size)
  pool, table_UxM, _ = page_pool.allocate(pool, -(-lengths_U // page_size), max_prompt_pages)
  position_T = jnp.arange(length, dtype=jnp.int32)
  valid_UxT = position_T[None, :] < lengths_U[:, None]
  causal_TxT = position_T[:, None] >= position_T[None, :]
  prefill_kv = kv.replace(
      page_table_BxM=table_UxM,
      prefix_lengths_B=jnp.zeros((num_prompts,), jnp.int32),
      new_mask_BxTxT=causal_TxT[None] & valid_UxT[:, None, :],
      write_positions_BxT=jnp.where(valid_UxT, position_T[None, :], -1),
      attention_fn=kv.prefill_attention_fn or kv.attention_fn)
  out = model.forward(tokens_UxT, positions_BxT=jnp.broadcast_to(position_T, tokens_UxT.shape),
                      kv=prefill_kv, compute_logits=False, hidden_layers=hidden_layers)
  written = out.kv
  if drafter_prefill is not None:
    written = drafter_prefill(written, out)
  last_hidden_Ux1xD = jnp.take_along_axis(out.hidden, (lengths_U - 1)[:, None, None], axis=1)
  logits_UxV = model.unembed(last_hidden_Ux1xD)[:, 0]
  prompts = Prompts(page_table_UxM=table_UxM, lengths_U=lengths_U,
                    first_log_probs_UxV=warped_log_probs(logits_UxV, sampling),
                    tokens_UxT=tokens_UxT, prompt_of_request_R=prompt_of_request_R,
                    last_request_U=last_request_U)
  return pool, kv.replace(k_pages=written.k_pages, v_pages=written.v_pages), prompts
