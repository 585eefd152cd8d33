"""Schedulers: the arithmetic of the cost-aware choice, calibration, cost measurement, bad input."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from strategies import tiny_model
from transformers import LogitsProcessorList

import hybrid
import schedulers.cost_aware
import schedulers.cost_model
import schedulers.prior
from drafters import ChainDrafter, Draft, DraftContext, Drafter, PromptLookupDrafter
from drafters.base import DraftError, check_draft
from experiments.scheduler_prior import learn_prior
from schedulers import (
    AcceptanceModel,
    ConfidenceScheduler,
    CostAwareScheduler,
    FixedScheduler,
    Scheduler,
    VerifyCostModel,
)
from schedulers.calibrated import expected_accepted, pair_fingerprint
from schedulers.prior import PRIOR_FILE, PRIOR_OBSERVATIONS, write_prior
from schedulers.step_costs import StepCosts
from verifiers.cost_table import measure_verify_costs
from verifiers.kernels import KERNELS
from verifiers.verifier import static_width


def draft(k, confidence=None):
    return Draft(torch.zeros(k, dtype=torch.long), confidence=None if confidence is None else torch.tensor(confidence))


def test_expected_accepted_is_sum_of_survival_products():
    assert expected_accepted([0.5, 0.5, 1.0]) == pytest.approx([0.0, 0.5, 0.75, 1.0])


def test_cost_aware_picks_the_rate_maximising_k():
    """a_i = 0.9 everywhere; verify cost 1 + 0.25 (m - 1): rate (1 + 9(1 - 0.9^k)) / (1 + k/4) peaks at k = 6 (2.087 vs 2.082 at 5, 2.071 at 7)."""
    s = CostAwareScheduler(costs={1: 1.0, 17: 5.0})
    s.start(PromptLookupDrafter(max_draft_len=16))
    s.acceptance.tried[:] = 1e6  # make the calibration say exactly 0.9 at every position
    s.acceptance.accepted[:] = 0.9e6
    d = draft(16)
    rates = s.expected_rates(d)
    assert s.choose([d]) == [max(range(17), key=rates.__getitem__)] == [6]


def test_cost_aware_batch_picks_one_width_for_all_rows():
    """Rows of 16 and 2 drafts, a_i = 0.9; one forward of m tokens costs 1 + 0.25 (m - 1). Width w emits
    (1 + E(w)) + (1 + E(min(w, 2))) tokens, E(w) = 0.9 + ... + 0.9^w, in 1 + 0.25 (2(w + 1) - 1) s:
    2.41 tokens/s at w = 2, 2.17 at 1, 2.24 at 3. Alone, the long row would verify 6 (test above)."""
    s = CostAwareScheduler(costs={1: 1.0, 17: 5.0})
    s.start(PromptLookupDrafter(max_draft_len=16))
    s.acceptance.tried[:] = 1e6
    s.acceptance.accepted[:] = 0.9e6
    rates = s.expected_batch_rates([draft(16), draft(2)])
    assert rates[:4] == pytest.approx([1.6, 2.171, 2.409, 2.236], abs=1e-3)
    assert s.choose([draft(16), draft(2)]) == [2, 2]
    # A row with nothing drafted is still padded to the width: (2 + E(w)) / (1 + 0.25 (2w + 1)) peaks at w = 1.
    assert s.choose([draft(16), draft(0)]) == [1, 0]
    assert s.choose([draft(16)]) == [6]  # batch 1: the batch-1 rule


def test_cost_aware_charges_the_padded_width_on_the_static_path():
    """Same case as above, but verifies padded to 1, 2, 4, 8, 16, 17 positions (the static path): k = 6 costs a
    forward of 8 like k = 7, which accepts more, so 7 is chosen (rate (1 + 9(1 - 0.9^7)) / (1 + 7/4) = 2.071);
    the engine's own static path tells the scheduler so."""
    s = CostAwareScheduler(costs={1: 1.0, 17: 5.0})
    s.start(PromptLookupDrafter(max_draft_len=16), verify_width=lambda m, rows=1: static_width(m, 17))
    s.acceptance.tried[:] = 1e6
    s.acceptance.accepted[:] = 0.9e6
    assert s.expected_rates(draft(16))[7] == pytest.approx(2.071, abs=1e-3)
    assert s.choose([draft(16)]) == [7]
    widths = []
    model = tiny_model("llama", 48, 2, seed=0)

    class Recording(CostAwareScheduler):
        def start(self, drafter, **call):
            super().start(drafter, **call)
            widths.append(self.verify_width)  # what the engine tells it

    scheduler = Recording(costs={1: 1.0, 17: 5.0})
    hybrid.generate(
        model,
        torch.tensor([[1, 2, 3]]),
        drafter=PromptLookupDrafter(max_draft_len=8),
        scheduler=scheduler,
        max_new_tokens=2,
        cache_implementation="static",
    )
    assert [widths[0](m) for m in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 9]


def test_verify_cost_extrapolates_past_the_table_with_the_upper_half_slope():
    costs = VerifyCostModel({1: 1.0, 2: 3.0, 3: 2.0, 4: 2.5, 5: 3.0})  # upper half (3..5): slope 0.5
    assert costs.cost(9) == pytest.approx(3.0 + 0.5 * 4)


def test_cost_aware_declines_hopeless_drafts_but_keeps_probing_from_its_credit():
    """Acceptance 0: verifying 1 node costs 1.25 s against 1 s for the pending token alone and brings nothing, a loss
    of 0.25 s. The credit grows by EXPLORE_SHARE (2%) of each step's seconds, so the first probe (at the cheapest
    positive k) comes once 13 steps have paid for it, and the run is at most 2% slower than declining throughout."""
    s = CostAwareScheduler(costs={1: 1.0, 17: 5.0})
    s.start(PromptLookupDrafter(max_draft_len=16))
    s.acceptance.tried[:] = 1e6  # acceptance 0: verifying anything only costs
    choices, seconds = [], 0.0
    for _ in range(200):
        (k,) = s.choose([draft(8)])
        choices.append(k)
        verify = s.costs.verify_costs.cost(1 + k)  # as predicted: the costs stay what they are
        seconds += verify
        s.observe([draft(8).truncate(k)], [[]], [0.0], verify)
    assert set(choices) == {0, 1} and choices.index(1) == 13
    assert 14 <= choices.count(1) <= 16 and seconds <= 1.02 * 200


def test_a_batch_values_the_tokens_of_the_rows_that_finish_last():
    """Row 0 drafted 4 nodes (a_i = 0.9), row 1 nothing; 2 rows x 2 wide cost 1.2 s against 1 s for 2 x 1. Rows level:
    (2 + 0.9) / 1.2 beats 2 / 1.0, so row 0 verifies. Row 0 needing a tenth of row 1's steps: its token is worth 0.1,
    (0.1 x 1.9 + 1) / 1.2 loses to 1.1 / 1.0, so neither does (the call ends with row 1 either way)."""
    s = CostAwareScheduler(costs={1: 1.0, 2: 1.0, 4: 1.2, 17: 5.0})
    s.start(PromptLookupDrafter(max_draft_len=16))
    s.acceptance.tried[:] = 1e6
    s.acceptance.accepted[:] = 0.9e6
    s.worth.set_rows([10.0, 10.0])
    assert s.choose([draft(4), draft(0)]) == [1, 0]
    s.worth.set_rows([1.0, 10.0])
    assert s.choose([draft(4), draft(0)]) == [0, 0]


