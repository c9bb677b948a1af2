"""Pallas kernels, each tested against a pure-JAX reference (interpret=True on CPU)."""

from kernels.paged_attention import (IMPLEMENTATIONS, default_implementation, paged_attention,
                                     paged_attention_pallas)

__all__ = ["IMPLEMENTATIONS", "default_implementation", "paged_attention",
           "paged_attention_pallas"]
