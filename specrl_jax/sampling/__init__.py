"""Plain sampling: the decode engine (which takes speculation as an optional round
hook and knows nothing of drafters), its programs and layout, prefill and the logits
warp. ``sj.generate`` (``speculative.generate``) is the public entry point;
``generate``, ``prefill`` and ``rollout`` are also submodule names here, so the face
leaves them out."""

from specrl_jax.lazy import lazy_face

_SOURCES = {
    "EngineConfig": "engine",
    "GenerateOutput": "results",
    "PagePoolExhaustedError": "results",
    "plan_engine_memory": "memory",
    "pack": "layout",
    "clear_program_caches": "programs",
    "program_cache_info": "programs",
    "set_program_cache_size": "programs",
    "sample_tokens": "warp",
    "warped_log_probs": "warp",
}
__all__ = sorted(_SOURCES)
__getattr__, __dir__ = lazy_face(__name__, _SOURCES)
