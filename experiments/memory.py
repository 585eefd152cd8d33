"""Peak memory of `hybrid.generate` against plain `model.generate` on the same prompt.

    python -m experiments.memory --max-new-tokens 1024             # default verifier + shipped drafter
    python -m experiments.memory --model tiny --max-new-tokens 32  # the tiny random model (CI)

    python -m experiments.memory --model qwen3_5-random --max-new-tokens 64  # a verifier with state layers

Each method runs in a fresh process, so one's peak cannot hide the other's. On the CPU the figure is
the process's peak resident set while decoding (VmHWM, reset after loading so that loading's transient
copies do not count: weights, activations, caches and the Python runtime); on CUDA it is
`torch.cuda.max_memory_allocated`. Also reported: what decoding added to the memory held after loading, and for a
verifier with recurrent, linear-attention or convolution state, one row's states and what a verify records per fed
token (`verifiers.memory.state_bytes`), which the cache's memory check counts for the widest verify.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

PROMPT = "Write a Python function that checks whether a number is prime."
METHODS = ("plain", "hybrid")


def _status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}: this benchmark reads Linux's memory counters")


def current_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _status_kib("VmRSS") * 1024


def reset_peak(device: torch.device) -> None:
    """Start the peak counter afresh, so loading's transient copies do not count as decoding's."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:  # "5" resets the peak resident set (VmHWM), Linux >= 4.0
            f.write("5")


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _status_kib("VmHWM") * 1024


def measure(method: str, model_name: str, max_new_tokens: int, device: str) -> dict:
    """Load, decode once with `method`, and report memory (run in a process of its own)."""
    import hybrid
    from experiments.models import load_with_drafter
    from verifiers.prompts import encode_prompt

    torch.set_grad_enabled(False)
    model, tokenizer, drafter = load_with_drafter(model_name, device)
    input_ids = encode_prompt(tokenizer, PROMPT).to(model.device)
    loaded = current_bytes(model.device)
    reset_peak(model.device)
    # min_new_tokens: both methods decode exactly max_new_tokens, whatever the model says about stopping.
    settings = {"max_new_tokens": max_new_tokens, "min_new_tokens": max_new_tokens, "do_sample": False}
    if method == "plain":
        out = model.generate(input_ids, **settings)
    else:
        out = hybrid.generate(model, input_ids, drafter=drafter, **settings)
    from verifiers.memory import state_bytes

    live, per_token = state_bytes(model)
    return {
        "method": method,
        "device": str(model.device),
        "new_tokens": out.shape[1] - input_ids.shape[1],
        "loaded_bytes": loaded,
        "peak_bytes": peak_bytes(model.device),
        "state_bytes_per_row": live,
        "recorded_bytes_per_token": per_token,
    }


def run_child(method: str, args) -> dict:
    command = [
        sys.executable,
        "-m",
        "experiments.memory",
        "--child",
        method,
        "--model",
        args.model,
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--device",
        args.device,
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"the {method} run failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.memory", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="default", help="default (verifier + shipped drafter), tiny, or a checkpoint folder"
    )
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    if args.child:
        print(json.dumps(measure(args.child, args.model, args.max_new_tokens, args.device)))
        return {}
    runs = {method: run_child(method, args) for method in METHODS}
    mib = 2**20
    print(f"{args.model} model, {args.max_new_tokens} new tokens, {runs['plain']['device']}:")
    for method, r in runs.items():
        print(
            f"  {method:<7} peak {r['peak_bytes'] / mib:8.1f} MiB   after loading {r['loaded_bytes'] / mib:8.1f} MiB   "
            f"added by decoding {(r['peak_bytes'] - r['loaded_bytes']) / mib:7.1f} MiB   ({r['new_tokens']} tokens)"
        )
    ratio = runs["hybrid"]["peak_bytes"] / runs["plain"]["peak_bytes"]
    print(f"  hybrid / plain peak: {ratio:.3f}x")
    states = runs["hybrid"]
    if states["state_bytes_per_row"]:
        print(
            f"  recurrent/conv states: {states['state_bytes_per_row'] / mib:.2f} MiB per row, and a verify records "
            f"{states['recorded_bytes_per_token'] / mib:.2f} MiB per fed token of a row until it settles"
        )
    return {"runs": runs, "ratio": ratio}


if __name__ == "__main__":
    main()
