"""A user message as token ids, the way an instruction-tuned verifier expects it."""

from __future__ import annotations

import torch


def encode_prompt(tokenizer, text: str) -> torch.Tensor:
    """[1, n] ids of `text` as a user turn through the tokenizer's chat template, or plain text when it has none."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    return tokenizer(text, return_tensors="pt")["input_ids"]