def test_the_engine_tells_the_scheduler_each_rows_expected_steps_left():
    told = []

    class Recording(Scheduler):
        def plan_step(self, steps_left):
            told.append(steps_left)
            return super().plan_step(steps_left)

    model = tiny_model("llama", 48, 2, seed=0)
    prompt = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 4, 1, 2, 3, 4]])
    out = hybrid.generate(
        model, prompt, drafter=PromptLookupDrafter(max_draft_len=4), scheduler=Recording(), max_new_tokens=6
    )
    assert torch.equal(out, model.generate(prompt, max_new_tokens=6, do_sample=False))
    assert told[0] == [5.0, 5.0]  # after the prefill's token, 5 more at 1 token a step so far
    assert all(len(rows) in (1, 2) and all(left > 0 for left in rows) for rows in told)


def test_the_credit_saved_at_one_batch_size_pays_for_no_probe_at_another():
    """1,000 declined one-second steps at batch 1 save 20 s of credit; at batch 8, where a probe loses far less than
    that, none is taken until batch-8 steps have paid for one."""
    s = CostAwareScheduler(costs={1: 1.0, 17: 5.0})
    s.start(PromptLookupDrafter(max_draft_len=16))
    s.acceptance.tried[:] = 1e6  # acceptance 0
    for _ in range(1000):
        s.observe([draft(8).truncate(0)], [[]], [0.0], 1.0)
    assert s.choose([draft(8)] * 8) == [0] * 8
    assert s.choose([draft(8)]) == [1]  # batch 1's own credit does pay for its probe
    for _ in range(100):  # a batch of r rows earns EXPLORE_SHARE / r of its seconds
        s.observe([draft(8).truncate(0)] * 4, [[]] * 4, [0.0] * 4, 2.0)
    assert s.exploration.credit[4] == pytest.approx(100 * 2.0 * s.exploration.EXPLORE_SHARE / 4)


def test_a_probe_is_charged_what_it_lost_not_what_its_estimate_said():
    """Acceptance 0.2: verifying 1 node (1.25 s) is estimated at 1.2 tokens, 0.05 s worse than declining (1 token in
    1 s). A probe of it that keeps nothing lost 0.25 s, and that is what the credit pays; one that keeps its node
    brought 2 tokens in 1.25 s, and the credit gains the 0.75 s declining would have taken longer for them."""
    s = CostAwareScheduler(costs={1: 1.0, 17: 5.0})
    s.start(PromptLookupDrafter(max_draft_len=16))
    s.acceptance.tried[:] = 1e6
    s.acceptance.accepted[:] = 0.2e6
    s.exploration.credit[1] = 1.0
    assert s.choose([draft(8)]) == [1]
    s.observe([draft(1)], [[]], [0.0], 1.25)
    assert s.exploration.credit[1] == pytest.approx(1.0 + s.exploration.EXPLORE_SHARE * 1.25 - 0.25)
    credit = s.exploration.credit[1]
    assert s.choose([draft(8)]) == [1]
    s.observe([draft(1)], [[0]], [0.0], 1.25)
    assert s.exploration.credit[1] == pytest.approx(credit + s.exploration.EXPLORE_SHARE * 1.25 + (2 / 1.0 - 1.25))


def test_a_plain_step_not_timed_lately_is_retried_where_drafts_win_narrowly():
    """Acceptance 0.5: verifying 1 node is estimated at 1.5 tokens in 1.25 s, 20% ahead of a plain step (1 token in
    1 s as last timed). While plain steps are timed, drafts are verified; once none was for STALE_STEPS steps, one
    is taken from the credit, and it is found to take 0.6 s: corrected at once (by STALE_RATE, not FACTOR_RATE of the
    miss), it wins outright."""
    s = CostAwareScheduler(costs={1: 1.0, 17: 5.0})
    s.start(PromptLookupDrafter(max_draft_len=16))
    s.acceptance.tried[:] = 1e6
    s.acceptance.accepted[:] = 0.5e6
    for _ in range(3):
        s.observe([draft(8).truncate(0)], [[]], [0.0], 1.0)
    s.exploration.credit[1] = 1.0
    assert s.choose([draft(8)]) == [1]
    for _ in range(s.costs.verify_costs.STALE_STEPS + 1):
        s.observe([draft(1)], [[0]], [0.0], 1.25)
    assert s.costs.verify_costs.stale(1, drafted=False) and not s.costs.verify_costs.stale(1, drafted=True)
    credit = s.exploration.credit[1]
    best = max(s.expected_rates(draft(8)))  # 1.5 / 1.25 as the call's correction scales it
    assert s.choose([draft(8)]) == [0] and s.exploration.credit[1] == pytest.approx(credit - (1.0 - 1 / best))
    s.observe([draft(8).truncate(0)], [[]], [0.0], 0.6)
    assert s.costs.verify_costs.step_cost(1, 1) == pytest.approx(0.6**s.costs.verify_costs.STALE_RATE)
    s.exploration.credit[1] = 0.0  # nothing left to probe drafts with: the estimates' own choice
    assert s.expected_rates(draft(8))[0] > max(s.expected_rates(draft(8))[1:]) and s.choose([draft(8)]) == [0]


def test_a_kind_of_step_not_timed_lately_is_corrected_further_by_its_next_step():
    """Plain steps of 4 rows timed at twice the table's cost, then STALE_STEPS + 1 verifies of drafts: the plain kind
    is stale, and its next step, at a quarter of its estimate, moves it by STALE_RATE of a miss clipped to
    STALE_MISS, leaving the shared scale where it was."""
    curve = VerifyCostModel({1: 1.0, 4: 1.0, 8: 1.0})
    for _ in range(50):
        curve.observe_step(4, 1, 2.0)
    for _ in range(curve.STALE_STEPS + 1):
        curve.observe_step(4, 2, 1.0)
    assert curve.stale(4, drafted=False) and not curve.stale(4, drafted=True) and not curve.stale(2, drafted=False)
    before, scale = curve.step_cost(4, 1), curve.scale
    curve.observe_step(4, 1, before / 4)
    assert curve.step_cost(4, 1) == pytest.approx(before / curve.STALE_MISS**curve.STALE_RATE)
    assert curve.scale == scale and not curve.stale(4, drafted=False)


def test_confidence_scheduler_cuts_where_whole_prefix_probability_drops_below_threshold():
    s = ConfidenceScheduler(threshold=0.5)
    s.start(PromptLookupDrafter(max_draft_len=8))
    s.acceptance.tried[:] = 1e6
    s.acceptance.accepted[:] = 0.8e6  # 0.8, 0.64, 0.512, 0.41: three stay above 0.5
    assert s.choose([draft(8)]) == [3]


