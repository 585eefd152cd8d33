"""Is the scheduler's acceptance model calibrated? Predicted vs observed acceptance per block position.

    python -m experiments.calibration --dataset dev --num-prompts 8 --max-new-tokens 128

Decodes the prompts greedily with the default drafter and a `CostAwareScheduler` that learns online
across them. Before each verification it records the predicted conditional acceptance a_i of every
verified position i (the probability that draft i is accepted given drafts 1..i-1 were), then the
outcome. Prints, per position, the mean prediction and the observed rate; writes a reliability
plot (observed vs predicted, binned) and the learned calibration file, which `CostAwareScheduler(
calibration=...)` loads for this drafter/verifier pair.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import hybrid
from experiments.datasets import load_prompts
from schedulers import CostAwareScheduler
from verifiers.prompts import encode_prompt


class RecordingScheduler(CostAwareScheduler):
    """Logs (position, predicted conditional acceptance, accepted?) for every verified draft token."""

    def __init__(self):
        super().__init__(prior=False)  # measures calibration learned online, from nothing
        self.log: list[tuple[int, float, bool]] = []

    def observe(self, drafts, accepted, draft_times, verify_time):
        for draft, kept in zip(drafts, accepted):
            predicted = self.acceptance.predict(draft)  # before this step's evidence is folded in
            kept, depths = set(kept), draft.depths()
            for node, parent in enumerate(draft.parent_list()):
                if parent < 0 or parent in kept:  # a node below a rejected one was never judged
                    self.log.append((depths[node], predicted[node], node in kept))
        super().observe(drafts, accepted, draft_times, verify_time)


def reliability(log, bins: int = 10) -> list[dict]:
    """Observed acceptance per bin of predicted probability (bins of equal width)."""
    rows = []
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        cell = [(p, ok) for _, p, ok in log if lo <= p < hi or (b == bins - 1 and p == 1.0)]
        if cell:
            rows.append(
                {
                    "predicted": sum(p for p, _ in cell) / len(cell),
                    "observed": sum(ok for _, ok in cell) / len(cell),
                    "n": len(cell),
                }
            )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="dev")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default="runs/calibration")
    args = parser.parse_args(argv)
    prompts = load_prompts(args.dataset)[: args.num_prompts]

    model, tokenizer, drafter = hybrid.load_default()
    scheduler = RecordingScheduler()
    schedule_time = total_time = steps = 0
    for prompt in prompts:
        ids = encode_prompt(tokenizer, prompt)
        _, stats = hybrid.generate(
            model, ids, drafter=drafter, scheduler=scheduler, max_new_tokens=args.max_new_tokens, return_stats=True
        )
        schedule_time, total_time, steps = (
            schedule_time + stats.schedule_time,
            total_time + stats.total_time,
            steps + stats.verifier_forwards,
        )

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{args.dataset}: {len(prompts)} prompts, {len(scheduler.log)} verified draft tokens")
    print(f"{'position':>8}{'n':>7}{'predicted':>11}{'observed':>10}")
    positions = sorted({i for i, _, _ in scheduler.log})
    by_position = []
    for i in positions:
        cell = [(p, ok) for j, p, ok in scheduler.log if j == i]
        row = {
            "position": i,
            "n": len(cell),
            "predicted": sum(p for p, _ in cell) / len(cell),
            "observed": sum(ok for _, ok in cell) / len(cell),
        }
        by_position.append(row)
        print(f"{i:>8}{row['n']:>7}{row['predicted']:>11.2f}{row['observed']:>10.2f}")
    bins = reliability(scheduler.log)
    gap = sum(abs(r["predicted"] - r["observed"]) * r["n"] for r in bins) / max(len(scheduler.log), 1)
    print(f"expected calibration error (10 bins): {gap:.3f}")
    # The recording itself runs inside observe(), so this slightly overstates the scheduler's own cost.
    print(
        f"scheduler overhead: {100 * schedule_time / total_time:.2f}% of decoding time, "
        f"{1000 * schedule_time / steps:.2f} ms per step"
    )
    (out / "reliability.json").write_text(json.dumps({"by_position": by_position, "bins": bins, "ece": gap}, indent=2))
    scheduler.save_calibration(out / "calibration.json")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[experiments]')")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot([0, 1], [0, 1], "k:", label="perfect")
    left.plot([r["predicted"] for r in bins], [r["observed"] for r in bins], "o-", label="all positions")
    left.set(xlabel="predicted P(accept | earlier accepted)", ylabel="observed rate", title="reliability")
    left.legend()
    right.plot(positions, [r["predicted"] for r in by_position], "o-", label="predicted")
    right.plot(positions, [r["observed"] for r in by_position], "s-", label="observed")
    right.set(xlabel="block position", ylabel="conditional acceptance", title="per block position", ylim=(0, 1))
    right.legend()
    fig.tight_layout()
    fig.savefig(out / "reliability.png", dpi=110)
    print(f"wrote {out / 'reliability.png'}, {out / 'reliability.json'}, {out / 'calibration.json'}")


if __name__ == "__main__":
    main()
