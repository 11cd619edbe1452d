"""One check of the runtime on a CUDA GPU with FlashInfer, printed as one table (launch/gpu_check.sh; < 10 min).

    python -m infer.bench.gpu_check --stories ../shared/assets/stories260K/hf-reference [--checks attention,spec]

  attention  one layer's attention alone through FlashInfer in bf16 against the torch backend in fp32, on random
             inputs over the paged steps below, at real head layouts (GQA 32/8 with head_dim 64 and 128; MLA 16
             heads over kv_lora_rank 512 + rope 64). value = max |diff| over the output range, reference = the
             torch backend's own bf16 error on the same inputs: a kernel that misreads the page layout or the
             scale reads far above it (a logit comparison through random layers can hide that).
  parity     FlashInfer backend against the torch backend in bf16, over packed prefill, chunked-prefill and decode
             steps: a tiny Llama-3 (GQA), tiny DeepSeek-V2s at FlashInfer's MLA sizes (kv_lora_rank 512, rope 64;
             with and without q_lora_rank, MoE) and a Llama-3.2-1B-shaped random model. value = max |diff| over
             the logit range, reference = argmax agreement.
  decode     tokens/s of the runtime (FlashInfer) against transformers' generate, batch 1, 8 and 32, on the
             1B-shaped model.
  spec       an untrained MTP head (init_head_from_target, K=2) against plain decoding: tokens/s and tau, on
             stories260K (torch backend: its head_dim 8 is below FlashInfer's) and on the 1B-shaped model.
  graphs, spec-graphs
             CUDA graphs on and off: decode as a share of the bandwidth limit on 1B- and 8B-shaped models, kernels,
             host ms and host syncs a step, and speculation at a known acceptance (`infer.bench.graph_check`);
             they run first.

Each row prints as it lands (a run stopped by its timeout keeps the finished ones), then the table and its JSON.
FlashInfer compiles its kernels on first use (about 2 minutes per head layout on 16 cores, then cached): every
layout is compiled side by side before the checks (`compile_kernels`).
A row that fails prints its one-line error instead of a figure, so one unsupported kernel leaves the rest.
Without CUDA (or without FlashInfer) it stops at once with a one-line error.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, LlamaConfig, LlamaForCausalLM

from infer.attention import AttentionBackend, FlashInferAttention, TorchAttention, flashinfer_available
from infer.bench.cli import best_of, print_table, run_engine
from infer.bench.graph_check import (
    SHAPES, decode_graph_rows, graph_child_command, graph_rows_in_child, spec_graph_rows,
)
from infer.bench.tp_report import LLAMA_3_2_1B, write_random_llama
from infer.cli import CliError, run_cli
from infer.engine import Engine, EngineConfig
from infer.kv_cache import PagePool, PageTable, build_page_metadata
from infer.loader import load_model, serve_lean
from infer.model_runner import ModelRunner
from infer.models.mtp_head import init_head_from_target
from infer.parallel import one_line
from infer.sampling_params import SamplingParams

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


STEP_Q_LENS = [(37, 5, 70), (20, 1, 1)] + [(1, 1, 1)] * 4  # a packed prefill, a chunk beside decodes, decodes


def step_tables(num_pages: int, page_size: int) -> list[tuple[list[list[int]], list[int], list[int]]]:
    """Three sequences over one pool through STEP_Q_LENS: each step's (page lists, q_lens, kv_lens)."""
    pool = PagePool(num_pages, page_size)
    tables, steps = [PageTable(pool) for _ in STEP_Q_LENS[0]], []
    for lens in STEP_Q_LENS:
        for table, n in zip(tables, lens):
            table.extend(table.num_tokens + n)
        steps.append(([list(t.pages) for t in tables], list(lens), [t.num_tokens for t in tables]))
    return steps