class _StepsDrafter(PromptLookupDrafter):
    max_steps = 3


def test_cost_aware_tries_each_number_of_passes_then_keeps_the_fastest():
    s = CostAwareScheduler(costs={1: 1.0, 17: 5.0})
    s.start(_StepsDrafter(max_draft_len=4))
    rate = {1: 2.0, 2: 3.0, 3: 1.0}  # tokens per second each number of passes yields
    trials = s.passes.STEP_TRIALS
    chosen = []
    for _ in range(3 * trials + 2 * s.passes.STEP_EXPLORE):
        steps = s.plan([1.0]).denoising_steps
        chosen.append(steps)
        s.observe([draft(2)], [[0]], [0.0], 2 / rate[steps])
    assert chosen[: 3 * trials] == [1] * trials + [2] * trials + [3] * trials
    after = chosen[3 * trials :]
    assert after.count(2) == len(after) - 2 and after.count(1) == 2  # the best, and the runner-up now and then
    one_pass = CostAwareScheduler(costs={1: 1.0, 17: 5.0})
    one_pass.start(PromptLookupDrafter())
    assert {one_pass.plan([1.0]).denoising_steps for _ in range(20)} == {1}


def test_passes_are_compared_on_steps_whose_verified_nodes_they_shaped():
    """A chain of a lookup and a multi-pass stage: a step that verified only the lookup's nodes says nothing of the
    passes (they changed none of them), so it counts toward no pass count's tokens per second; one that verified the
    second stage's nodes counts."""
    s = CostAwareScheduler(costs={1: 1.0, 17: 5.0})
    s.start(ChainDrafter([PromptLookupDrafter(max_draft_len=4), _StepsDrafter(max_draft_len=4)]))
    assert s.pass_stages == {1}
    for _ in range(3 * s.passes.STEP_TRIALS):
        assert s.plan([1.0]).denoising_steps == 1  # still untried
        s.observe([staged(3, 0)], [[0, 1, 2]], [0.0], 1.0)
    assert all(steps == 0 for steps, _ in s.passes.at(1, s.max_steps).values())
    s.observe([staged(1, 2)], [[0, 1]], [0.0], 1.0)
    assert s.passes.at(1, s.max_steps)[1] == [1, 3.0]  # 2 accepted + the verifier's token in 1 s


def test_each_batch_size_chooses_its_own_passes():
    """A batch's tokens per second is not a row's, and its drafter forwards cost other shares of its step: passes
    are tried and ranked per batch size. Here two pay at batch 1, one at batch 4."""
    s = CostAwareScheduler(costs={1: 1.0, 4: 1.0, 17: 5.0})
    s.start(_StepsDrafter(max_draft_len=4))
    rate = {1: {1: 2.0, 2: 3.0, 3: 1.0}, 4: {1: 8.0, 2: 4.0, 3: 4.0}}
    trials = s.passes.STEP_TRIALS
    chosen = {1: [], 4: []}
    for _ in range(3 * trials + 1):
        for rows in (1, 4):
            s.worth.set_rows([1.0] * rows)
            steps = s.passes.choose(rows, s.max_steps)  # the passes alone: no stage choice declines a step here
            chosen[rows].append(steps)
            s.observe([draft(2)] * rows, [[0]] * rows, [0.0] * rows, 2 * rows / rate[rows][steps])
    for rows, best in ((1, 2), (4, 1)):
        assert chosen[rows] == [1] * trials + [2] * trials + [3] * trials + [best]


def test_fixed_scheduler_steps_are_checked_against_the_drafter():
    with pytest.raises(ValueError, match=r"steps=0 must be a positive int"):
        FixedScheduler(2, steps=0)
    with pytest.raises(ValueError, match=r"steps=4 but _StepsDrafter runs at most 3 denoising passes"):
        FixedScheduler(2, steps=4).start(_StepsDrafter())
    s = FixedScheduler(2, steps=2)
    s.start(_StepsDrafter())
    assert s.plan([1.0]).denoising_steps == 2
    s = FixedScheduler(2)
    s.start(_StepsDrafter())
    assert s.plan([1.0]).denoising_steps == 3  # the drafter's own number


def test_calibration_learns_per_confidence_bin():
    model = AcceptanceModel(4)
    for _ in range(200):
        model.update(draft(2, [0.95, 0.95]), accepted=[0, 1])  # confident drafts: accepted
        model.update(draft(2, [0.05, 0.05]), accepted=[])  # unconfident ones: rejected at once
    high, low = model.predict(draft(2, [0.95, 0.95])), model.predict(draft(2, [0.05, 0.05]))
    assert high[0] > 0.98 and low[0] < 0.02
    assert model.tried[1, 0] == 0  # a position after a rejection was never tried


def test_a_discounted_calibration_keeps_its_rates_with_at_most_so_many_observations():
    model = AcceptanceModel(2)
    model.tried[0, 3], model.accepted[0, 3] = 1000.0, 800.0
    model.tried[1, 3], model.accepted[1, 3] = 10.0, 2.0
    prior = model.discounted(32)
    assert prior.tried[0, 3] == pytest.approx(32) and prior.accepted[0, 3] == pytest.approx(25.6)
    assert prior.tried[1, 3] == 10 and prior.accepted[1, 3] == 2  # already fewer: as they are


def test_calibration_file_round_trip_and_mismatch(tmp_path):
    s = CostAwareScheduler(costs={1: 1.0, 17: 3.0})
    model = tiny_model("llama", 64, 1, seed=0)
    prompt = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    drafter = PromptLookupDrafter()
    hybrid.generate(model, prompt, drafter=drafter, scheduler=s, max_new_tokens=30)
    path = tmp_path / "calibration.json"
    s.save_calibration(path)
    loaded = CostAwareScheduler(calibration=str(path), costs={1: 1.0, 17: 3.0})
    loaded.start(drafter, model=model)
    assert torch.equal(loaded.acceptance.tried, s.acceptance.tried)
    other = tiny_model("qwen2", 80, 1, seed=0)
    with pytest.raises(ValueError, match="was measured for .* not for"):
        CostAwareScheduler(calibration=str(path)).start(drafter, model=other)
    with pytest.raises(ValueError, match="cannot read calibration file"):
        CostAwareScheduler(calibration=str(tmp_path / "missing.json")).start(drafter, model=model)
    assert json.loads(path.read_text())["fingerprint"] == pair_fingerprint(drafter, model)


def test_verify_cost_measures_a_sliding_window_model():
    # The probe's context (64 tokens) is longer than the window: the crops after each probe must still work.
    curves = measure_verify_costs(tiny_model("mistral", 40, 1, seed=0, sliding_window=4), sizes=(1, 2, 5), repeats=1)
    assert set(curves) == set(KERNELS)
    assert all(
        set(costs) == {1, 2, 5} and all(0 < t < float("inf") for t in costs.values()) for costs in curves.values()
    )


