"""What tensor parallelism costs and saves on CPU: parameter bytes per rank, and decode speed, at 1 and TP ranks.

    python -m infer.bench.tp_report --stories ../shared/assets/stories260K/hf-reference --tp 2

Parameter bytes: a Llama-3.2-1B-shaped model (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192,
vocabulary 128256, tied embeddings) with random bf16 weights, written to a temporary folder and loaded once
whole and once by each of TP ranks (each reading only its slices). Expected per rank: (whole - replicated) / TP
+ replicated, where the replicated parts are the RMSNorm weights.
Decode speed: greedy stories260K through the Engine (tokens/s at each batch size, fastest of --repeats runs),
one process against TP gloo processes with one thread each: on a small CPU model the collectives cost more
than the split saves, which is what this measures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from infer.cli import CliError, run_cli
from infer.engine import Engine, EngineConfig
from infer.loader import load_model
from infer.parallel import init_tp, parameter_bytes, serve_forever, spawn, stop_workers
from infer.sampling_params import SamplingParams

LLAMA_3_2_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=8192),
)


def write_random_llama(folder: Path, config: LlamaConfig, seed: int = 0) -> None:
    """A checkpoint of random bf16 weights under the Hugging Face names, one safetensors file per layer."""
    gen = torch.Generator().manual_seed(seed)
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)

    files = {"model-embed.safetensors": {"model.embed_tokens.weight": rand(config.vocab_size, h),
                                         "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        files[f"model-layer{i:02d}.safetensors"] = {
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": rand(config.num_attention_heads * d, h),
            p + "self_attn.k_proj.weight": rand(config.num_key_value_heads * d, h),
            p + "self_attn.v_proj.weight": rand(config.num_key_value_heads * d, h),
            p + "self_attn.o_proj.weight": rand(h, config.num_attention_heads * d),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
        }
    weight_map = {}
    for name, tensors in files.items():
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(folder)


def replicated_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n)


def rank_bytes(tp: int, folder: str, out: str) -> None:
    """One rank: load its shard (bf16) and record what it holds."""
    group = init_tp(tp)
    model = load_model(folder, dtype=torch.bfloat16)
    Path(out, f"bytes{group.rank}.json").write_text(json.dumps(parameter_bytes(model)))


def decode_speed(stories: str, batch_sizes: list[int], new_tokens: int, repeats: int) -> dict[int, float]:
    """tokens/s of greedy decoding at each batch size (runs the engine: rank 0, or a single process)."""
    engine = Engine(load_model(stories), None, [], EngineConfig(page_size=16, num_pages=512, backend="torch"))
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate([[1, 400]], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    speeds = {}
    for batch in batch_sizes:
        prompts = [[1, 259 + i, 300 + i] for i in range(batch)]
        best = float("inf")
        for _ in range(repeats):  # noise on a shared machine only ever adds time
            start = time.perf_counter()
            engine.generate(prompts, params)
            best = min(best, time.perf_counter() - start)
        speeds[batch] = batch * new_tokens / best
    return speeds


def rank_decode(tp: int, stories: str, batch_sizes: list[int], new_tokens: int, repeats: int, out: str) -> None:
    """Rank 0 decodes and records; the others serve (all build the same engine, so the runners match)."""
    torch.set_num_threads(1)
    group = init_tp(tp)
    if group.rank == 0:
        speeds = decode_speed(stories, batch_sizes, new_tokens, repeats)
        stop_workers()
        Path(out, "decode.json").write_text(json.dumps(speeds))
    else:
        _engine = Engine(load_model(stories), None, [], EngineConfig(page_size=16, num_pages=512, backend="torch"))
        serve_forever()  # through _engine's runner, which registered itself on creation


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infer.bench.tp_report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stories", required=True, type=Path, help="stories260K Hugging Face folder")
    parser.add_argument("--tp", type=int, default=2, help="ranks to compare with one (default 2)")
    parser.add_argument("--batch-sizes", default="1,8", help="decode batch sizes (default 1,8)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per request (default 128)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per speed, the fastest counts (default 3)")
    parser.add_argument("--skip-1b", action="store_true", help="skip the Llama-3.2-1B-shaped byte count")
    args = parser.parse_args(argv)
    if args.tp < 2:
        raise CliError(f"--tp must be >= 2 to compare with one rank, got {args.tp}")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    result: dict = {"tp": args.tp, "threads_per_process": 1}
    with tempfile.TemporaryDirectory(prefix="tp_report_") as tmp:
        if not args.skip_1b:
            folder = Path(tmp, "llama-3.2-1b-shaped")
            folder.mkdir()
            write_random_llama(folder, LlamaConfig(**LLAMA_3_2_1B))
            whole = load_model(folder, dtype=torch.bfloat16)
            result["llama_1b_bytes"] = {"tp1": parameter_bytes(whole), "replicated": replicated_bytes(whole)}
            del whole
            spawn(rank_bytes, args.tp, args.tp, str(folder), tmp, timeout_s=1200)
            ranks = [json.loads(Path(tmp, f"bytes{r}.json").read_text()) for r in range(args.tp)]
            one, rep = result["llama_1b_bytes"]["tp1"], result["llama_1b_bytes"]["replicated"]
            result["llama_1b_bytes"].update(per_rank=ranks, expected_per_rank=(one - rep) // args.tp + rep)
        torch.set_num_threads(1)
        one_rank = decode_speed(str(args.stories), batch_sizes, args.max_new_tokens, args.repeats)
        spawn(rank_decode, args.tp, args.tp, str(args.stories), batch_sizes, args.max_new_tokens, args.repeats, tmp,
              timeout_s=1200)
        ranks = {int(k): v for k, v in json.loads(Path(tmp, "decode.json").read_text()).items()}
    result["stories_decode_tok_s"] = [{"batch_size": b, "tp1": round(one_rank[b], 1), f"tp{args.tp}": round(ranks[b], 1),
                                       "ratio": round(ranks[b] / one_rank[b], 3)} for b in batch_sizes]
    if "llama_1b_bytes" in result:
        b = result["llama_1b_bytes"]
        print(f"Llama-3.2-1B-shaped, bf16 parameter bytes: tp=1 {b['tp1']:,}; tp={args.tp} per rank "
              f"{', '.join(f'{r:,}' for r in b['per_rank'])} (expected {b['expected_per_rank']:,}: half of "
              f"{b['tp1'] - b['replicated']:,} split + {b['replicated']:,} replicated norms)")
    for row in result["stories_decode_tok_s"]:
        print(f"stories260K decode, batch {row['batch_size']}: tp=1 {row['tp1']} tok/s, tp={args.tp} "
              f"{row[f'tp{args.tp}']} tok/s (x{row['ratio']})")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
