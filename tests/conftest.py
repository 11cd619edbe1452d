"""Session fixtures: the shared assets (../shared/assets from the project root) and stories260K loaded once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ASSETS_DIR = Path(__file__).resolve().parents[2] / "shared" / "assets"
STORIES_HF_DIR = ASSETS_DIR / "stories260K" / "hf-reference"


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module's tiny-model tests on one intra-op thread, restoring the count afterwards.

    stories260K's matmuls are a few microseconds; with two OpenMP threads on a busy 2-core machine each op waits
    for a descheduled peer, and a 21-step decode went from 0.05 s to 3-12 s. Use with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def assets_dir() -> Path:
    if not ASSETS_DIR.is_dir():
        pytest.fail(f"shared assets not found at {ASSETS_DIR}: the tests need ../shared/assets beside the checkout")
    return ASSETS_DIR


@pytest.fixture(scope="session")
def stories_hf_dir(assets_dir: Path) -> Path:
    """stories260K as a Hugging Face LlamaForCausalLM folder (config.json, model.safetensors, tokenizer.json)."""
    if not (STORIES_HF_DIR / "config.json").is_file():
        pytest.fail(f"stories260K not found at {STORIES_HF_DIR}")
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