def test_verify_cost_is_measured_and_rescaled():
    costs = measure_verify_costs(tiny_model("llama", 64, 1, seed=0), sizes=(1, 5), repeats=1)["torch"]
    assert set(costs) == {1, 5} and all(t > 0 for t in costs.values())
    curve = VerifyCostModel({1: 1.0, 5: 2.0})
    assert curve.cost(3) == pytest.approx(1.5) and curve.cost(9) == pytest.approx(3.0)
    for _ in range(200):
        curve.observe(3, 3.0)  # the machine got twice as slow
    assert curve.cost(3) == pytest.approx(3.0, rel=1e-3)


def test_verify_cost_learns_each_batch_size_on_top_of_the_shared_scale():
    """A batch of 8 rows is not a forward of 8 x width positions of one sequence: observed, its steps end up
    predicted as they run, every width of it keeping the table's relative cost; a batch size never observed takes
    the nearest observed one's factor, and one disturbed step moves the factor by at most 1.5^0.2."""
    curve = VerifyCostModel({1: 1.0, 8: 1.0, 16: 1.1, 17: 2.0})
    for _ in range(100):
        curve.observe_step(8, 2, 1.32)
    assert curve.step_cost(8, 2) == pytest.approx(1.32, rel=1e-3)
    assert curve.step_cost(8, 1) == pytest.approx(1.32 / 1.1, rel=1e-3)
    assert curve.step_cost(6, 1) == pytest.approx(curve.step_cost(8, 1) * curve._interpolate(6) / 1.0)
    before = curve.step_cost(8, 2)
    curve.observe_step(8, 2, 100.0)  # a step the machine was busy elsewhere during
    assert curve.step_cost(8, 2) <= before * 1.5**0.25 * (1 + 1e-9)


def test_a_batch_learns_its_plain_steps_apart_from_its_verifies():
    """A batch's plain step (one token a row) and its verifies of drafts differ from the table by different
    factors: each is learned from its own kind, so a cheap plain step does not make a wide verify look cheap."""
    curve = VerifyCostModel({1: 1.0, 4: 1.2, 16: 2.0})
    for _ in range(100):
        curve.observe_step(4, 1, 0.8)  # plain: cheaper than the table's 1.2
        curve.observe_step(4, 4, 2.4)  # 4 x 4 tokens: dearer than the table's 2.0
    assert curve.step_cost(4, 1) == pytest.approx(0.8, rel=0.02)
    assert curve.step_cost(4, 4) == pytest.approx(2.4, rel=0.02)
    assert curve.step_cost(4, 2) / curve.step_cost(4, 4) == pytest.approx(curve._interpolate(8) / 2.0)
    assert curve.step_cost(2, 1) / curve.step_cost(4, 1) == pytest.approx(curve._interpolate(2) / 1.2)


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_bad_threshold(bad):
    with pytest.raises(ValueError, match="threshold"):
        ConfidenceScheduler(bad)


@pytest.mark.parametrize("k", [0, 17, 2.5])
def test_bad_fixed_k(k):
    with pytest.raises(ValueError, match="draft length k"):
        FixedScheduler(k).start(PromptLookupDrafter(max_draft_len=16))


def test_the_default_scheduler_lets_its_verifier_be_freed():
    """The default scheduler is kept per verifier by weak reference: nothing it holds may keep the model alive."""
    import gc
    import weakref

    import hybrid
    from hybrid.testing import tiny_model

    model = tiny_model("llama", 32, 1, seed=0)
    for static in (None, "static"):
        hybrid.generate(
            model,
            torch.tensor([[1, 2, 3]]),
            drafter=PromptLookupDrafter(),
            max_new_tokens=4,
            cache_implementation=static,
        )
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_each_decoding_learns_its_own_calibration():
    """A drafted token matches a sampled choice less often than the argmax: `generate` tells the scheduler how it
    chooses (its settings that shape the distribution, and a rule other than "match"), and the default scheduler
    keeps one calibration per decoding, so sampled calls leave the greedy calls' estimates as they were."""
    told = []

    class Recording(Scheduler):
        def start(self, drafter, *, decoding=None, **call):
            told.append(decoding)
            super().start(drafter, decoding=decoding, **call)

    model = tiny_model("llama", 48, 2, seed=0)
    prompt = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    drafter = PromptLookupDrafter(max_draft_len=4)
    for settings in ({}, {"do_sample": True, "temperature": 0.7, "top_p": 0.9}):
        hybrid.generate(model, prompt, drafter=drafter, scheduler=Recording(), max_new_tokens=4, **settings)
    hybrid.generate(
        model,
        prompt,
        drafter=drafter,
        scheduler=Recording(),
        max_new_tokens=4,
        do_sample=True,
        temperature=1.5,
        acceptance="rejection",
    )
    assert told[0] == {}
    assert told[1]["temperature"] == 0.7 and told[1]["top_p"] == 0.9 and "acceptance" not in told[1]
    assert told[2]["temperature"] == 1.5 and told[2]["acceptance"] == "rejection"

    greedy = schedulers.cost_aware.default_scheduler(drafter, model)
    hybrid.generate(model, prompt, drafter=drafter, max_new_tokens=12)
    acceptance, tried = greedy.acceptance, greedy.acceptance.tried.clone()
    assert acceptance.fingerprint["decoding"] == {}
    hybrid.generate(model, prompt, drafter=drafter, max_new_tokens=12, do_sample=True, temperature=0.7)
    assert greedy.acceptance is acceptance and torch.equal(acceptance.tried, tried)
    (sampled,) = [s for s in schedulers.cost_aware._DEFAULTS[model].values() if s is not greedy]
    assert sampled.acceptance.fingerprint["decoding"]["temperature"] == 0.7


def test_a_sampled_decoding_without_a_prior_of_its_own_takes_the_nearest_temperatures(tmp_path):
    """Priors measured greedily and at T 0.7 and 1.0: T 0.8 starts from 0.7's, T 1.5 from 1.0's, greedy from the
    greedy one, and speculative sampling's rule (no entry of its own) from the greedy one; another drafter from none."""
    pair = pair_fingerprint(PromptLookupDrafter(max_draft_len=4), None)
    path = tmp_path / "a-drafter" / PRIOR_FILE
    path.parent.mkdir()
    for decoding in ({}, {"temperature": 0.7}, {"temperature": 1.0}):
        write_prior(
            path,
            {
                "fingerprint": pair | {"decoding": decoding},
                "tried": [],
                "accepted": [],
                "stage_tokens": [],
                "stage_width": [],
                "batches": {},
            },
        )

    def measured(decoding):
        found = schedulers.prior.shipped_prior(pair | {"decoding": decoding}, root=tmp_path)
        return found[1]["fingerprint"]["decoding"]

    assert measured({}) == {}
    assert measured({"temperature": 0.8, "top_k": 50}) == {"temperature": 0.7}
    assert measured({"temperature": 1.5}) == {"temperature": 1.0}
    assert measured({"temperature": 1.0, "acceptance": "rejection"}) == {}
    other = pair_fingerprint(PromptLookupDrafter(max_draft_len=8), None)
    assert schedulers.prior.shipped_prior(other, root=tmp_path) is None


