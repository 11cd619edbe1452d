"""A cached virtual environment holding the speculators package, for checks by the package's own classes.

speculators 0.9.0 pins transformers<=5.19 (this project runs 5.24) and pulls torchvision/torchaudio, so it lives in
its own environment under ~/.cache: the CPU torch wheel first, then speculators without its dependencies, then
just what its model classes import (no torchvision/torchaudio). Built once (about 3 minutes), then reused while
SPEC below is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

# The model classes import the package's training data module too (openai, datasets, hs_connectors).
SPEC = ("torch==2.13.0", "speculators==0.9.0", "transformers==5.19.0", "pydantic", "pydantic-settings", "loguru",
        "openai", "datasets==5.1.0", "hs-connectors==0.9.0")
CACHE = Path(os.environ.get("SPECFORGE_CACHE", Path.home() / ".cache" / "specforge-lite"))


def env_dir() -> Path:
    return CACHE / ("speculators-" + hashlib.sha256(json.dumps(SPEC).encode()).hexdigest()[:12])


def python() -> Path:
    """The environment's interpreter, building the environment first when it is missing or incomplete."""
    root = env_dir()
    exe = root / "bin" / "python"
    if (root / "ready").is_file():
        return exe
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True)
    pip = [str(exe), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, SPEC[0]], check=True, timeout=1200)
    subprocess.run([*pip, "--no-deps", SPEC[1]], check=True, timeout=600)
    subprocess.run([*pip, *SPEC[2:]], check=True, timeout=1200)
    (root / "ready").write_text(json.dumps(SPEC) + "\n")
    return exe


def run(script: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`script` under the environment's interpreter, with no project path: it sees the package, not this repo.
    Offline: the package resolves a verifier it cannot find locally on the Hub, retrying for a minute."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([str(python()), str(script), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


if __name__ == "__main__":
    print(python())
