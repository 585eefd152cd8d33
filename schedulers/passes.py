"""How many denoising passes a multi-pass drafter runs: measured, per batch size."""

from __future__ import annotations


class DenoisingPasses:
    """Each number of passes is tried for STEP_TRIALS steps, then the one with the best measured tokens per second is
    used, and the runner-up retried every STEP_EXPLORE steps: more passes cost drafter time and pay only if they
    raise acceptance, which only measurement can tell. Kept per batch size: a batch's tokens per second is not a
    single row's, and its drafter forward and verify cost other shares of its step."""

    STEP_TRIALS = 8
    STEP_EXPLORE = 16

    def __init__(self):
        self.chosen = 1  # the passes of the step in flight
        self.new_pair()

    def new_pair(self) -> None:
        self.stats: dict[int, dict[int, list]] = {}  # rows -> passes -> [steps, tokens per s]
        self.ranked_steps: dict[int, int] = {}  # rows -> steps that chose passes from measurements

    def at(self, rows: int, max_steps: int) -> dict[int, list]:
        """passes -> [steps, tokens per second] at this batch size, for 1..max_steps passes."""
        return self.stats.setdefault(rows, {s: [0, 0.0] for s in range(1, max_steps + 1)})

    def choose(self, rows: int, max_steps: int) -> int:
        stats = self.at(rows, max_steps)
        untried = [s for s, (n, _) in stats.items() if n < self.STEP_TRIALS]
        if untried:
            self.chosen = untried[0]
        else:
            ranked = sorted(stats, key=lambda s: -stats[s][1])
            self.ranked_steps[rows] = self.ranked_steps.get(rows, 0) + 1
            explore = len(ranked) > 1 and self.ranked_steps[rows] % self.STEP_EXPLORE == 0
            self.chosen = ranked[1] if explore else ranked[0]
        return self.chosen

    def observe(self, rows: int, max_steps: int, tokens: float, seconds: float) -> None:
        """Fold one step's emitted tokens per second into the statistics of the passes it used at its batch size."""
        stats = self.at(rows, max_steps).get(self.chosen)
        if stats is None or seconds <= 0:
            return
        stats[0] += 1
        weight = 1 / stats[0] if stats[0] <= self.STEP_TRIALS else 0.1  # a mean while trying, then a moving one
        stats[1] += weight * (tokens / seconds - stats[1])