# --------------------------------------------------------------------------- drafting stages: which drafters run


class _Counting(Drafter):
    """Proposes token 1 up to its budget (where nothing came before it), counting the rows it drafted."""

    max_draft_len = 4

    def __init__(self):
        self.rows = 0

    def propose(self, ctx, max_tokens):
        self.rows += 1
        return Draft(torch.ones(max_tokens, dtype=torch.long))


class _CountingLookup(PromptLookupDrafter):
    rows = 0

    def propose(self, ctx, max_tokens):
        self.rows += 1
        return super().propose(ctx, max_tokens)


def staged(k_lookup, k_second):
    """A draft of `k_lookup` nodes from stage 0, then `k_second` from stage 1."""
    return Draft(
        torch.zeros(k_lookup + k_second, dtype=torch.long), stage=torch.tensor([0] * k_lookup + [1] * k_second)
    )


def test_chain_drafter_runs_the_stages_asked_for_and_names_each_nodes_stage():
    second = _Counting()
    chain = ChainDrafter([PromptLookupDrafter(max_ngram=2, max_draft_len=4), second])
    assert chain.stages == tuple(chain.sources) and second.stages == (second,)
    matched = DraftContext(torch.tensor([[5, 6, 7, 5, 6]]), False, LogitsProcessorList(), None, None)
    unmatched = DraftContext(torch.tensor([[1, 2, 3, 4, 9]]), False, LogitsProcessorList(), None, None)
    drafts = chain.propose_rows([chain, chain], [matched, unmatched], [4, 4])
    assert drafts[0].stage_list() == [0, 0, 0] and drafts[0].tokens.tolist() == [7, 5, 6]  # the match: the lookup's
    assert drafts[1].stage_list() == [1, 1, 1, 1] and second.rows == 1  # nothing to copy: the second stage's
    unmatched.stages = matched.stages = 1
    drafts = chain.propose_rows([chain, chain], [matched, unmatched], [4, 4])
    assert [len(d) for d in drafts] == [3, 0] and second.rows == 1  # the second stage did not run
    kept = drafts[0].truncate(1)
    assert kept.stage_list() == [0] and check_draft(staged(1, 2), 3, 8, "x").stage_list() == [0, 1, 1]
    with pytest.raises(DraftError, match=r"returned stage \(2,\); expected a \(3,\) integer tensor or None"):
        check_draft(Draft(torch.zeros(3, dtype=torch.long), stage=torch.zeros(2, dtype=torch.long)), 3, 8, "x")


class _Unsure(Drafter):
    """Proposes tokens 7, 8, 9, 10 with confidences 0.9, 0.6, 0.2, 0.9."""

    max_draft_len = 4

    def propose(self, ctx, max_tokens):
        return Draft(
            torch.tensor([7, 8, 9, 10])[:max_tokens], confidence=torch.tensor([0.9, 0.6, 0.2, 0.9])[:max_tokens]
        )


class _Filling(Drafter):
    """Continues any draft with token 1 up to its budget."""

    max_draft_len = 4

    def propose(self, ctx, max_tokens):
        return Draft(torch.ones(max_tokens, dtype=torch.long))

    def fill(self, ctx, given, max_tokens):
        return Draft(torch.cat([given.tokens, torch.ones(max_tokens - len(given), dtype=torch.long)]))


def test_a_later_stage_refills_an_earlier_ones_unsure_tail():
    """With refill_below 0.5 the second stage continues the first's draft from before its first node of confidence
    < 0.5 (9); a row drafted by the first stage alone, or asked for no more than the sure part, keeps its draft."""
    ctx = DraftContext(torch.tensor([[1, 2, 3]]), False, LogitsProcessorList(), None, None)
    chain = ChainDrafter([_Unsure(), _Filling()], refill_below=0.5)
    assert chain.propose(ctx, 4).tokens.tolist() == [7, 8, 1, 1]
    assert chain.propose(ctx, 4).stage_list() == [0, 0, 1, 1]
    assert chain.propose(ctx, 2).tokens.tolist() == [7, 8]
    assert ChainDrafter([_Unsure(), _Filling()]).propose(ctx, 4).tokens.tolist() == [7, 8, 9, 10]  # 0: never
    assert chain.fork().refill_below == 0.5 and chain.fingerprint.endswith("| refill below 0.5")
    ctx.stages = 1
    assert chain.propose(ctx, 4).tokens.tolist() == [7, 8, 9, 10]
    for bad in (-0.1, 1.5, "0.3", True):
        with pytest.raises(ValueError, match="refill_below must be a confidence in"):
            ChainDrafter([_Unsure(), _Filling()], refill_below=bad)


def test_cost_aware_scales_a_calls_estimates_by_what_its_own_steps_accepted_against_them():
    """The calibration says 0.9 at every position (pooled over calls); this call's text accepts nothing. After one
    step that drafted 6 nodes (4.22 tokens predicted, 0 accepted) the call's correction is 8 / (8 + 4.22), its
    later steps expect that share of the calibration's tokens and verify fewer nodes; the next call starts at 1."""
    s = CostAwareScheduler(costs={1: 1.0, 17: 5.0})
    s.start(PromptLookupDrafter(max_draft_len=16))
    s.acceptance.tried[:] = 1e6
    s.acceptance.accepted[:] = 0.9e6
    d = draft(16)
    assert s.worth.call_factor() == 1.0 and s.choose([d]) == [6]
    s.observe([d.truncate(6)], [[]], [0.0], 1.0)
    predicted = sum(0.9**i for i in range(1, 7))
    factor = s.worth.CALL_PRIOR_TOKENS / (s.worth.CALL_PRIOR_TOKENS + predicted)
    assert s.worth.call_factor() == pytest.approx(factor, rel=1e-4)
    cost = s.costs.verify_costs.step_cost
    scaled = [(1 + min(factor * sum(0.9**i for i in range(1, k + 1)), k)) / cost(1, k + 1) for k in range(17)]
    assert s.expected_rates(d) == pytest.approx(scaled, rel=1e-4)
    (k,) = s.choose([d])
    assert k == max(range(17), key=scaled.__getitem__) < 6
    s.observe([d.truncate(k)], [[0]], [0.0], 1.0)  # the step this scheduler selected: 1 accepted of its prediction
    s.observe([d.truncate(k)], [[0]], [0.0], 1.0)  # an update no selection preceded folds nothing in
    total = predicted + sum(0.9**i for i in range(1, k + 1))
    assert s.worth.call_factor() == pytest.approx(
        (1 + s.worth.CALL_PRIOR_TOKENS) / (s.worth.CALL_PRIOR_TOKENS + total), rel=1e-4
    )
    s.start(PromptLookupDrafter(max_draft_len=16))
    assert s.worth.call_factor() == 1.0


