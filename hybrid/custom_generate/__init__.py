"""hybrid as transformers' `custom_generate` (see `generate.py`); `hybrid.export` writes the served folder."""

from hybrid.custom_generate.generate import DRAFTER_NAMES, build_drafter, cached_drafter, generate

__all__ = ["DRAFTER_NAMES", "build_drafter", "cached_drafter", "generate"]