def paged_steps(runner: ModelRunner, vocab: int, seed: int = 0) -> torch.Tensor:
    """The model over STEP_Q_LENS (16-token pages) on random token ids. Returns every step's logits, [T, vocab]
    fp32."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (sum(step[b] for step in STEP_Q_LENS),), generator=gen) for b in range(3)]
    offsets, logits = [0, 0, 0], []
    for pages, lens, kv_lens in step_tables(64, 16):
        meta = build_page_metadata(pages, lens, kv_lens, 16, runner.device)
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


CHECKS = ("graphs", "spec-graphs", "attention", "parity", "decode", "spec")
ATTENTION_SHAPES = {  # (heads, kv heads, head dim) or MLA's (heads, kv_lora_rank, rope dim)
    "gqa 32/8 x 64 (Llama-3.2-1B)": (32, 8, 64, False),
    "gqa 32/8 x 128 (Llama-3.1-8B)": (32, 8, 128, False),
    "mla 16 x 512+64 (DeepSeek-V2-Lite)": (16, 512, 64, True),
}


def attention_parity(label: str, device: str,
                     backend: Callable[[torch.dtype], AttentionBackend] | None = None,
                     name: str = "flashinfer") -> dict:
    """One layer's attention alone over STEP_Q_LENS on random bf16 inputs of real magnitude: the
    backend in bf16 and the torch backend in bf16, each against the torch backend in fp32 on the same inputs. A
    logit comparison through random layers can hide a wrong attention (its share of the residual is small); here
    value = the backend's max |diff| over the output range, reference = the torch backend's own bf16 error.
    `backend` builds the backend under test for a dtype (default FlashInfer at the label's shape)."""
    heads, kv, dim, mla = ATTENTION_SHAPES[label]  # kv: KV heads or MLA's latent width; dim: head or rope
    gen = torch.Generator().manual_seed(0)
    page_size, num_pages = 16, 64
    steps = step_tables(num_pages, page_size)
    if mla:  # q_latent, q_rope, ckv, kpe; caches [pages, page, R] and [pages, page, Dr]
        shapes = [(heads, kv), (heads, dim), (kv,), (dim,)]
        caches = [(num_pages, page_size, kv), (num_pages, page_size, dim)]
        scale = (128 + dim) ** -0.5  # DeepSeek-V2's qk_nope_head_dim 128 + rope
    else:  # q, k, v; cache [pages, 2, page, Hkv, D]
        shapes = [(heads, dim), (kv, dim), (kv, dim)]
        caches = [(num_pages, 2, page_size, kv, dim)]
        scale = dim ** -0.5
    inputs = [[torch.randn(sum(lens), *shape, generator=gen) for shape in shapes] for lens in STEP_Q_LENS]

    if backend is None:
        def backend(dtype: torch.dtype) -> AttentionBackend:
            return FlashInferAttention(heads, kv, dim, dtype, torch.device(device),
                                       mla_dims=(kv, dim) if mla else None)

    def run(make: Callable[[torch.dtype], AttentionBackend], dtype: torch.dtype) -> torch.Tensor:
        attn = make(dtype)
        cache = [torch.zeros(shape, dtype=dtype, device=device) for shape in caches]
        outs = []
        for (pages, lens, kv_lens), tensors in zip(steps, inputs):
            attn.plan(build_page_metadata(pages, lens, kv_lens, page_size, torch.device(device)))
            args = [t.to(device, dtype) for t in tensors]
            out = attn.attend_mla(*args, *cache, scale) if mla else attn.attend(*args, *cache, scale)
            outs.append(out.float().cpu())
        return torch.cat(outs)

    exact = run(lambda dtype: TorchAttention(), torch.float32)
    span = (exact.max() - exact.min()).item()
    ours, torch_bf16 = run(backend, torch.bfloat16), run(lambda dtype: TorchAttention(), torch.bfloat16)
    return {"check": "attention", "model": label, "setting": f"{name} bf16 vs torch fp32",
            "value": f"{(ours - exact).abs().max().item() / span:.2e}",
            "reference": f"torch bf16 {(torch_bf16 - exact).abs().max().item() / span:.2e}", "ratio": ""}


def compile_kernels(labels: list[str]) -> float:
    """FlashInfer compiles a head layout's kernels on first use (about 2 minutes each on 16 cores, one ninja build
    at a time per process): build every layout side by side first, one process each (`--warm LABEL`), so the checks
    then run on cached kernels (about half the time of one after another; see docs/benchmark_history.md). A layout
    that fails to build is left to its check, which reports the error in its row. Returns the seconds spent."""
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "infer.bench.gpu_check", "--stories", ".", "--warm", label],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for label in labels]
    for proc in procs:
        proc.wait()
    return time.perf_counter() - start


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
            engine.attach_drafter("mtp", serve_lean(init_head_from_target(model, name)))
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
    parser = argparse.ArgumentParser(prog="python -m infer.bench.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stories", required=True, type=Path, help="stories260K Hugging Face folder")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per request (default 128)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per speed, the fastest counts (default 2)")
    parser.add_argument("--checks", default=",".join(CHECKS),
                        help=f"comma-separated checks to run (default all: {','.join(CHECKS)})")
    parser.add_argument("--warm", choices=list(ATTENTION_SHAPES), help=argparse.SUPPRESS)  # compile_kernels' workers
    parser.add_argument("--graphs-child", action="store_true", help=argparse.SUPPRESS)  # graph_rows_in_child's
    args = parser.parse_args(argv)
    checks = args.checks.split(",")
    if unknown := sorted(set(checks) - set(CHECKS)):
        raise CliError(f"--checks {args.checks}: unknown {', '.join(unknown)} (choose from {', '.join(CHECKS)})")
    if not torch.cuda.is_available():
        raise CliError("infer.bench.gpu_check needs a CUDA GPU and torch.cuda.is_available() is False here")
    if not flashinfer_available():
        raise CliError("infer.bench.gpu_check needs FlashInfer: pip install .[gpu] (flashinfer-python)")
    if args.warm:
        attention_parity(args.warm, "cuda")
        return 0
    if not (args.stories / "config.json").is_file():
        raise CliError(f"--stories {args.stories} is not a model folder (no config.json)")
    import flashinfer  # noqa: PLC0415 - present: checked above

    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, flashinfer {flashinfer.__version__}",
          flush=True)
    if not args.graphs_child:
        print(f"FlashInfer kernels compiled (or found cached) in {compile_kernels(list(ATTENTION_SHAPES)):.0f} s",
              flush=True)
    rows: list[dict] = []
    start = time.perf_counter()

    def report(check: str, model: str, run: Callable[[], dict | list[dict]]) -> None:
        """Run one check and print its rows as they land: a run stopped by its timeout keeps the finished ones."""
        if check not in checks:
            return
        for row in guarded(check, model, run):
            rows.append(row)
            print(f"row at {time.perf_counter() - start:.0f} s: {json.dumps(row)}", flush=True)

    if args.graphs_child:  # the graph checks alone, in the process `graph_rows_in_child` started
        for name in SHAPES:
            report("graphs", name, lambda: decode_graph_rows(name, "cuda", [1, 8, 32], args.max_new_tokens,
                                                             args.repeats))
        report("spec-graphs", "llama-3.2-1b-shaped", lambda: spec_graph_rows("cuda", args.max_new_tokens,
                                                                            args.repeats))
        return 0
    graph_checks = [c for c in ("graphs", "spec-graphs") if c in checks]
    if graph_checks:  # first, in a process of their own: a CUDA error there cannot poison the other checks' context
        command = graph_child_command(args.stories, graph_checks, args.max_new_tokens, args.repeats)
        for row in graph_rows_in_child(command, graph_checks[0]):
            rows.append(row)
            print(f"row at {time.perf_counter() - start:.0f} s: {json.dumps(row)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        folders = save_tiny_models(Path(tmp))
        big = Path(tmp, "llama-3.2-1b-shaped")
        big.mkdir()
        write_random_llama(big, LlamaConfig(**LLAMA_3_2_1B))
        folders["llama-3.2-1b-shaped"] = big
        for label in ATTENTION_SHAPES:
            report("attention", label, lambda: attention_parity(label, "cuda"))
        for name, folder in folders.items():
            report("parity", name, lambda: backend_parity(folder, name, "cuda", torch.bfloat16,
                                                          ("torch", "flashinfer")))
        report("decode", "llama-3.2-1b-shaped", lambda: decode_rows(big, "llama-3.2-1b-shaped", "cuda", [1, 8, 32],
                                                                   args.max_new_tokens, args.repeats))
        report("spec", "stories260K", lambda: spec_row(args.stories, "stories260K", "cuda", "torch",
                                                      args.max_new_tokens, args.repeats))
        report("spec", "llama-3.2-1b-shaped", lambda: spec_row(big, "llama-3.2-1b-shaped", "cuda", "flashinfer",
                                                              args.max_new_tokens, args.repeats))
    if rows:
        print_table(rows)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
