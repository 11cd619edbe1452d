"""One check of the runtime on a CUDA GPU with FlashInfer, printed as one table (launch/gpu_check.sh; < 10 min).

    python -m infer.gpu_check --stories ../shared/assets/stories260K/hf-reference

  parity  FlashInfer backend against the torch backend in bf16, over packed prefill, chunked-prefill and decode
          steps: a tiny Llama-3 (GQA), tiny DeepSeek-V2s at FlashInfer's MLA sizes (kv_lora_rank 512, rope 64;
          with and without q_lora_rank, MoE) and a Llama-3.2-1B-shaped random model. value = max |diff| over
          the logit range, reference = argmax agreement.
  decode  tokens/s of the runtime (FlashInfer) against transformers' generate, batch 1, 8 and 32, on the
          1B-shaped model.
  spec    an untrained MTP head (init_head_from_target, K=2) against plain decoding: tokens/s and tau, on
          stories260K (torch backend: its head_dim 8 is below FlashInfer's) and on the 1B-shaped model.

A row that fails prints its one-line error instead of a figure, so one unsupported kernel leaves the rest.
Without CUDA (or without FlashInfer) it stops at once with a one-line error.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, LlamaConfig, LlamaForCausalLM

from infer.attention import flashinfer_available
from infer.bench import best_of, print_table, run_engine
from infer.cli import CliError, run_cli
from infer.engine import Engine, EngineConfig
from infer.kv_cache import PagePool, PageTable, build_page_metadata
from infer.loader import load_model
from infer.model_runner import ModelRunner
from infer.models.mtp_head import init_head_from_target
from infer.parallel import one_line
from infer.sampling_params import SamplingParams
from infer.tp_report import LLAMA_3_2_1B, write_random_llama

TINY_LLAMA = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False,
                  initializer_range=0.05)
TINY_DEEPSEEK = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=512, q_lora_rank=None,
                     qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2,
                     n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=512, initializer_range=0.05)


def save_tiny_models(root: Path) -> dict[str, Path]:
    """Random tiny checkpoints at FlashInfer-supported head sizes, saved by transformers."""
    torch.manual_seed(0)
    folders = {}
    for name, model in {
        "tiny-llama3": LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)),
        "tiny-deepseek-v2-lite": DeepseekV2ForCausalLM(DeepseekV2Config(**TINY_DEEPSEEK)),
        "tiny-deepseek-v2-q-lora": DeepseekV2ForCausalLM(DeepseekV2Config(**{**TINY_DEEPSEEK, "q_lora_rank": 192})),
    }.items():
        folders[name] = root / name
        model.save_pretrained(folders[name])
    return folders


def paged_steps(runner: ModelRunner, vocab: int, seed: int = 0) -> torch.Tensor:
    """Three sequences over 16-token pages: a packed prefill (37, 5, 70 tokens), a 20-token chunk beside two
    decodes, then four decode steps. Returns every step's logits, [T, vocab] fp32."""
    gen = torch.Generator().manual_seed(seed)
    q_lens = [(37, 5, 70), (20, 1, 1)] + [(1, 1, 1)] * 4
    seqs = [torch.randint(0, vocab, (sum(step[b] for step in q_lens),), generator=gen) for b in range(3)]
    pool = PagePool(64, 16)
    tables, offsets, logits = [PageTable(pool) for _ in seqs], [0, 0, 0], []
    for lens in q_lens:
        for table, n in zip(tables, lens):
            table.extend(table.num_tokens + n)
        meta = build_page_metadata([t.pages for t in tables], list(lens), [t.num_tokens for t in tables], 16,
                                   runner.device)
        ids = torch.cat([seq[off : off + n] for seq, off, n in zip(seqs, offsets, lens)]).to(runner.device)
        logits.append(runner.run(ids, meta).logits.float().cpu())
        offsets = [off + n for off, n in zip(offsets, lens)]
    return torch.cat(logits)


def backend_parity(folder: Path, name: str, device: str, dtype: torch.dtype, backends: tuple[str, str]) -> dict:
    """The same paged steps through two attention backends (the first is the reference)."""
    model = load_model(folder, dtype=dtype, device=device)
    reference, ours = (paged_steps(ModelRunner(model, 64, 16, backend), model.config.vocab_size) for backend in backends)
    rel = ((ours - reference).abs().max() / (reference.max() - reference.min())).item()
    agree = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    return {"check": "parity", "model": name, "setting": f"{backends[1]} vs {backends[0]}, {dtype}".replace("torch.", ""),
            "value": f"{rel:.2e}", "reference": f"argmax {agree:.3f}", "ratio": ""}


def hf_generate(model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int) -> tuple[float, int]:
    """(seconds, tokens) of transformers' greedy generate on equal-length prompts [B, L] (no padding needed)."""
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if prompts.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, (out.shape[1] - prompts.shape[1]) * prompts.shape[0]


