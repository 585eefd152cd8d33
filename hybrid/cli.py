"""`python -m hybrid COMMAND`: answer a prompt, export a served model folder, or serve one.

`generate "PROMPT"` streams an answer from the embedded default (or `--verifier DIR`), then decodes the same prompt with plain
`model.generate` in the same process, both timed end to end around their `generate` call (hybrid.stats.timed),
so the printed speed-up compares like with like, and checks the two outputs for equality (sampled: under the
same seed). `export-served OUT` writes a model folder whose `generate` is hybrid's
(`hybrid.export`); `serve` runs `transformers serve` on one (`hybrid.serving`). A `--drafter DIR` is a trained drafter
folder, put behind lookup and the online store as `hybrid.drafter_for` puts it, after checking it was trained for the
verifier.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import TextStreamer

import hybrid
from drafters import PromptLookupDrafter
from hybrid.custom_generate import DRAFTER_NAMES, build_drafter
from hybrid.stats import timed
from verifiers.prompts import encode_prompt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="answer a prompt with the default verifier and drafter")
    gen.add_argument("prompt", help="the user message (the chat template is applied)")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--verifier", default=None, help=VERIFIER_HELP)
    gen.add_argument(
        "--drafter",
        type=drafter_choice,
        default="default",
        help="default: the shipped block-diffusion drafter with n-gram lookup and the n-gram store (another "
        "--verifier: hybrid.drafter_for's lookup and online store); block: the model without either; none: plain "
        f"decoding through the engine; {DRAFTER_FOLDER_HELP}",
    )
    gen.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--no-baseline", action="store_true", help="skip the plain model.generate comparison")
    gen.add_argument("--device", default="cpu", help="where the verifier and drafter run (cpu, cuda, cuda:1)")
    gen.add_argument(
        "--device-map",
        default=None,
        help="spread the verifier with accelerate (e.g. auto: its layers over every GPU; the drafter "
        "goes where its last layer is); replaces --device",
    )
    gen.add_argument(
        "--static",
        action="store_true",
        help="static shapes (cache_implementation='static') for both runs: compiled, with CUDA graphs, "
        "on a GPU, as model.generate compiles a static cache; each run is warmed up untimed first",
    )
    export = sub.add_parser(
        "export-served",
        help="write a model folder whose generate is hybrid's (for custom_generate, from_pretrained, transformers serve)",
    )
    export.add_argument("out", help="the folder to write")
    export.add_argument("--verifier", default=None, help=VERIFIER_HELP)
    export.add_argument(
        "--drafter",
        type=drafter_choice,
        default="default",
        help=f"one of {', '.join(DRAFTER_NAMES)} (default: hybrid.drafter_for's, with an online store), or a folder: "
        f"{DRAFTER_FOLDER_HELP}, or a causal LM sharing the verifier's tokenizer",
    )
    serve = sub.add_parser(
        "serve",
        help="an OpenAI-compatible server (transformers serve) decoding with hybrid; options after -- go to "
        "transformers serve",
    )
    serve.add_argument("model", nargs="?", default=None, help="a folder from export-served (default: the embedded one)")
    serve.add_argument("--verifier", default=None, help=VERIFIER_HELP + " (exported for serving on each start)")
    serve.add_argument(
        "--drafter",
        type=drafter_choice,
        default=None,
        help=f"the verifier's drafter: one of {', '.join(DRAFTER_NAMES)} (default: default, which keeps an online "
        f"store of the served model's answers across requests) or {DRAFTER_FOLDER_HELP}; a served folder's drafter "
        "is fixed by export-served",
    )
    serve.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda, cuda:1, auto)")
    serve.add_argument("--host", default="localhost")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--online-store",
        choices=("per-client", "shared", "off"),
        default="per-client",
        help="whose answers a request drafts from: its own client's (default; keyed by --client-header, a request "
        "without it gets no store), every client's (shared: a client can then tell from the time an answer takes "
        "whether someone else was recently given it), or none",
    )
    serve.add_argument(
        "--client-header",
        default="authorization",
        help="the request header that names a client (default: Authorization, the bearer token; or one your "
        "authenticating proxy sets, e.g. X-Forwarded-User)",
    )
    serve.add_argument("--store-clients", type=int, default=32, help="client stores kept, least recently used dropped")
    serve.add_argument("--store-tokens", type=int, default=1 << 16, help="tokens per client store (~21 bytes each)")
    serve.add_argument(
        "--stream-chunk",
        type=int,
        default=16,
        help="tokens per streamed chunk (default 16); 1 sends each verify step's tokens as they come, which shows "
        "a client how many drafted tokens each step accepted",
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    passed_on = argv[argv.index("--") + 1 :] if "--" in argv else []  # for transformers serve
    args = parser.parse_args(argv[: len(argv) - len(passed_on) - 1] if "--" in argv else argv)
    if passed_on and args.command != "serve":
        parser.error(f"only serve takes options after --, got {' '.join(passed_on)}")
    if args.command == "export-served":
        from hybrid.export import export_served

        print(export_served(args.out, args.verifier, args.drafter))
        return 0
    if args.command == "serve":
        from hybrid.serving import StorePolicy, serve, served_default

        if args.model is not None and (args.drafter is not None or args.verifier is not None):
            parser.error(
                "--verifier and --drafter choose what to export and serve; a served folder's are fixed by export-served"
            )
        try:
            policy = StorePolicy(
                args.online_store, args.client_header, args.store_clients, args.store_tokens, args.stream_chunk
            )
        except ValueError as e:
            parser.error(str(e))
        folder = args.model or served_default(args.drafter or "default", args.verifier)
        serve(folder, args.device, args.host, args.port, passed_on, policy)
        return 0
    return _generate(args)


VERIFIER_HELP = "a model folder (save_pretrained, with its tokenizer); default: the embedded one"
DRAFTER_FOLDER_HELP = (
    "a folder of a block-diffusion or DFlash drafter trained for the verifier (behind lookup and the online store, "
    "as hybrid.drafter_for puts them)"
)


def drafter_choice(value: str) -> str:
    """A --drafter value: a name of DRAFTER_NAMES or an existing folder (resolved: the glue may run anywhere)."""
    if value in DRAFTER_NAMES:
        return value
    if Path(value).is_dir():
        return str(Path(value).resolve())
    raise argparse.ArgumentTypeError(f"{value!r} is neither one of {', '.join(DRAFTER_NAMES)} nor a drafter folder")


def _generate(args) -> int:
    if args.verifier is None:
        model, tokenizer, default_drafter = hybrid.load_default(args.device, device_map=args.device_map)
    else:
        from verifiers.pretrained import load_verifier_folder

        model, tokenizer = load_verifier_folder(args.verifier, args.device, args.device_map)
        default_drafter = None
    drafters = {
        "default": lambda: default_drafter or build_drafter("default", model, tokenizer),
        "prompt-lookup": PromptLookupDrafter,
        "none": lambda: None,
        # The default's block model, without its lookup.
        "block": lambda: default_drafter.sources[-1] if default_drafter else build_drafter("block", model, tokenizer),
    }
    drafter = drafters[args.drafter]() if args.drafter in drafters else build_drafter(args.drafter, model, tokenizer)
    input_ids = encode_prompt(tokenizer, args.prompt).to(model.device)
    settings = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample}
    settings.update({k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p)) if v is not None})
    if args.static:
        settings["cache_implementation"] = "static"

    with torch.inference_mode():
        model(input_ids[:, :8])  # warm-up, so neither timed run pays for first-call overheads
    if args.static:  # compile every shape the timed runs meet
        start = time.perf_counter()
        hybrid.generate(model, input_ids, drafter=drafter, **settings)
        if not args.no_baseline:
            model.generate(input_ids, **settings)
        print(
            f"warm-up (compiling where the device compiles): {time.perf_counter() - start:.1f} s, untimed",
            file=sys.stderr,
        )
    torch.manual_seed(args.seed)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    (out, stats), seconds = timed(
        lambda: hybrid.generate(
            model, input_ids, drafter=drafter, streamer=streamer, return_stats=True, tokenizer=tokenizer, **settings
        ),
        model.device,
    )
    print()
    new_tokens = out.shape[1] - input_ids.shape[1]
    print(
        f"hybrid ({type(drafter).__name__ if drafter else 'no drafter'}): {new_tokens / seconds:.1f} tok/s end to end"
    )
    print(f"  inside the engine: {stats.summary()}")
    if args.no_baseline:
        return 0
    torch.manual_seed(args.seed)
    silent = SilentStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)  # the same decoding work, unprinted
    reference, baseline_time = timed(lambda: model.generate(input_ids, streamer=silent, **settings), model.device)
    baseline_tps = (reference.shape[1] - input_ids.shape[1]) / baseline_time
    print(
        f"plain model.generate: {reference.shape[1] - input_ids.shape[1]} tokens, {baseline_tps:.1f} tok/s end to end"
    )
    print(f"tau {stats.tau:.2f}  speed-up {new_tokens / seconds / baseline_tps:.2f}x", end="")
    same_seed = " (same seed)" if args.do_sample else ""
    print(f"  identical to model.generate{same_seed}: {'yes' if torch.equal(out, reference) else 'NO'}")
    return 0


class SilentStreamer(TextStreamer):
    """Decodes what it is handed as `TextStreamer` does, and prints nothing: the baseline pays for the streaming
    hybrid's answer pays for, so the two clocks time the same work."""

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        pass


if __name__ == "__main__":
    sys.exit(main())
