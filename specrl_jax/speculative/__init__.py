"""Speculative decoding: drafting a tree, lossless verification, the speculative round,
catch-up of idle drafters and adaptive draft length; the drafters live in
``speculative.drafters``; ``speculative.generate`` is ``sj.generate``, which dispatches
to plain, speculative or adaptive generation. ``generate``, ``rollout`` and ``verify``
are also submodule names here, so the face leaves those functions out."""

from specrl_jax.lazy import lazy_face

_SOURCES = {
    "ConcurrencyAwareController": "concurrency",
    "DraftLengthController": "adaptive",
    "DraftTree": "drafting",
    "Speculation": "rollout",
    "TreeTopology": "topology",
    "Verdict": "verify",
    "catch_up_drafter": "catch_up",
    "choose_children": "drafting",
    "draft_tree": "drafting",
    "generate_adaptive": "adaptive_generate",
    "speculative_round": "round",
}
__all__ = sorted(_SOURCES)
__getattr__, __dir__ = lazy_face(__name__, _SOURCES)
