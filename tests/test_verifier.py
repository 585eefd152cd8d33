"""The verifier's hidden states: what a drafter conditioned on the verifier may read, and nothing more."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import prompts, schedulers_for, verifiers

import hybrid
from drafters import Draft, DraftContext, Drafter, PromptLookupDrafter
from drafters.prompt_lookup import lookup_continuation
from verifiers.verifier import main_stream


class SpyDrafter(Drafter):
    """Records the hidden states it is shown at each step, and drafts by prompt lookup."""

    hidden_layers = (0, 1, -1)
    max_draft_len = 6

    def reset(self, ctx: DraftContext) -> None:
        self.seen = []

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        self.seen.append((ctx.input_ids.clone(), ctx.hidden_states().clone()))
        return Draft(lookup_continuation(ctx.input_ids[0], 1, 2, max_tokens)[0])


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_drafter_sees_exactly_the_states_of_the_committed_prefix(data):
    """At every step the states cover input_ids[:-1] (the newest token is not yet verified) and equal a
    fresh forward over that prefix: rejected drafts leave no trace, later tokens are never visible."""
    model = data.draw(verifiers(fresh_forward_reference=True), label="verifier")
    input_ids = data.draw(prompts(model.config.vocab_size), label="prompt")
    drafter = SpyDrafter()
    hybrid.generate(
        model,
        input_ids,
        drafter=drafter,
        scheduler=data.draw(schedulers_for(drafter)),
        max_new_tokens=data.draw(st.integers(3, 24)),
        do_sample=False,
    )
    assert drafter.seen
    for committed, states in drafter.seen:
        prefix = committed[:, :-1]
        with torch.inference_mode():
            fresh = model(prefix, output_hidden_states=True).hidden_states
        expected = torch.cat([main_stream(fresh[i]) for i in SpyDrafter.hidden_layers], dim=-1)
        assert states.shape == expected.shape
        torch.testing.assert_close(states, expected, atol=1e-4, rtol=1e-4)


def test_prompt_lookup_drafter_needs_no_states():
    assert PromptLookupDrafter.hidden_layers == ()
