"""Everything that touches the AR verifier: its forward pass and cache, whether a model can be served, the matrix
kernels and what a forward costs here, its logits processing, its prompts, and loading the embedded one
(`verifiers.embedded`)."""

from verifiers.cache import SharedCache
from verifiers.memory import CacheMemoryError
from verifiers.support import check_causal_lm
from verifiers.verifier import Verifier

__all__ = ["CacheMemoryError", "SharedCache", "Verifier", "check_causal_lm"]
