"""Everything that touches the AR verifier: its forward pass and cache, its logits processing, its prompts, and
loading the embedded one (`verifiers.embedded`)."""

from verifiers.cache import CacheMemoryError, SharedCache
from verifiers.verifier import Verifier, check_causal_lm

__all__ = ["CacheMemoryError", "SharedCache", "Verifier", "check_causal_lm"]