def test_cost_aware_learns_what_each_stage_adds_from_the_nodes_it_proposed():
    """One step: 2 lookup nodes then 3 of the second stage, the walk accepting 0, 1 (the lookup's) and 2 (the second
    stage's). The lookup alone would have accepted 2 in a verify 3 wide; both stages 3 in a verify 6 wide."""
    s, chain = (
        CostAwareScheduler(costs={1: 1.0, 17: 5.0}),
        ChainDrafter([PromptLookupDrafter(max_draft_len=4), _Counting()]),
    )
    s.start(chain)
    assert s.plan([1.0]).drafting_stages == 2  # nothing known: a tie, which goes to running every stage
    s.observe([staged(2, 3)], [[0, 1, 2]], [0.5], 1.0)
    verified_then = s.costs.verify_costs.step_cost(1, 6)  # what that verify was costed at when it ran
    entry = s.prior_entry()
    assert entry["stage_tokens"] == [0.0, 2.0, 3.0] and entry["stage_width"] == [1.0, 3.0, 6.0]
    # Two rows, the second with nothing to copy: per row, the lookup brings 1 token, both stages 2.5; the widest row
    # needs 1 + 2 and 1 + 5 positions. Two stages cost 0.5 s of drafting; the lookup alone was never run: free.
    # A batch of 2 is costed from what batches of 2 did, not from the step of 1 before it.
    s.observe([staged(2, 3), staged(0, 4)], [[0, 1, 2], [0, 1]], [0.25, 0.25], 1.0)
    s.start(chain)  # a new call: what the batch sizes learned, none of its own steps yet
    rates = s.expected_stage_rates(2)
    cost = s.costs.verify_costs.step_cost
    assert rates == pytest.approx([2 / cost(2, 1), 2 * (1 + 1.0) / cost(2, 3), 2 * (1 + 2.5) / (0.5 + cost(2, 6))])
    # A batch of 3 starts from the nearest batch size seen (2), its drafting scaled by the rows.
    assert s.expected_stage_rates(3)[2] == pytest.approx(3 * (1 + 2.5) / (0.75 + cost(3, 6)))
    assert s.expected_stage_rates(1)[2] == pytest.approx((1 + 3.0) / (0.5 + verified_then))


def test_a_stage_is_costed_at_the_mean_of_its_verifies_not_at_its_mean_width():
    """A lookup whose steps verify 1 position (nothing matched) or 17 (a repeated passage, 2 accepted), half the time
    each, with a verify costing 1 s at width 1, 2 s at 2 and 2.5 s at 17: its steps took (1 + 2.5) / 2 = 1.75 s for
    2 tokens, faster than declining (1 token in 1 s). Costed at its mean width (9: 2.23 s) it would look slower
    (0.9 tokens/s) and be dropped."""
    s = CostAwareScheduler(costs={1: 1.0, 2: 2.0, 17: 2.5})
    s.start(PromptLookupDrafter(max_draft_len=16))
    for i in range(200):
        nodes = 16 * (i % 2)
        s.observe([draft(nodes)], [list(range(min(nodes, 2)))], [0.0], s.costs.verify_costs.cost(1 + nodes))
    assert s.gains.at(1)[1][2] == pytest.approx(9, rel=0.05)  # the mean width
    assert s.expected_stage_rates(1)[1] == pytest.approx(2 / 1.75, rel=0.05) and s.plan([1.0]).drafting_stages == 1


def test_cost_aware_drops_a_stage_whose_forward_does_not_pay_and_keeps_probing_it():
    """The lookup's 2 nodes are accepted (3 tokens in a verify of 3: 1.5 s); the second stage's 2 more too (5 tokens
    in a verify of 5: 2 s). With its forward costing 4 s, the lookup alone wins (3 / 1.51 s against 5 / 6.01 s):
    running both loses 6.01 - 5 / (3 / 1.51) = 3.49 s, paid from a credit of 2% of every step's seconds (0.03 s a
    step), so both run again about once in 116 steps. Costing 0.01 s, both win (5 / 2.02 s) at every step."""

    def run(second_cost, steps):
        s = CostAwareScheduler(costs={1: 1.0, 17: 5.0})
        s.start(ChainDrafter([PromptLookupDrafter(max_draft_len=4), _Counting()]))
        chosen = []
        for _ in range(steps):
            n = s.plan([1.0]).drafting_stages
            chosen.append(n)
            draft = staged(2, 2 if n == 2 else 0)
            verify = s.costs.verify_costs.cost(1 + len(draft))  # as predicted: the costs stay what they are
            s.observe([draft], [[0, 1, 2, 3] if n == 2 else [0, 1]], [0.01 + (second_cost if n == 2 else 0)], verify)
        return chosen

    chosen = run(second_cost=4.0, steps=400)
    assert chosen[:2] == [2, 1]  # both first (a tie), then the lookup alone (never timed: free), now timed
    probes = [i for i, n in enumerate(chosen) if n == 2][1:]
    assert len(probes) == 3 and all(100 < later - earlier < 130 for earlier, later in zip([0, *probes], probes))
    assert run(second_cost=0.01, steps=40) == [2] * 40


def test_engine_runs_only_the_stages_the_scheduler_asks_for():
    """Output is the verifier's whatever runs: all stages, the lookup alone, or no drafting at all."""

    class Stages(Scheduler):
        def __init__(self, n):
            self.n = n

        def plan_step(self, steps_left):
            return dataclasses.replace(super().plan_step(steps_left), drafting_stages=self.n)

    model = tiny_model("llama", 48, 2, seed=0)
    prompt = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6, 9, 10]])
    expected = model.generate(prompt, max_new_tokens=12, do_sample=False)
    for n, second_rows in [(2, True), (1, False), (0, False)]:
        second, lookup = _Counting(), _CountingLookup(max_ngram=2, max_draft_len=4)
        out = hybrid.generate(
            model, prompt, drafter=ChainDrafter([lookup, second]), scheduler=Stages(n), max_new_tokens=12
        )
        assert torch.equal(out, expected)
        assert (second.rows > 0) == second_rows and (lookup.rows > 0) == (n > 0)
    with pytest.raises(ValueError, match=r"Stages\.drafting_stages returned 3; expected 0\.\.2"):
        hybrid.generate(model, prompt, drafter=ChainDrafter([lookup, second]), scheduler=Stages(3), max_new_tokens=4)


# --------------------------------------------------------------------------- cold start: the shipped prior


FLAT = {1: 1.0, 17: 1.0}  # a verify costs the same at every width: every stage and node is worth verifying


