"""The AR verifier: one prefill, then k drafted tokens + the bonus position scored in ONE forward.

The cache holds every committed token except the newest one (the "pending" token the verifier
has just chosen and not yet run). A verify step feeds `[pending, d_1 .. d_k]`, which yields the
verifier's distribution after each of them; after acceptance, `rollback` drops the KV of the
rejected drafts. Rollback is a crop: nothing is recomputed.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, GenerationMixin, PreTrainedModel


def check_causal_lm(model, role: str = "verifier") -> None:
    """Raise a clear error unless `model` is a decoder-only Hugging Face LM that can generate."""
    if not isinstance(model, PreTrainedModel) or not isinstance(model, GenerationMixin):
        raise TypeError(
            f"{role} must be a Hugging Face causal LM (a PreTrainedModel with generate), got {type(model).__name__}: "
            "load it with AutoModelForCausalLM.from_pretrained(...)"
        )
    if model.config.is_encoder_decoder or not model.can_generate():
        raise TypeError(
            f"{type(model).__name__} is not a decoder-only causal LM: hybrid verifies with an "
            "AutoModelForCausalLM (encoder-decoder and encoder-only models are not supported)"
        )


class Verifier:
    """Wraps any `AutoModelForCausalLM` for draft verification (batch size 1).

    Args:
        model: the verifier.
        hidden_layers: indices into the model's `hidden_states` tuple (0 = embeddings, i = output of
            layer i) whose states are kept for every cached token, concatenated on the last dim. A
            drafter that conditions on the verifier reads them through `hidden_states()`.
    """

    def __init__(self, model, hidden_layers: tuple[int, ...] = (), role: str = "verifier"):
        check_causal_lm(model, role)
        num_states = model.config.get_text_config().num_hidden_layers + 1
        bad = [i for i in hidden_layers if not -num_states <= i < num_states]
        if bad:
            raise ValueError(f"hidden_layers {bad} out of range for a model with {num_states - 1} layers")
        self.model = model
        self.hidden_layers = tuple(hidden_layers)
        self._supports_logits_to_keep = model._supports_logits_to_keep()
        self.cache: DynamicCache | None = None
        self.num_cached = 0  # tokens whose keys/values are in the cache
        self._attention_mask: torch.Tensor | None = None  # [1, num_cached]; None when the prompt has no padding
        self._next_position = 0
        self._hidden: torch.Tensor | None = None  # [1, capacity, len(hidden_layers) * hidden], rows < num_cached valid

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def next_position(self) -> int:
        """Position id the next fed token gets."""
        return self._next_position

    def new_cache(self) -> DynamicCache:
        cache = DynamicCache(config=self.model.config)
        if not cache.is_croppable:
            raise ValueError(
                f"{type(self.model).__name__} keeps state that cannot be rolled back by cropping "
                "(linear attention / recurrent layers): speculative decoding needs a croppable KV cache"
            )
        # Sliding-window layers otherwise drop states a later rollback needs (kept until the next crop).
        cache.activate_past_recording()
        return cache

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, capacity: int) -> torch.Tensor:
        """Run the prompt; return the float32 logits after its last token, shape [vocab].

        `capacity` bounds the sequence length (prompt + new tokens) so buffers are allocated once.
        """
        self.cache = self.new_cache()
        has_padding = attention_mask is not None and not bool((attention_mask == 1).all())
        if has_padding:
            # As `generate` does: pads sit at position 0 and real tokens count from 0.
            position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
            self._attention_mask = attention_mask.long()
        else:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
            self._attention_mask = None
        self.num_cached = 0
        self._hidden = None
        if self.hidden_layers:
            width = len(self.hidden_layers) * self.model.config.get_text_config().hidden_size
            self._hidden = torch.zeros(1, capacity, width, dtype=self.model.dtype, device=self.model.device)
        logits = self._forward(input_ids, position_ids, logits_to_keep=1)[-1]
        self.cache.crop(0)  # trims sliding-window layers back to their window
        return logits

    @torch.inference_mode()
    def verify(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed `tokens` [1, m] after the cache; return float32 logits [m, vocab], row i = after tokens[:, :i+1]."""
        m = tokens.shape[1]
        position_ids = torch.arange(self._next_position, self._next_position + m, device=tokens.device)[None]
        return self._forward(tokens, position_ids, logits_to_keep=0)

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` cached tokens (rejected drafts)."""
        if not 0 <= num_tokens <= self.num_cached:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_cached} cached tokens")
        self.cache.crop(-num_tokens)  # crop(0) also trims sliding-window layers back to their window
        self.num_cached -= num_tokens
        self._next_position -= num_tokens
        if self._attention_mask is not None:
            self._attention_mask = self._attention_mask[:, : self.num_cached]

    def hidden_states(self) -> torch.Tensor | None:
        """States of `hidden_layers` for every cached token: [1, num_cached, len(hidden_layers) * hidden]."""
        return None if self._hidden is None else self._hidden[:, : self.num_cached]

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        m = input_ids.shape[1]
        mask = None
        if self._attention_mask is not None:
            ones = self._attention_mask.new_ones(1, m)
            mask = torch.cat([self._attention_mask, ones], dim=1) if self.num_cached else self._attention_mask
        extra = {"logits_to_keep": logits_to_keep} if self._supports_logits_to_keep else {}
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=bool(self.hidden_layers),
            **extra,
        )
        if self._hidden is not None:
            states = torch.cat([out.hidden_states[i] for i in self.hidden_layers], dim=-1)
            self._hidden[:, self.num_cached : self.num_cached + m] = states
        if mask is not None:
            self._attention_mask = mask
        self.num_cached += m
        self._next_position = int(position_ids[0, -1]) + 1
        return out.logits[0].float()
