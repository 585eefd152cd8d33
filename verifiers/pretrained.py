"""A verifier from a transformers model folder (`save_pretrained`, with its tokenizer), or from a hub name where a hub
is reachable: what every `--verifier` option loads (`python -m hybrid generate/export-served`, training)."""

from __future__ import annotations

from pathlib import Path


def load_verifier_folder(verifier: str | Path, device: str = "cpu", device_map=None, dtype=None, hub: bool = False):
    """(model, tokenizer) of the model folder `verifier` (save_pretrained, with its tokenizer), for --verifier, in
    `dtype` (None: transformers' choice); with `hub`, a name that is no local path goes to from_pretrained as a hub
    name (where a hub is reachable)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(verifier).resolve()
    if not (source / "config.json").is_file():
        local = Path(verifier).exists() or Path(verifier).is_absolute() or str(verifier).startswith(".")
        if not hub or local:
            raise ValueError(f"--verifier {verifier}: no config.json there; pass a folder written by save_pretrained")
        source = str(verifier)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:
        where = (
            "has no tokenizer transformers can load"
            if isinstance(source, Path)
            else "is no local folder, and no hub gave it"
        )
        raise ValueError(
            f"--verifier {verifier} {where} ({str(e).splitlines()[0]}): pass a folder written by save_pretrained, with "
            "the tokenizer saved into it (tokenizer.save_pretrained)"
        ) from None
    kwargs = {} if dtype is None else {"dtype": dtype}
    if device_map is not None:
        return AutoModelForCausalLM.from_pretrained(source, device_map=device_map, **kwargs).eval(), tokenizer
    return AutoModelForCausalLM.from_pretrained(source, **kwargs).to(device).eval(), tokenizer