def decode_rows(folder: Path, name: str, device: str, batch_sizes: list[int], new_tokens: int, repeats: int,
                dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Runtime (backend auto: FlashInfer on CUDA) against transformers, greedy, fixed output length."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - the baseline only

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    model = load_model(folder, dtype=dtype, device=device)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in batch_sizes:
        prompts = torch.randint(3, model.config.vocab_size, (batch, 16), generator=gen)
        engine = Engine(model, None, [], EngineConfig(max_num_seqs=batch, num_pages=batch * 16 + 8))
        run_engine(engine, prompts[:1].tolist(), SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
        hf_generate(hf, prompts[:1].to(device), 4)
        ours_s, ours_n = best_of(repeats, lambda: run_engine(engine, prompts.tolist(), params))
        hf_s, hf_n = best_of(repeats, lambda: hf_generate(hf, prompts.to(device), new_tokens))
        rows.append({"check": "decode", "model": name, "setting": f"batch {batch}, {engine.runner.backend_name}",
                     "value": f"{ours_n / ours_s:.1f} tok/s", "reference": f"transformers {hf_n / hf_s:.1f} tok/s",
                     "ratio": f"{(ours_n / ours_s) / (hf_n / hf_s):.2f}"})
    return rows


def spec_row(folder: Path, name: str, device: str, backend: str, new_tokens: int, repeats: int,
             dtype: torch.dtype = torch.bfloat16, k: int = 2) -> dict:
    """An untrained MTP head (the target's last layer) drafting K tokens, against plain decoding, batch 1."""
    model = load_model(folder, dtype=dtype, device=device)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    prompt = [[1, 400 % model.config.vocab_size, 300 % model.config.vocab_size]]
    speeds = {}
    for kind in ("plain", "mtp"):
        engine = Engine(model, None, [], EngineConfig(max_num_seqs=1, num_pages=64, backend=backend, num_draft_tokens=k))
        if kind == "mtp":
            engine.attach_drafter("mtp", init_head_from_target(model, name))
        run_engine(engine, prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
        seconds, tokens = best_of(repeats, lambda: run_engine(engine, prompt, params))
        speeds[kind] = tokens / seconds
    return {"check": "spec", "model": name, "setting": f"MTP head K={k}, {backend}, batch 1",
            "value": f"{speeds['mtp']:.1f} tok/s, tau {engine.spec_stats.tau:.2f}",
            "reference": f"plain {speeds['plain']:.1f} tok/s", "ratio": f"{speeds['mtp'] / speeds['plain']:.2f}"}


def guarded(check: str, model: str, run: Callable[[], dict | list[dict]]) -> list[dict]:
    """Run one check; a failure becomes a row with its one-line error, and the others still run."""
    try:
        rows = run()
    except Exception as err:  # noqa: BLE001 - reported in the table
        return [{"check": check, "model": model, "setting": "", "value": f"error: {one_line(err)[:160]}",
                 "reference": "", "ratio": ""}]
    finally:
        torch.cuda.empty_cache()
    return rows if isinstance(rows, list) else [rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infer.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stories", required=True, type=Path, help="stories260K Hugging Face folder")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per request (default 128)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per speed, the fastest counts (default 2)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise CliError("infer.gpu_check needs a CUDA GPU and torch.cuda.is_available() is False here")
    if not flashinfer_available():
        raise CliError("infer.gpu_check needs FlashInfer: pip install .[gpu] (flashinfer-python)")
    if not (args.stories / "config.json").is_file():
        raise CliError(f"--stories {args.stories} is not a model folder (no config.json)")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        folders = save_tiny_models(Path(tmp))
        big = Path(tmp, "llama-3.2-1b-shaped")
        big.mkdir()
        write_random_llama(big, LlamaConfig(**LLAMA_3_2_1B))
        folders["llama-3.2-1b-shaped"] = big
        for name, folder in folders.items():
            rows += guarded("parity", name, lambda: backend_parity(folder, name, "cuda", torch.bfloat16,
                                                                    ("torch", "flashinfer")))
        rows += guarded("decode", "llama-3.2-1b-shaped", lambda: decode_rows(big, "llama-3.2-1b-shaped", "cuda",
                                                                            [1, 8, 32], args.max_new_tokens,
                                                                            args.repeats))
        rows += guarded("spec", "stories260K", lambda: spec_row(args.stories, "stories260K", "cuda", "torch",
                                                                args.max_new_tokens, args.repeats))
        rows += guarded("spec", "llama-3.2-1b-shaped", lambda: spec_row(big, "llama-3.2-1b-shaped", "cuda",
                                                                        "flashinfer", args.max_new_tokens,
                                                                        args.repeats))
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print_table(rows)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
