"""Everything that touches the AR verifier's forward pass and cache."""

from verifiers.cache import CacheMemoryError, SharedCache
from verifiers.verifier import Verifier, check_causal_lm

__all__ = ["CacheMemoryError", "SharedCache", "Verifier", "check_causal_lm"]
