"""`python -m hybrid export-served OUT`: a model folder whose `generate` is hybrid's.

The folder is the verifier's own files (config, weights, tokenizer; hard links where the file system allows)
plus `custom_generate/generate.py`, which names the drafter and calls `hybrid.custom_generate.generate`. So it
works wherever transformers takes a folder: `model.generate(ids, custom_generate=OUT, trust_remote_code=True)`,
`AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)` and `transformers serve OUT
--trust-remote-code`. Without `trust_remote_code` it is the plain verifier.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

GLUE = Path("custom_generate") / "generate.py"
GLUE_MARK = "written by `python -m hybrid export-served`"  # an OUT holding a file with this line may be rewritten
GLUE_TEMPLATE = '''"""hybrid's speculative decoding as this model's `generate` ({mark}).

Loaded by transformers with trust_remote_code=True; needs the `hybrid` package installed."""

try:  # inside try, so transformers' import check leaves the message to this file
    from hybrid.custom_generate import generate as hybrid_generate
except ImportError as e:
    raise ImportError(
        "this model decodes with hybrid: install it into this environment (pip install -e {repo})"
    ) from e

DRAFTER = {drafter!r}


def generate(*args, model=None, drafter=DRAFTER, **kwargs):
    return hybrid_generate(*args, model=model, drafter=drafter, **kwargs)
'''


def export_served(out: str | Path, verifier: str | Path | None = None, drafter: str = "default") -> Path:
    """Write the served folder `out` for the verifier folder `verifier` (None: the embedded default, SmolLM2-135M-
    Instruct) and `drafter` (a name of `hybrid.custom_generate.DRAFTER_NAMES` or a drafter folder). The drafter is
    built once here against the verifier, so a mismatch (another vocabulary, a drafter trained for another
    verifier) fails now rather than at the first request."""
    from hybrid.custom_generate import build_drafter
    from verifiers.embedded import MODEL_NAME, cache_dir, load_verifier
    from verifiers.pretrained import load_verifier_folder

    out = Path(out).resolve()
    if verifier is None:
        model, tokenizer = load_verifier()  # converts and caches it on first use
        source = cache_dir() / MODEL_NAME
    else:
        source = Path(verifier).resolve()
        model, tokenizer = load_verifier_folder(verifier)
    if Path(drafter).is_dir():
        drafter = str(Path(drafter).resolve())  # the glue may be loaded from anywhere
    build_drafter(drafter, model, tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        print(
            f"hybrid: {source} has no chat template: /v1/chat/completions needs one (/v1/completions does not)",
            flush=True,
        )

    if out == source:
        raise ValueError(f"OUT {out} is the verifier folder itself: choose another path")
    _prepare(out)
    for file in source.iterdir():
        if file.is_file():
            _link_or_copy(file, out / file.name)
    (out / GLUE).parent.mkdir(exist_ok=True)
    (out / GLUE).write_text(glue_source(drafter))
    return out


def glue_source(drafter: str) -> str:
    """The text of the folder's custom_generate/generate.py for `drafter`."""
    return GLUE_TEMPLATE.format(mark=GLUE_MARK, drafter=drafter, repo=Path(__file__).resolve().parent.parent)


def served_drafter(folder: str | Path) -> str:
    """The drafter the served folder `folder` names in its custom_generate/generate.py (`glue_source`)."""
    import ast

    for statement in ast.parse((Path(folder) / GLUE).read_text()).body:
        if isinstance(statement, ast.Assign) and [t.id for t in statement.targets if isinstance(t, ast.Name)] == [
            "DRAFTER"
        ]:
            return ast.literal_eval(statement.value)
    raise ValueError(f"{Path(folder) / GLUE} names no DRAFTER: write the folder with `python -m hybrid export-served`")


def _prepare(out: Path) -> None:
    """Make `out` an empty folder, refusing to clear one that export-served did not write."""
    if out.exists():
        glue = out / GLUE
        if not out.is_dir() or (any(out.iterdir()) and not (glue.is_file() and GLUE_MARK in glue.read_text())):
            raise ValueError(f"OUT {out} exists and was not written by export-served: choose another path or remove it")
        shutil.rmtree(out)
    out.mkdir(parents=True)


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)  # the weights are hundreds of MB: share them where the file system allows
    except OSError:
        shutil.copy2(source, target)
