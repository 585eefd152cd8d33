"""What a verify of m fed tokens costs with each matrix kernel a linear can run (`verifiers.kernels`), which one
each width gets, and the cost table that makes: the machine's own, cached for hybrid's later calls.

    python -m experiments.verify_costs                      # the default verifier, best of 5 interleaved rounds
    python -m experiments.verify_costs --model tiny --rounds 1 --no-save

The kernels take turns at each m (`verifiers.cost_table.measure_verify_costs`), and each curve is the best of the
rounds, so a moment of machine load elsewhere does not count; a width gets PyTorch's own kernel unless another is
`KERNEL_MARGIN` faster. Run it with nothing else on the machine: the table it writes replaces the one
`hybrid.generate` measured on first use (3 rounds), and is what every later call runs.
"""

from __future__ import annotations

import argparse
import time

import torch

from experiments.models import MODELS, load_model
from verifiers.cost_table import PROBE_SIZES, CostTable, choose_kernels, measure_verify_costs, save_table


def main(argv=None) -> dict[str, dict]:
    p = argparse.ArgumentParser(prog="python -m experiments.verify_costs", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default", help=f"{', '.join(MODELS)} or a local checkpoint folder")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sizes", default=",".join(map(str, PROBE_SIZES)), help="comma list of fed tokens m")
    p.add_argument("--no-save", action="store_true", help="print the table without caching it for hybrid")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    sizes = tuple(int(m) for m in args.sizes.split(","))
    model, _ = load_model(args.model)
    model.to(args.device)
    start = time.perf_counter()
    curves = measure_verify_costs(model, sizes, repeats=args.rounds)
    seconds = time.perf_counter() - start
    costs, kernels = choose_kernels(curves)
    saved = not args.no_save and tuple(sorted(costs)) == PROBE_SIZES  # hybrid's table has every probe size
    if saved:
        save_table(model, CostTable(costs, kernels))
    one = curves["torch"][min(costs)]
    names = list(curves)
    where = "; cached as this machine's table" if saved else ""
    print(
        f"verify cost, best of {args.rounds} interleaved rounds in {seconds:.1f} s ({args.model}, {model.dtype}, "
        f"{args.device}, {torch.get_num_threads()} threads){where}"
    )
    print(f"| m | {' | '.join(f'{name} (ms)' for name in names)} | chosen | chosen / torch's one-token step |")
    print("|---:|" + "---:|" * len(names) + "---|---:|")
    for m in sorted(costs):
        row = " | ".join(f"{curves[name][m] * 1e3:.0f}" for name in names)
        print(f"| {m} | {row} | {kernels[m]} | {costs[m] / one:.2f} |")
    return {**curves, "chosen": kernels}


if __name__ == "__main__":
    main()
