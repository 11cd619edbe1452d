"""infer.gpu_check off a GPU: it stops at once with a one-line error, and its pieces run on CPU with the torch
backend (the GPU run swaps in FlashInfer and CUDA)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama

from infer import gpu_check
from infer.cli import run_cli
from tests.test_llama import tiny_llama3_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_without_cuda_it_stops_with_one_line(stories_hf_dir, monkeypatch, capfd):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    capfd.readouterr()
    assert run_cli(lambda: gpu_check.main(["--stories", str(stories_hf_dir)])) == 2
    err = capfd.readouterr().err
    assert err.strip() == "error: infer.gpu_check needs a CUDA GPU and torch.cuda.is_available() is False here"


def test_its_checks_run_on_cpu(stories_hf_dir, tmp_path):
    torch.manual_seed(0)
    HFLlama(tiny_llama3_config()).save_pretrained(tmp_path)
    parity = gpu_check.backend_parity(tmp_path, "tiny", "cpu", torch.bfloat16, ("torch", "torch"))
    assert (parity["value"], parity["reference"]) == ("0.00e+00", "argmax 1.000")
    (decode,) = gpu_check.decode_rows(tmp_path, "tiny", "cpu", [2], new_tokens=4, repeats=1, dtype=torch.float32)
    assert decode["setting"] == "batch 2, torch" and float(decode["ratio"]) > 0
    spec = gpu_check.spec_row(stories_hf_dir, "stories260K", "cpu", "torch", new_tokens=8, repeats=1,
                              dtype=torch.float32)
    assert spec["check"] == "spec" and "tau" in spec["value"] and float(spec["ratio"]) > 0
    (failed,) = gpu_check.guarded("parity", "missing", lambda: gpu_check.backend_parity(
        tmp_path / "missing", "missing", "cpu", torch.bfloat16, ("torch", "torch")))
    assert failed["value"].startswith("error: model folder") and "missing" in failed["value"]
