"""Everything that touches the AR verifier's forward pass and cache."""

from verifiers.verifier import Verifier, check_causal_lm

__all__ = ["Verifier", "check_causal_lm"]