def test_a_scheduler_starts_from_the_shipped_prior_for_its_pair(tmp_path, monkeypatch):
    """What a warmed scheduler learned, written by the prior command's function and found beside a checkpoint, is
    where a fresh scheduler for the same drafter and verifier starts; another pair starts uninformed."""
    # The verify costs stay FLAT: steps timed on this machine would decide, by the load of the moment, whether the
    # batches draft at all.
    monkeypatch.setattr(schedulers.cost_model.VerifyCostModel, "observe_step", lambda *args: None)
    model = tiny_model("llama", 48, 2, seed=0)
    drafter = ChainDrafter([PromptLookupDrafter(max_ngram=2, max_draft_len=4), _Counting()])
    prompts = [torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]]), torch.tensor([[9, 3, 9, 3, 9, 3, 4]])]
    batch = (torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6], [0, 9, 3, 9, 3, 9, 3, 4]]), torch.ones(2, 8, dtype=torch.long))
    batch[1][1, 0] = 0
    warmed = learn_prior(model, drafter, prompts, max_new_tokens=60, costs=FLAT, batches=[batch] * 2, batch_tokens=30)
    path = tmp_path / "some-drafter" / PRIOR_FILE
    path.parent.mkdir()
    write_prior(path, warmed.prior_entry())
    write_prior(path, warmed.prior_entry())  # rewriting replaces the pair's entry
    assert len(json.loads(path.read_text())["priors"]) == 1
    monkeypatch.setattr(schedulers.prior, "CHECKPOINTS", tmp_path)

    fresh = CostAwareScheduler(costs=FLAT)
    fresh.start(drafter, model=model)
    assert fresh.prior == path
    warmed.costs = StepCosts(FLAT)  # seconds are the machine's, not the prior's
    assert torch.allclose(fresh.acceptance.tried, warmed.acceptance.tried.clamp(max=PRIOR_OBSERVATIONS))
    for d in (staged(3, 1), draft(4, [0.9, 0.9, 0.2, 0.2]), draft(4)):
        assert fresh.acceptance.predict(d) == pytest.approx(warmed.acceptance.predict(d), abs=0.03)
        assert fresh.choose([d]) == warmed.choose([d])
    assert fresh.prior_entry()["stage_tokens"] == warmed.prior_entry()["stage_tokens"]
    # A batch of 2 starts from what the prior's batches of 2 measured, not from batch 1's figures.
    assert fresh.prior_entry()["batches"] == warmed.prior_entry()["batches"]
    assert set(warmed.prior_entry()["batches"]) == {"2"} and warmed.worth.saved[2][1] > 0
    assert [tokens for _, tokens, _ in fresh.gains.at(2)] == warmed.prior_entry()["batches"]["2"]["stage_tokens"]
    fresh.worth.set_rows([10.0, 10.0])
    realized, promised = warmed.worth.saved[2]
    assert realized < promised and fresh.worth.batch_worth() == pytest.approx(
        realized / promised
    )  # the prior's, unshrunk

    uninformed = CostAwareScheduler(costs=FLAT, prior=False)
    uninformed.start(drafter, model=model)
    assert uninformed.prior is None and float(uninformed.acceptance.tried.sum()) == 0
    other = CostAwareScheduler(costs=FLAT)
    other.start(PromptLookupDrafter(max_ngram=2, max_draft_len=4), model=model)  # another drafter: no prior of its own
    assert other.prior is None and float(other.acceptance.tried.sum()) == 0
    assert hybrid.generate(model, prompts[0], drafter=drafter, max_new_tokens=4).shape[1] == 12  # the default: too

    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot read scheduler prior .*: rebuild it with `python -m experiments"):
        CostAwareScheduler(costs=FLAT).start(drafter, model=model)


def test_a_declined_stage_is_probed_by_the_next_stage_up():
    """Three stages whose nodes were never accepted: declining wins. A probe paid from the credit runs the lookup
    alone (the cheapest, and the only one whose estimate a declined step leaves stale), not every stage; where the
    lookup wins, the probe adds the second stage."""
    s = CostAwareScheduler(costs={1: 1.0, 17: 5.0})
    s.start(ChainDrafter([PromptLookupDrafter(max_draft_len=4), _Counting(), _Counting()]))
    s.gains.by_rows[1] = [[1, 0.0, 1.0], [100, 0.0, 3.0], [100, 0.0, 5.0], [100, 0.0, 7.0]]
    assert s.plan([1.0]).drafting_stages == 0  # no credit yet
    s.exploration.credit[1] = 10.0
    assert s.plan([1.0]).drafting_stages == 1 and s.exploration.credit[1] == pytest.approx(
        10.0 - 0.5
    )  # verifying 3 wide loses 0.5 s
    s.gains.by_rows[1] = [[1, 0.0, 1.0], [100, 2.0, 3.0], [100, 2.0, 5.0], [100, 2.0, 7.0]]
    assert s.expected_stage_rates(1) == pytest.approx([1.0, 2.0, 1.5, 1.2])
    assert s.plan([1.0]).drafting_stages == 2


def test_stage_estimates_are_not_scaled_by_the_calls_correction():
    """A stage's T_n is measured on the recent steps, this call's among them: the call's correction of the
    calibration (here 0.5, its steps accepting a tenth of what was predicted) scales what a draft is predicted to
    accept, not what the stages measured."""
    s = CostAwareScheduler(costs={1: 1.0, 17: 5.0})
    s.start(ChainDrafter([PromptLookupDrafter(max_draft_len=4), _Counting()]))
    s.gains.by_rows[1] = [[1, 0.0, 1.0], [100, 2.0, 3.0], [100, 2.5, 5.0]]
    before = s.expected_stage_rates(1)
    s.worth.call_predicted, s.worth.call_accepted = 100.0, 10.0
    assert s.worth.call_factor() == 0.5 and s.expected_stage_rates(1) == pytest.approx(before)


def test_a_stage_chosen_on_another_batch_sizes_estimate_is_corrected_by_its_own_steps():
    """Batch 1 learned that the lookup pays (its 2 nodes accepted); at batch 4 nothing it drafts is accepted. Steps
    that run the lookup alone measure it, so within a few steps batch 4 stops drafting (it would otherwise go on
    trusting batch 1's figure, as only a step running every stage, paid from an empty credit, could correct it)."""
    s = CostAwareScheduler(costs={1: 1.0, 4: 1.0, 12: 1.2, 17: 5.0})
    s.start(ChainDrafter([PromptLookupDrafter(max_draft_len=4), _Counting()]))
    s.gains.by_rows[1] = [[1, 0.0, 1.0], [100, 2.0, 3.0], [100, 2.0, 3.0]]
    s.costs.draft_cost[1] = [[0, 0.0], [100, 0.001], [100, 1.0]]  # the second stage dear: the lookup alone wins
    chosen = []
    for _ in range(40):
        n = s.plan([1.0] * 4).drafting_stages
        chosen.append(n)
        drafts = [staged(2, 2 if n == 2 else 0) if n else staged(0, 0)] * 4
        ks = s.choose(drafts)
        drafts = [d.truncate(k) for d, k in zip(drafts, ks)]
        width = 1 + max(map(len, drafts))
        s.observe(drafts, [[] for _ in drafts], [0.001 * (n > 0)] * 4, s.costs.verify_costs.step_cost(4, width))
    assert chosen[0] == 1 and chosen[-10:] == [0] * 10


# --------------------------------------------------------------------------- batches: what a call's steps save


def test_a_batch_size_counts_the_steps_its_calls_saved_against_what_their_tokens_promised():
    """A call of 2 rows: step 1 (rows level) accepts 2 and 0 nodes, step 2 (row 0 ahead: weights 8/9 and 1) one each,
    so its weighted tokens promise 2 / 2 + (8/9 + 1) / (17/9) = 2 steps saved; its rows emit 2 and 3 tokens after
    the first, which plain decoding takes 3 steps for, so it saved 1. The next call of 2 rows counts a drafted token
    at (1 + 8) / (2 + 8) of its weight; batch 1 at its full weight."""
    s = CostAwareScheduler(costs={1: 1.0, 17: 5.0})
    s.start(PromptLookupDrafter(max_draft_len=16))
    s.acceptance.tried[:] = 1e6
    s.acceptance.accepted[:] = 0.9e6
    assert s.worth.batch_worth() == 1.0
    s.worth.set_rows([10.0, 10.0])
    assert s.worth.batch_worth() == 1.0  # nothing counted yet at 2 rows
    s.observe([draft(2), draft(2)], [[0, 1], []], [0.0, 0.0], 1.0)
    s.worth.set_rows([8.0, 9.0])
    s.observe([draft(2), draft(2)], [[0], [0]], [0.0, 0.0], 1.0)
    s.finish([2, 3], 1.0)
    worth = (1 + s.worth.SAVED_PRIOR) / (2 + s.worth.SAVED_PRIOR)
    s.start(PromptLookupDrafter(max_draft_len=16))
    s.worth.set_rows([10.0, 10.0])
    assert s.worth.batch_worth() == pytest.approx(worth)
    cost = s.costs.verify_costs.step_cost
    e = [sum(0.9**i for i in range(1, k + 1)) for k in range(5)]
    expected = [(2 + min(worth * e[w], w) + min(worth * e[min(w, 2)], min(w, 2))) / cost(2, w + 1) for w in range(5)]
    assert s.expected_batch_rates([draft(4), draft(2)]) == pytest.approx(expected, rel=1e-4)
    s.observe([draft(2), draft(2)], [[], []], [0.0, 0.0], 1.0)  # a call that promised nothing counts nothing
    s.finish([4, 4], 1.0)
    s.start(PromptLookupDrafter(max_draft_len=16))
    s.worth.set_rows([10.0])
    assert s.worth.batch_worth() == 1.0  # batch 1: a token saves its step
    s.worth.set_rows([10.0, 10.0])  # the call's batch size is set by its first step
    assert s.worth.batch_worth() == 1.0
    s.start(PromptLookupDrafter(max_draft_len=16))
    s.worth.set_rows([10.0, 10.0])
    s.observe([draft(2), draft(2)], [[0, 1], [0, 1]], [0.0, 0.0], 1.0)  # promised 2 steps, and saved them
    s.finish([3, 3], 1.0)
    s.worth.set_rows([10.0, 10.0])
    realized, promised = s.worth.SAVED_DECAY * 1 + 2, s.worth.SAVED_DECAY * 2 + 2  # earlier calls count less
    assert s.worth.batch_worth() == pytest.approx((realized + s.worth.SAVED_PRIOR) / (promised + s.worth.SAVED_PRIOR))


def test_a_lone_row_counts_its_tokens_whole_and_a_batch_shrinks_toward_the_shipped_prior():
    """Once the other rows of a call of 2 have finished, the row left is the call's last: each token it accepts saves
    a step, so it counts at full weight and is kept out of what the batch's weighted tokens promised. Where a shipped
    prior measured calls of 2 saving 60% of what their tokens promised, a batch size with few calls of its own is
    shrunk toward that, not toward 1."""
    s = CostAwareScheduler(costs={1: 1.0, 17: 5.0})
    s.start(PromptLookupDrafter(max_draft_len=16))
    s.worth.set_rows([10.0, 10.0])
    s.observe([draft(2), draft(2)], [[0], []], [0.0, 0.0], 1.0)  # promised 1 / 2 step
    s.finish([1, 0], 1.0)  # the second row ended at once: every row but one finished
    s.start(PromptLookupDrafter(max_draft_len=16))
    s.worth.set_rows([10.0, 10.0])
    s.observe([draft(2), draft(2)], [[0, 1], []], [0.0, 0.0], 1.0)  # promises 1
    s.worth.set_rows([6.0])
    assert s.worth.batch_worth() == 1.0  # the row left: its tokens are steps
    s.observe([draft(2)], [[0, 1]], [0.0], 1.0)  # saves 2 steps, counted apart
    s.finish([7, 1], 1.0)  # 7 tokens after the first in 2 steps: saved 5 - 2 alone = 3 at 2 rows, against 1 promised
    s.worth.set_rows([10.0, 10.0])
    assert s.worth.saved[2] == pytest.approx([s.worth.SAVED_DECAY * 0 + 3, s.worth.SAVED_DECAY * 0.5 + 1])
    s.worth.shipped_worth = {2: 0.6, 8: 0.4}
    realized, promised = s.worth.saved[2]
    assert s.worth.batch_worth() == pytest.approx(
        min((realized + 0.6 * s.worth.SAVED_PRIOR) / (promised + s.worth.SAVED_PRIOR), 1.0)
    )
    s.worth.saved = {}
    assert s.worth.batch_worth() == pytest.approx(0.6)
    s.start(PromptLookupDrafter(max_draft_len=16))
    s.worth.set_rows([10.0] * 6)
    assert s.worth.batch_worth() == pytest.approx(0.4)  # the nearest batch size the prior measured


def test_a_batch_call_drafts_from_its_first_call_and_counts_what_its_steps_saved():
    """The default scheduler drafts in the first call of 2 rows (each row's drafter proposes `generate`'s own
    continuation of that row, cut short); after it, the steps it saved and its weighted accepted tokens are what the
    engine's steps reported. The output is `generate`'s."""
    model = tiny_model("llama", 48, 2, seed=0)
    prompt = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 4, 1, 2, 3, 4]])
    expected = model.generate(prompt, max_new_tokens=12, do_sample=False)
    steps, promised, alone = [], [], []

    class RowOracle(Drafter):
        max_draft_len = 3

        def propose(self, ctx, max_tokens):
            committed, row = ctx.input_ids[0], expected[ctx.row]
            n = committed.shape[0]
            return Draft(row[n : n + min(max_tokens, 1 + n % 3)])  # 1-3 right tokens, so rows advance unevenly

    class Recording(CostAwareScheduler):
        def observe(self, drafts, accepted, draft_times, verify_time):
            weights = self.worth.row_weights(len(drafts))
            steps.append(len(drafts))
            if len(drafts) > 1:  # a lone row's tokens are steps saved, not promises
                promised.append(sum(w * len(kept) for w, kept in zip(weights, accepted)) / sum(weights))
            else:
                alone.append(sum(map(len, accepted)))
            super().observe(drafts, accepted, draft_times, verify_time)

    scheduler = Recording(costs=FLAT)
    out = hybrid.generate(model, prompt, drafter=RowOracle(), scheduler=scheduler, max_new_tokens=12)
    assert torch.equal(out, expected)
    assert sum(promised) > 0 and len(steps) < 11
    assert scheduler.worth.saved[2] == pytest.approx([11 - len(steps) - sum(alone), sum(promised)])
