"""What a verify step costs during a run: the machine's measured table (`verifiers.cost_table`), corrected by the
verify times the run observes.

The table is one sequence's forward of m tokens on an idle machine; sizes between are interpolated and beyond the
table extrapolated linearly.
During a run, observed verify times correct it two ways (`VerifyCostModel.observe_step`): one scale for the whole
curve (machine load changes), and a factor per batch size, since a batch of 8 rows 2 wide is not a forward of 16
positions of one sequence (each row attends to its own cache). Widths keep the table's relative costs: a factor per
width would lock in a noisy reading of a width that, costed too high, is never chosen and so never observed again.
A batch size never observed takes the factor of the nearest one observed. The two kinds of step (plain, and verifies
of drafts) can still lock in that way: a kind a scheduler has not chosen for a while is `stale`, so that it can be
tried again (`schedulers.cost_aware.CostAwareScheduler`), and its next observation corrects it further than usual.
"""

from __future__ import annotations

from verifiers.cost_table import verify_cost_table


class VerifyCostModel:
    """cost(m): expected seconds of a verify step that feeds m tokens (the pending one + m - 1 drafts);
    step_cost(rows, width): of a batched one."""

    SCALE_RATE = 0.05
    FACTOR_RATE = 0.2
    MAX_MISS = 1.5
    STALE_STEPS = 16  # steps of a batch size after which a kind of step not observed among them is `stale`
    STALE_RATE = 0.5  # how far a stale factor moves toward its next observation (in log space)
    STALE_MISS = 2.0  # and the most that observation's miss counts, either way

    def __init__(self, costs: dict[int, float]):
        self.sizes = sorted(costs)
        self.table = [costs[m] for m in self.sizes]
        self.scale = 1.0  # observed / predicted, tracked online
        # (rows, drafts verified) -> that step kind's own factor (`observe_step`)
        self.factors: dict[tuple[int, bool], float] = {}
        self.steps: dict[int, int] = {}  # rows -> steps of that batch size observed
        self.last_seen: dict[tuple[int, bool], int] = {}  # (rows, kind) -> its batch size's steps when last observed

    @classmethod
    def for_model(cls, model, use_disk_cache: bool = True) -> VerifyCostModel:
        """The cached table of this (model, dtype, device, threads), measured and cached first if there is none
        (`verifiers.cost_table.verify_cost_table`)."""
        return cls(verify_cost_table(model, use_disk_cache).costs)

    def cost(self, m: int) -> float:
        """Seconds of a verify of one sequence feeding m positions."""
        return self.step_cost(1, m)

    def step_cost(self, rows: int, width: int) -> float:
        """Seconds of a verify of `rows` sequences, each fed `width` positions (short rows padded)."""
        return self.scale * self.batch_factor(rows, width) * self._interpolate(rows * width)

    def batch_factor(self, rows: int, width: int) -> float:
        """What observed steps of this many rows took against the scaled table, kept apart for plain steps (width 1)
        and verifies of drafts: a batch's plain step, one token a row, runs other shapes than one sequence's forward
        of as many tokens and can measure far cheaper than it where the batch's verifies run as the table says, so
        one factor for both would make every verify look cheaper, or every plain step dearer, than it is. Where this
        (rows, kind) was never observed: the nearest observed batch size of the same kind, else of the other; 1
        before any."""
        if not self.factors:
            return 1.0
        drafted = width > 1
        same = [key for key in self.factors if key[1] == drafted] or list(self.factors)
        return self.factors[min(same, key=lambda key: (abs(key[0] - rows), key[0]))]

    def stale(self, rows: int, drafted: bool) -> bool:
        """Whether this batch size's steps of this kind (verifies of drafts, or plain steps) were last observed more
        than STALE_STEPS of its steps ago (or never, where steps of the batch size were). Each kind's factor is
        corrected only by its own steps, so a kind not chosen lately is costed from what it cost then: under other
        load, or in a call whose rows held other lengths of context. Costed too high, it would never be chosen again
        to be corrected."""
        steps = self.steps.get(rows, 0)
        return steps > 0 and steps - self.last_seen.get((rows, drafted), 0) > self.STALE_STEPS

    def observe(self, m: int, seconds: float) -> None:
        """Fold one measured verify of one sequence feeding m positions (`observe_step`)."""
        self.observe_step(1, m, seconds)

    def observe_step(self, rows: int, width: int, seconds: float) -> None:
        """Fold one measured verify time into the scale and the factor of this batch size and kind of step. Both
        move toward the observation in log space, the scale by SCALE_RATE of the miss (load is shared by every shape)
        and the factor by FACTOR_RATE (what is left is this step shape's own), the miss clipped to MAX_MISS either
        way so that one disturbed step moves neither far. A `stale` factor moves by STALE_RATE of a miss clipped to
        STALE_MISS: what it was last corrected to says little of now."""
        predicted = self.step_cost(rows, width)
        if predicted <= 0 or seconds <= 0:
            return
        kind = rows, width > 1
        stale = self.stale(*kind)
        limit, rate = (self.STALE_MISS, self.STALE_RATE) if stale else (self.MAX_MISS, self.FACTOR_RATE)
        miss = seconds / predicted
        if not stale:  # a stale factor's miss is its own error more than the machine's load
            self.scale *= min(max(miss, 1 / self.MAX_MISS), self.MAX_MISS) ** self.SCALE_RATE
        self.factors[kind] = self.batch_factor(rows, width) * min(max(miss, 1 / limit), limit) ** rate
        self.steps[rows] = self.steps.get(rows, 0) + 1
        self.last_seen[kind] = self.steps[rows]

    def _interpolate(self, m: int) -> float:
        sizes, table = self.sizes, self.table
        if m <= sizes[0]:
            return table[0]
        for (m0, t0), (m1, t1) in zip(zip(sizes, table), zip(sizes[1:], table[1:])):
            if m <= m1:
                return t0 + (t1 - t0) * (m - m0) / (m1 - m0)
        # Past the table (a batch feeds rows x width tokens): the mean slope of its upper half, steadier
        # than the last two noisy points.
        half = min(len(sizes) // 2, len(sizes) - 2)
        slope = (table[-1] - table[half]) / (sizes[-1] - sizes[half]) if len(sizes) > 1 else 0.0
        return table[-1] + max(slope, 0.0) * (m - sizes[-1])
