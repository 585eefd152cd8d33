"""What a verify of m fed tokens costs with each matrix kernel a linear can run (`verifiers.kernels`), which one
each width gets, and the cost table that makes: the machine's own, cached for hybrid's later calls.

    python -m experiments.verify_costs                      # the default verifier, best of 5 interleaved rounds
    python -m experiments.verify_costs --model tiny --rounds 1 --no-save
    python -m experiments.verify_costs --model qwen3_5-random --sizes 1,2,3,5,9,17 --no-save

For a model with recurrent, linear-attention or convolution state, a second table sets what hybrid runs (a verify that
records the state after each fed token through the one-token kernel, `verifiers.state_layers`) beside the layer's
chunked kernel over the same m tokens (no per-token states) and m one-token steps, as `generate` decodes them.

The kernels take turns at each m (`verifiers.cost_table.measure_verify_costs`), and each curve is the best of the
rounds, so a moment of machine load elsewhere does not count; a width gets PyTorch's own kernel unless another is
`KERNEL_MARGIN` faster. Run it with nothing else on the machine: the table it writes replaces the one
`hybrid.generate` measured on first use (3 rounds), and is what every later call runs.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import DynamicCache

from experiments.models import MODELS, load_model
from verifiers.cost_table import (
    CONTEXT,
    PROBE_SIZES,
    CostTable,
    choose_kernels,
    measure_verify_costs,
    save_table,
)
from verifiers.support import keeps_states

STATE_PATHS = ("recorded", "chunked", "steps")


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
    if not keeps_states(model):
        return {**curves, "chosen": kernels}
    paths = measure_state_paths(model, sizes, args.rounds)
    step = paths["steps"][1]
    print(f"\nstate layers: a verify of m tokens three ways, best of {args.rounds} interleaved rounds (ms)")
    print("| m | recorded (hybrid's verify) | chunked kernel | m one-token steps | recorded / step | chunked / step |")
    print("|---:|---:|---:|---:|---:|---:|")
    for m in sizes:
        recorded, chunked, steps = (paths[path][m] for path in STATE_PATHS)
        print(
            f"| {m} | {recorded * 1e3:.1f} | {chunked * 1e3:.1f} | {steps * 1e3:.1f} | {recorded / step:.2f} | "
            f"{chunked / step:.2f} |"
        )
    return {**curves, "chosen": kernels, "state_paths": paths}


@torch.inference_mode()
def measure_state_paths(model, sizes, rounds: int) -> dict[str, dict[int, float]]:
    """Seconds of feeding m tokens after a CONTEXT-token prefill, per path and m, the least of `rounds` interleaved
    rounds: `recorded` (recurrent_states_to_keep = m: the one-token kernel per token, the state after each kept),
    `chunked` (the layer's chunked kernel, the final state only) and `steps` (m one-token forwards)."""
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (1, CONTEXT), generator=generator).to(model.device)
    prefilled = DynamicCache(config=model.config)
    model(context, cache=prefilled, use_cache=True)
    best = {path: {m: float("inf") for m in sizes} for path in STATE_PATHS}
    for turn in range(rounds + 1):  # the first round warms up
        for m in sizes:
            tokens = torch.randint(0, vocab, (1, m), generator=generator).to(model.device)
            for path in STATE_PATHS if turn % 2 else STATE_PATHS[::-1]:
                cache = copy.deepcopy(prefilled)
                if path == "recorded" and m > 1:
                    cache.activate_past_recording(recurrent_states_to_keep=m)
                start = time.perf_counter()
                if path == "steps":
                    for i in range(m):
                        model(tokens[:, i : i + 1], cache=cache, use_cache=True)
                else:
                    model(tokens, cache=cache, use_cache=True)
                if turn:
                    best[path][m] = min(best[path][m], time.perf_counter() - start)
    return best


if __name__ == "__main__":
    main()
