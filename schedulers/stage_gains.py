"""What each drafting stage adds: the tokens its nodes bring and the verify width they need, per batch size."""

from __future__ import annotations

from drafters.base import Draft
from schedulers.estimates import fold, nearest_size


class StageGains:
    """T_n and W_n per batch size: the mean accepted tokens per row the first n stages' nodes bring (weighted by what
    a token of each row is worth), and the widest row's verify width they need. Batch sizes start from the shipped
    prior's figures (worth PRIOR_STEPS steps), batch 1 uninformed without one; a batch size neither seen nor in the
    prior reads the nearest one seen. No stage (n = 0) brings nothing and verifies the pending token alone."""

    PRIOR_STEPS = 8  # what the shipped prior's stage statistics count as: the run's own steps soon outweigh them

    def __init__(self, num_stages: int, prior: dict | None):
        self.num_stages = num_stages
        # rows -> n stages -> [steps, accepted tokens per row, verify width] of the nodes of the first n stages
        self.by_rows: dict[int, list[list[float]]] = {1: self._none()}
        if prior is not None:
            self._start_from(prior)

    def _start_from(self, prior: dict) -> None:
        """Each batch size's figures from the shipped prior. A batch of 8 verifies less of each row than one of 1, so
        borrowing batch 1's figures would make a one-shot batch call draft at a loss until its own steps corrected
        them."""
        stages = {1: (prior["stage_tokens"], prior["stage_width"])}
        stages |= {int(rows): (b["stage_tokens"], b["stage_width"]) for rows, b in prior["batches"].items()}
        for rows, (tokens, widths) in stages.items():
            if len(tokens) == self.num_stages + 1:
                self.by_rows[rows] = [[self.PRIOR_STEPS, t, w] for t, w in zip(tokens, widths)]

    def _none(self) -> list[list[float]]:
        return [[1, 0.0, 1.0]] + [[0, 0.0, 1.0] for _ in range(self.num_stages)]  # no stage: the pending token alone

    def at(self, rows: int) -> list[list[float]]:
        """[steps, T_n, W_n] per n at this batch size; for an n never measured at it, the nearest batch size's."""
        own = self.by_rows.get(rows)
        gain = []
        for n in range(self.num_stages + 1):
            measured = [r for r, stats in self.by_rows.items() if stats[n][0]]
            if own is not None and own[n][0] or not measured:
                gain.append((own or self.by_rows[1])[n])
            else:
                gain.append(self.by_rows[nearest_size(measured, rows)][n])
        return gain

    def observe(
        self, drafts: list[Draft], accepted: list[list[int]], stages_run: int, weights: list[float], moving: float
    ) -> list[int]:
        """Fold one step that ran `stages_run` stages into T_n and W_n for every n up to them, at its batch size, and
        return those W_n. A step that ran n stages measures every m <= n, since a stage's nodes never parent the
        earlier stages' nor change which of those are accepted (`Draft.stage`): the option chosen is always corrected
        by its outcome (an estimate only stages that were not run could correct would lock a losing choice in)."""
        gain = self.by_rows.setdefault(len(drafts), self._none())
        stages = [draft.stage_list() for draft in drafts]
        widths = []
        for n in range(1, stages_run + 1):
            kept = [sum(stage[node] < n for node in nodes) for stage, nodes in zip(stages, accepted)]
            tokens = sum(w * k for w, k in zip(weights, kept)) / sum(weights)  # the rows finishing last count most
            width = 1 + max(sum(s < n for s in stage) for stage in stages)
            fold(gain[n], tokens, width, moving=moving)
            widths.append(width)
        return widths

    def prior_entry(self, rows: int) -> dict:
        """This batch size's figures for a shipped prior (`schedulers.prior`)."""
        return {
            "stage_tokens": [tokens for _, tokens, _ in self.by_rows[rows]],
            "stage_width": [width for _, _, width in self.by_rows[rows]],
        }
