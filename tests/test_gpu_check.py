"""infer.bench.gpu_check off a GPU: it stops at once with a one-line error, and its pieces run on CPU with the torch
backend (the GPU run swaps in FlashInfer and CUDA)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaForCausalLM as HFLlama

from infer.attention import TorchAttention, buckets
from infer.bench import gpu_check
from infer.cli import run_cli
from infer.engine import Engine, EngineConfig
from infer.loader import load_model
from infer.model_runner import ModelRunner
from tests.test_llama import tiny_llama3_config
from tests.test_mtp_head import tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_without_cuda_it_stops_with_one_line(stories_hf_dir, monkeypatch, capfd):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    capfd.readouterr()
    assert run_cli(lambda: gpu_check.main(["--stories", str(stories_hf_dir)])) == 2
    err = capfd.readouterr().err
    assert err.strip() == "error: infer.bench.gpu_check needs a CUDA GPU and torch.cuda.is_available() is False here"


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



@pytest.mark.parametrize("label", list(gpu_check.ATTENTION_SHAPES))
def test_attention_parity_reads_a_broken_backend(label):
    """The attention row with the torch backend standing in for FlashInfer reads its own bf16 rounding; a backend
    whose scale is 10% off (a kernel that misreads the plan) reads far above it."""
    mla = gpu_check.ATTENTION_SHAPES[label][3]
    row = gpu_check.attention_parity(label, "cpu", backend=lambda dtype: TorchAttention(), name="torch")
    assert row["reference"] == f"torch bf16 {row['value']}" and float(row["value"]) < 5e-3

    class WrongScale(TorchAttention):
        def attend(self, q, k, v, kv_cache, scale):
            return super().attend(q, k, v, kv_cache, scale * 1.1)

        def attend_mla(self, *args):
            return super().attend_mla(*args[:-1], args[-1] * 1.1)

    broken = gpu_check.attention_parity(label, "cpu", backend=lambda dtype: WrongScale(), name="broken")
    assert float(broken["value"]) > 10 * float(broken["reference"].split()[-1]), (mla, broken)


def _misaligned_sdpa_masks(stories_hf_dir) -> int:
    """SDPA calls of a speculative run (decode runs of draft steps) whose mask starts, or has rows, off 16 bytes."""
    misaligned = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten.scaled_dot_product_attention.default:
                mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
                if mask is not None and (mask.data_ptr() % 16 or mask.stride(-2) * mask.element_size() % 16):
                    misaligned.append(tuple(mask.shape))
            return func(*args, **kwargs)

    with Watch():
        gpu_check.spec_row(stories_hf_dir, "stories260K", "cpu", "torch", new_tokens=12, repeats=1,
                           dtype=torch.bfloat16)
    return len(misaligned)


def test_sdpa_masks_start_16_byte_aligned(stories_hf_dir, monkeypatch):
    """CUDA's fused SDPA kernels fault ("misaligned address", seen on an H200) on a mask whose start or row stride
    is off 16 bytes, as a decode run's step j > 0 was at odd key counts. Control: rows packed at their width."""
    assert _misaligned_sdpa_masks(stories_hf_dir) == 0
    monkeypatch.setattr(buckets, "MASK_ALIGN", 1)
    monkeypatch.setattr(buckets, "_MASK_TEMPLATES", {})
    assert _misaligned_sdpa_masks(stories_hf_dir) > 0



def test_attention_takes_sdpa_outputs_in_cudas_memory_layout(tmp_path, monkeypatch):
    """CUDA's fused SDPA kernels return [n, H, rows, D] laid out as [n, rows, H, D] (a transposed view); the torch
    backend's GQA decodes viewed it flat and failed on an H200 in fp32. Here SDPA returns that layout on CPU: the
    paged steps (prefill, a chunk beside decodes, decodes) give the same logits."""
    torch.manual_seed(0)
    HFLlama(tiny_llama3_config()).save_pretrained(tmp_path)
    model = load_model(tmp_path)
    want = gpu_check.paged_steps(ModelRunner(model, 64, 16, "torch"), model.config.vocab_size)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def cuda_layout(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", cuda_layout)
    got = gpu_check.paged_steps(ModelRunner(model, 64, 16, "torch"), model.config.vocab_size)
    assert torch.equal(got, want)


def test_attach_drafter_refuses_a_drafter_on_another_device(stories_model, stories_tokenizer):
    """A drafter shares the target's pages and reads its tokens: on another device it would fail mid-step (an
    untrained head was built on the CPU beside a CUDA target); attach says so up front."""
    drafter = tiny_llama(vocab_size=stories_model.config.vocab_size).to("meta")
    engine = Engine(stories_model, stories_tokenizer, [2], EngineConfig(backend="torch", num_pages=8))
    with pytest.raises(ValueError, match="drafter's weights are on meta and the target's on cpu"):
        engine.attach_drafter("draft", drafter)
    assert engine.drafter is None
