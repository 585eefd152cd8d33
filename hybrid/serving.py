"""`python -m hybrid serve`: hybrid behind `transformers serve`, an OpenAI-compatible server (chat and text
completions, streaming or not).

It serves a folder written by `hybrid.export` (by default the embedded verifier with the chosen drafter, exported
once into the cache) with `--trust-remote-code`, so every request's `model.generate` is `hybrid.generate`, and
prints each request's tau and tokens/s. Everything else is transformers' own server.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

SERVING_EXTRA = 'pip install -e ".[serving]" (transformers[serving]: fastapi, uvicorn, openai)'
# transformers serve options that would take requests away from model.generate, i.e. from hybrid.
BYPASSING_OPTIONS = ("--continuous-batching",)


def require_serving() -> None:
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise SystemExit(f"python -m hybrid serve needs the serving extra: {SERVING_EXTRA}")


def served_default(drafter: str) -> Path:
    """The served folder of the embedded default verifier with `drafter`, exported into the cache on first use."""
    from hybrid.export import GLUE, export_served, glue_source
    from verifiers.embedded import MODEL_NAME, cache_dir

    out = cache_dir() / "served" / f"{MODEL_NAME}-{drafter}"
    glue = out / GLUE
    if not (glue.is_file() and glue.read_text() == glue_source(drafter) and (out / "config.json").is_file()):
        print(f"hybrid: exporting the default verifier with drafter {drafter!r} to {out} (once)", file=sys.stderr)
        export_served(out, drafter=drafter)
    return out


def serve(folder: str | Path, device: str, host: str, port: int, transformers_args: list[str]) -> None:
    """Run `transformers serve folder --trust-remote-code` in this process, logging each request's statistics."""
    require_serving()
    from hybrid.export import GLUE

    folder = Path(folder)
    if not (folder / GLUE).is_file():
        raise SystemExit(f"{folder} has no {GLUE}: write the folder with `python -m hybrid export-served {folder}`")
    bypassing = [a for a in transformers_args if a.split("=")[0] in BYPASSING_OPTIONS]
    if bypassing:
        raise SystemExit(
            f"{bypassing[0]} serves requests without model.generate, so hybrid would not run: "
            f"run `transformers serve {folder} {bypassing[0]}` for transformers' own batching instead"
        )
    log = logging.getLogger("hybrid.serving")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("hybrid: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False

    from transformers.cli.transformers import app

    arguments = ["serve", str(folder), "--trust-remote-code", "--device", device, "--host", host, "--port", str(port)]
    app(arguments + transformers_args, prog_name="transformers")
