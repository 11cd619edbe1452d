"""Session fixtures: the shared assets (../shared/assets from the project root) and stories260K loaded once."""

from __future__ import annotations

from pathlib import Path

import pytest

ASSETS_DIR = Path(__file__).resolve().parents[2] / "shared" / "assets"
STORIES_HF_DIR = ASSETS_DIR / "stories260K" / "hf-reference"


@pytest.fixture(scope="session")
def assets_dir() -> Path:
    if not ASSETS_DIR.is_dir():
        pytest.skip(f"shared assets not found at {ASSETS_DIR}")
    return ASSETS_DIR


@pytest.fixture(scope="session")
def stories_hf_dir(assets_dir: Path) -> Path:
    """stories260K as a Hugging Face LlamaForCausalLM folder (config.json, model.safetensors, tokenizer.json)."""
    if not (STORIES_HF_DIR / "config.json").is_file():
        pytest.skip(f"stories260K not found at {STORIES_HF_DIR}")
    return STORIES_HF_DIR


@pytest.fixture(scope="session")
def stories_model(stories_hf_dir: Path):
    """infer's Llama loaded from the folder (fp32, CPU); tests must not modify it."""
    from infer.loader import load_model  # noqa: PLC0415 - keep collection cheap for tests without the model

    return load_model(stories_hf_dir)


@pytest.fixture(scope="session")
def stories_tokenizer(stories_hf_dir: Path):
    from transformers import AutoTokenizer  # noqa: PLC0415

    return AutoTokenizer.from_pretrained(stories_hf_dir)


@pytest.fixture(scope="session")
def stories_reference(stories_hf_dir: Path):
    """transformers' LlamaForCausalLM on the same folder, fp32, eager attention: the independent reference."""
    from transformers import LlamaForCausalLM  # noqa: PLC0415

    return LlamaForCausalLM.from_pretrained(stories_hf_dir, attn_implementation="eager").eval()
