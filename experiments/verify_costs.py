"""What a verify of m fed tokens costs, with PyTorch's own matrix kernels and with the few-row ones hybrid's
verifies use on a CPU (`verifiers.kernels`), measured interleaved on the same cache.

    python -m experiments.verify_costs                      # the default verifier, 5 rounds
    python -m experiments.verify_costs --model tiny --rounds 1

Each round measures every m once each way (`schedulers.cost_model.measure_verify_costs`); the table is the best
of the rounds, so a moment of machine load elsewhere does not count. Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse

import torch

from experiments.models import MODELS, load_model
from schedulers.cost_model import PROBE_SIZES, measure_verify_costs


def main(argv=None) -> dict[str, dict[int, float]]:
    p = argparse.ArgumentParser(prog="python -m experiments.verify_costs", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default", help=f"{', '.join(MODELS)} or a local checkpoint folder")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sizes", default=",".join(map(str, PROBE_SIZES)), help="comma list of fed tokens m")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    sizes = tuple(int(m) for m in args.sizes.split(","))
    model, _ = load_model(args.model)
    model.to(args.device)
    best = {"torch": {}, "hybrid": {}}
    for _ in range(args.rounds):
        for kernels, narrow in (("torch", False), ("hybrid", True)):
            for m, seconds in measure_verify_costs(model, sizes, repeats=1, narrow=narrow).items():
                best[kernels][m] = min(best[kernels].get(m, float("inf")), seconds)
    one = best["torch"][min(sizes)]
    print(f"verify cost, best of {args.rounds} rounds ({args.model}, {args.device}, {torch.get_num_threads()} threads)")
    print("| m | torch kernels (ms) | hybrid's (ms) | hybrid's / torch's one-token step |")
    print("|---:|---:|---:|---:|")
    for m in sizes:
        print(f"| {m} | {best['torch'][m] * 1e3:.0f} | {best['hybrid'][m] * 1e3:.0f} | {best['hybrid'][m] / one:.2f} |")
    return best


if __name__ == "__main__":
    main()
